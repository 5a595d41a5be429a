"""Logits holding NaN or Inf end their request with finish_reason "error" and a reason, on
both sampling paths (device ids, host logits), and leave the other requests alone."""

from __future__ import annotations

import pytest
from engine_fakes import FakeLM, PoisonedLM, byte_tokenizer

from vkrt.engine import LLM, SamplingParams

POISON = ord("!")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("logprobs", [None, 2], ids=["device-sampled", "host-sampled"])
def test_nonfinite_logits_end_the_request_with_an_error(value: float, logprobs: int | None) -> None:
    model = PoisonedLM(POISON, value)
    llm = LLM(model=model, tokenizer=byte_tokenizer(), device="reference", max_model_len=128, kv_dtype="f32")
    clean = list(b"hello")
    want = model.reference_greedy(clean, 6)
    assert POISON not in want  # the clean request never feeds the poison token
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    bad, good = llm.generate([list(b"hi!"), clean], params)
    assert bad.finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "logits after 3 tokens hold NaN or Inf" in (bad.outputs[0].error or "")
    assert good.finish_reason == "length" and good.outputs[0].token_ids == want and good.outputs[0].error is None
    assert llm.engine.totals.nonfinite_logits == 1
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_tokens_before_the_nonfinite_step_are_kept() -> None:
    prompt = list(b"ab")
    greedy = FakeLM().reference_greedy(prompt, 8)
    poison = greedy[3]  # the logits after the 4th generated token (or an earlier copy of it) go NaN
    n = greedy.index(poison) + 1
    llm = LLM(model=PoisonedLM(poison), tokenizer=byte_tokenizer(), device="reference", max_model_len=128,
              kv_dtype="f32")
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "error" and out.outputs[0].token_ids == greedy[:n]
