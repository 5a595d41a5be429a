"""The LLM facade over FakeLM: prompt forms, chat, seeded sampling, request errors, stats."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_fakes import CHAT_TEMPLATE, FakeLM

from vkrt.engine import LLM, SamplingParams
from vkrt.errors import RequestError, VkrtError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_text_and_id_prompts(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    by_text = llm.generate("héllo", GREEDY)
    by_ids = llm.generate([list("héllo".encode())], GREEDY)
    assert len(by_text) == 1 and by_text[0].prompt == "héllo"
    assert by_text[0].prompt_token_ids == list("héllo".encode())
    assert by_text[0].token_ids == by_ids[0].token_ids
    model = llm.engine.model
    assert isinstance(model, FakeLM)
    assert by_text[0].token_ids == model.reference_greedy(list("héllo".encode()), 8)
    batch = llm.generate(["a", "bb", "ccc"], [GREEDY, SamplingParams(max_tokens=2, ignore_eos=True), GREEDY])
    assert [len(o.token_ids) for o in batch] == [8, 2, 8] and [o.prompt for o in batch] == ["a", "bb", "ccc"]


def test_chat_renders_the_template(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt == "user: hi\nassistant:" and out.prompt_token_ids == list(b"user: hi\nassistant:")
    two = llm.chat([messages, [{"role": "user", "content": "yo"}]], GREEDY)
    assert two[0].token_ids == out.token_ids and len(two) == 2
    assert "{% for m in messages %}" in CHAT_TEMPLATE


def test_seeded_sampling_is_reproducible_and_batch_independent(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate("seeded", params)[0].token_ids
    noise = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batched = llm.generate(["other prompt", "seeded", "x"], [noise, params, noise])[1].token_ids
    assert batched == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=4321, ignore_eos=True)
    assert llm.generate("seeded", other_seed)[0].token_ids != alone


def test_bad_requests_raise_before_anything_runs(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(max_model_len=32)
    with pytest.raises(RequestError) as info:
        llm.generate(["ok", "x" * 40], GREEDY)
    assert info.value.param == "prompt" and "32" in str(info.value)
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate("ok", SamplingParams(max_tokens=0))
    with pytest.raises(RequestError, match="logit_bias"):
        llm.generate("ok", SamplingParams(logit_bias={10_000: 1.0}))
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate([[1, 2, 999]], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], GREEDY)
    assert not llm.engine.has_unfinished()


def test_token_id_prompts_work_without_a_tokenizer() -> None:
    llm = LLM(model=FakeLM(), max_model_len=64)
    out = llm.generate([[1, 2, 3]], GREEDY)[0]
    assert len(out.token_ids) == 8 and out.text == ""
    with pytest.raises(RequestError, match="tokenizer"):
        llm.generate("text", GREEDY)


def test_abandoned_stream_aborts_its_request(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    stream = llm.generate_stream("abandon", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    next(stream)
    stream.close()
    blocks = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks


def test_stats(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    llm.generate(["abc", "defg"], GREEDY)
    stats = llm.stats()
    assert stats["prompt_tokens"] == 7 and stats["generation_tokens"] == 16
    assert stats["decode_steps"] == 7 and stats["decode_tokens_per_second"] > 0
    assert stats["prefill_tokens_per_second"] > 0
    assert set(stats["decode_counters_per_step"]) >= {"dispatches", "submits", "fence_waits", "drains"}


def test_max_model_len_beyond_the_model_is_refused() -> None:
    with pytest.raises(VkrtError, match="max_position_embeddings"):
        LLM(model=FakeLM(max_len=64), max_model_len=128)
