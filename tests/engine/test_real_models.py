"""The engine over the real Llama model: batching and preemption change no token.

tiny_llama's goldens come from Hugging Face transformers (tests/fixtures/README.md), so the
batched greedy ids are checked against an independent implementation, and every concurrent
request against the same request run alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vkrt.backend import vulkan_unavailable_reason
from vkrt.engine import LLM, SamplingParams

TINY = Path(__file__).parents[1] / "fixtures" / "tiny_llama"
GOLDEN = json.loads((TINY / "golden.json").read_text()) if (TINY / "golden.json").is_file() else None
pytestmark = pytest.mark.skipif(GOLDEN is None, reason="tests/fixtures/tiny_llama is missing")


@pytest.fixture(params=["reference", "vulkan"])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "vulkan":
        reason = vulkan_unavailable_reason()
        if reason is not None:
            pytest.skip(f"Vulkan unavailable: {reason}")
    return str(request.param)


def tiny(device: str, **kwargs: Any) -> LLM:
    # f32 KV: the goldens are transformers' fp32 logits, compared at tight bounds.
    return LLM(TINY, device=device, max_model_len=128, **{"kv_dtype": "f32", **kwargs})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_batched_greedy_matches_transformers(device: str) -> None:
    assert GOLDEN is not None
    cases = GOLDEN["cases"]
    outputs = tiny(device).generate([c["input_ids"] for c in cases], greedy(16))
    for case, out in zip(cases, outputs, strict=True):
        assert out.token_ids == case["greedy_ids"]


def test_prompt_logprobs_match_transformers_logits(device: str) -> None:
    assert GOLDEN is not None
    case = GOLDEN["cases"][2]
    ids = case["input_ids"]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = tiny(device, max_num_batched_tokens=8).generate([ids], params)[0]  # over 3 chunks
    logits = np.asarray(case["all_logits"], dtype=np.float64)
    expected = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry is not None and abs(entry.token.logprob - expected[i - 1, ids[i]]) < 2e-3


def test_concurrent_greedy_requests_equal_solo_runs(device: str) -> None:
    prompts = random_prompts(10, seed=3)
    lengths = [4 + 3 * i for i in range(len(prompts))]  # finish at different steps
    params = [greedy(n) for n in lengths]
    llm = tiny(device, max_num_batched_tokens=32)  # chunked prefill mixes with decodes
    seqs_per_step: list[int] = []
    llm.engine.stats_listeners.append(lambda stats: seqs_per_step.append(stats.step.num_seqs))
    batched = llm.generate(prompts, params)
    assert max(seqs_per_step) >= 5  # really batched
    solo = tiny(device)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        assert out.token_ids == solo.generate([prompt], p)[0].token_ids


def test_preemption_with_a_tiny_kv_pool_changes_no_token(device: str) -> None:
    prompts = random_prompts(8, seed=4)
    params = greedy(24)
    # 32 blocks of 4 tokens: one max_model_len sequence fits, eight ~45-token ones do not.
    llm = tiny(device, block_size=4, num_kv_blocks=32, max_num_batched_tokens=24)
    batched = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    solo = tiny(device)
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.token_ids == solo.generate([prompt], params)[0].token_ids
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_seeded_sampling_is_batch_independent(device: str) -> None:
    prompts = random_prompts(4, seed=5)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = tiny(device)
    batched = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        assert out.token_ids == llm.generate([prompt], p)[0].token_ids
    assert batched[0].token_ids != llm.generate([prompts[0]], params[1])[0].token_ids


def test_smollm2_batched_greedy_and_chat_match_transformers(smollm2_path: Path) -> None:
    """The shipped model with its real tokenizer: a text and a chat prompt batched together."""
    golden = json.loads((TINY.parent / "smollm2_golden.json").read_text())
    text_case, chat_case = golden["text_prompts"][0], golden["chats"][0]
    # Reference backend: the slowest test here (~40 s on 2 cores), so only 6 tokens each.
    llm = LLM(smollm2_path, device="reference", max_model_len=256, kv_dtype="f32")
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    rendered = tokenizer.apply_chat_template(chat_case["messages"])
    assert rendered == chat_case["rendered"]
    chat_ids = tokenizer.encode(rendered, add_special_tokens=False)
    text_out, chat_out = llm.generate([text_case["prompt"], chat_ids], greedy(6))
    assert text_out.prompt_token_ids == text_case["prompt_ids"] and chat_ids == chat_case["prompt_ids"]
    assert text_out.token_ids == text_case["greedy_ids"][:6]
    assert chat_out.token_ids == chat_case["greedy_ids"][:6]
    assert text_out.text == tokenizer.decode(text_case["greedy_ids"][:6])
