"""Gemma-3-270M (base, Q4_K_M GGUF): vkrt's greedy ids equal transformers' fp32 ids on the same file.

The golden (tests/fixtures/gemma3_270m_golden.json, tools/make_tokenizer_fixtures.py) is a
full-recompute argmax loop in transformers, 32 steps per prompt, eos not a stop. The rule: ids
must be equal step by step; a mismatch is tolerated only at a step whose recorded top1 - top2
margin is below 0.05 (a near-tie that Q4_K dequantisation order or f32 accumulation may flip),
and comparison stops there, since the continuations then diverge. The first step's top 5
are also compared (ids, and logits relative to the argmax's within 2e-2; measured 1.4e-3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import FIXTURES
from vkrt.engine import LLM, SamplingParams
from vkrt.tokenizer import Tokenizer

GOLDEN = json.loads((FIXTURES / "gemma3_270m_golden.json").read_text(encoding="utf-8"))
NEAR_TIE = 0.05
TOP5_TOL = 2e-2  # logit differences after the prompt: Q4_K dequantised exactly, f32 compute


def agreeing_prefix(actual: list[int], case: dict[str, Any]) -> int:
    """How many leading ids agree; fails on a mismatch at a step whose margin is not a near-tie."""
    expected, margins = case["greedy_ids"], case["greedy_margins"]
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        if got != want:
            assert margins[step] < NEAR_TIE, (
                f"{case['prompt']!r}: step {step} gave {got}, transformers {want} "
                f"(margin {margins[step]} >= {NEAR_TIE}); vkrt {actual}, transformers {expected}")
            return step
    return len(expected)


def test_prompt_ids_equal_transformers(gemma3_path: Path) -> None:
    tok = Tokenizer.from_gguf(gemma3_path)
    for case in GOLDEN["cases"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"]


def test_greedy_ids_equal_transformers(gemma3_path: Path) -> None:
    assert GOLDEN["meta"]["gguf_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    cases = GOLDEN["cases"]
    steps = len(cases[0]["greedy_ids"])
    llm = LLM(gemma3_path, device="auto", max_model_len=128, max_num_seqs=len(cases))
    outputs = llm.generate([c["prompt_ids"] for c in cases],
                           SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    for out, case in zip(outputs, cases, strict=True):
        assert len(out.token_ids) == steps
        agreeing_prefix(out.token_ids, case)


def test_first_step_top5_equals_transformers(gemma3_path: Path) -> None:
    """The prompt's last-position distribution: the top-5 ids, and each one's logit relative to
    the argmax's (logprob differences equal logit differences), within TOP5_TOL."""
    cases = GOLDEN["cases"]
    llm = LLM(gemma3_path, device="auto", max_model_len=128, max_num_seqs=len(cases))
    outputs = llm.generate([c["prompt_ids"] for c in cases],
                           SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    for out, case in zip(outputs, cases, strict=True):
        logprobs = out.outputs[0].logprobs
        assert logprobs is not None
        top = {lp.token_id: lp.logprob for lp in logprobs[0].top}
        golden = case["first_step_top5"]
        best = golden["ids"][0]
        assert max(top, key=lambda i: top[i]) == best
        for token_id, logit in zip(golden["ids"], golden["logits"], strict=True):
            # A 4th/5th pair closer than the tolerance may swap places; present ones must agree.
            if token_id in top:
                assert abs((top[token_id] - top[best]) - (logit - golden["logits"][0])) < TOP5_TOL, case["prompt"]
        assert sum(i in top for i in golden["ids"]) >= 4, (case["prompt"], sorted(top), golden["ids"])
