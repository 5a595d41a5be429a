"""Speculative decoding on real kernels: tiny transformers fixtures and the default model.

On the tiny fixtures (random prompts: nothing for the n-gram lookup to find) an oracle proposes
transformers' own greedy continuation with every third proposal wrong, so verify steps accept
and reject across KV blocks; the ids must stay transformers'. On SmolLM2 the real n-gram
proposer runs on a prompt that asks for a copy of its input; its ids must equal plain decoding,
and each verify step must be one replayed submit with no drain.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vkrt.engine.engine as engine_module
from tests.conftest import FIXTURES
from tests.server.live_model import test_device as device_for_tests
from vkrt.engine import LLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import GuidedDecoding
from vkrt.engine.speculative import SpeculativeConfig

NGRAM = SpeculativeConfig("ngram", 3, 4, 2)
# Full attention, sliding windows with a softcap, MoE, a GQA head layout: each family's verify step.
FAMILIES = ["tiny_llama", "tiny_gemma2", "tiny_gemma3", "tiny_qwen3_moe", "tiny_mixtral"]


def _cases(fixture: str) -> list[dict]:
    return json.loads((FIXTURES / fixture / "golden.json").read_text())["cases"]


def _oracle_run(fixture: str, monkeypatch: pytest.MonkeyPatch, **config: Any) -> tuple[LLM, list[Any]]:
    """Every golden prompt of `fixture` at once, proposals from an oracle that knows transformers'
    greedy continuation with every third proposal wrong, so verify steps accept and reject
    across KV blocks of 4: the ids must stay transformers'. The LLM, for its counters, and the
    stats of every verify step."""
    cases = _cases(fixture)
    truth = {tuple(c["input_ids"]): c["greedy_ids"] for c in cases}

    def propose(tokens: list[int], k: int, _max: int, _min: int) -> list[int]:
        for prompt, rest in truth.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return [t if (done + i) % 3 else (t + 1) % 8 for i, t in enumerate(rest[done:done + k])]
        return []

    monkeypatch.setattr(engine_module, "ngram_proposal", propose)
    llm = LLM(FIXTURES / fixture, device=device_for_tests(), kv_dtype="f32", block_size=4, max_model_len=64,
              speculative=NGRAM, **config)
    verify_steps: list[Any] = []
    llm.engine.stats_listeners.append(lambda stats: verify_steps.append(stats) if stats.spec.num_drafts else None)
    n = len(cases[0]["greedy_ids"])
    outs = llm.generate([c["input_ids"] for c in cases], SamplingParams(max_tokens=n, temperature=0.0,
                                                                         ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases]
    spec = llm.engine.totals.spec
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens, spec
    return llm, verify_steps


# Eager verify steps too: a sequence of 4 tokens is prefill-shaped for attention there (GQA
# tiles of 2 tokens), decode-shaped in the replayed graph; both give the same bits.
@pytest.mark.parametrize("fixture, replay", [(f, True) for f in FAMILIES] + [("tiny_llama", False),
                                                                              ("tiny_gemma3", False)])
def test_verify_steps_keep_transformers_greedy_ids(fixture: str, replay: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    llm, _ = _oracle_run(fixture, monkeypatch, enable_replay=replay)
    if replay and llm.engine.runner.replay:
        assert llm.engine.totals.decode_counters_max["submits"] == 1


# One of each recurrent mixer: gated delta net (Qwen3.5's), short conv (LFM2), Mamba2 (Granite
# 4), attention beside Mamba2 in one layer (Falcon-H1); prefix caching on and off.
@pytest.mark.parametrize("fixture, prefix_caching", [("tiny_qwen3_5", True), ("tiny_lfm2", False),
                                                     ("tiny_granite4", True), ("tiny_falcon_h1", False)])
def test_hybrid_verify_steps_roll_the_state_back(fixture: str, prefix_caching: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid's recurrent state runs on through a verify step's proposals; after a rejection
    the request goes back to the state its checkpoint kept and recomputes the accepted tokens,
    so the ids stay transformers'. Every state slot is free again at the end. Verify steps replay
    the recorded decode step (their checkpoint copies in a submit of their own before it)."""
    llm, verify_steps = _oracle_run(fixture, monkeypatch, enable_prefix_caching=prefix_caching)
    states = llm.engine.block_manager.states
    assert states is not None and states.num_free == states.num_slots
    if llm.engine.runner.replay:
        replayed = [s for s in verify_steps if s.step.replayed]
        assert replayed and all(s.step.counters["submits"] == 2 for s in replayed)


def test_hybrid_target_with_a_draft_model() -> None:
    """tiny_llama (the same 256 ids) drafts for tiny_qwen3_5: proposals of another model are
    mostly rejected, every rejection rolls the target's state back, and its ids stay transformers'."""
    cases = _cases("tiny_qwen3_5")
    llm = LLM(FIXTURES / "tiny_qwen3_5", device=device_for_tests(), kv_dtype="f32", block_size=4, max_model_len=64,
              speculative=SpeculativeConfig("draft_model", 3, model=str(FIXTURES / "tiny_llama")))
    outs = llm.generate([c["input_ids"] for c in cases],
                        SamplingParams(max_tokens=len(cases[0]["greedy_ids"]), temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases]
    spec = llm.engine.totals.spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens < spec.num_draft_tokens, spec


def test_hybrid_speculation_under_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    """Too few KV blocks for every prompt at once: requests are preempted between verify steps
    and rollbacks, recompute from nothing, and still give transformers' ids."""
    llm, _ = _oracle_run("tiny_qwen3_5", monkeypatch, enable_prefix_caching=False, num_kv_blocks=20)
    assert llm.engine.num_preemptions > 0


COPY = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n")
PROMPTS = ["Here is some Python code.\n\n```python\n" + COPY + "```\n\nThe same code again:\n\n```python\n",
           "The capital of France is"]


@pytest.fixture(scope="module")
def smollm2_runs(smollm2_path: Path) -> Iterator[dict[str, LLM]]:
    yield {"plain": LLM(smollm2_path, device=device_for_tests(), max_model_len=512, max_num_seqs=4),
           "spec": LLM(smollm2_path, device=device_for_tests(), max_model_len=512, max_num_seqs=4, speculative=NGRAM)}


def test_ngram_on_the_default_model_equals_plain_decoding(smollm2_runs: dict[str, LLM]) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = [smollm2_runs["plain"].generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    spec_llm = smollm2_runs["spec"]
    spec_llm.engine.reset_totals()
    alone = [spec_llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == plain
    totals = spec_llm.engine.totals
    assert totals.spec.acceptance_rate > 0.5, totals.spec  # the copy is mostly proposed right
    if spec_llm.engine.runner.replay:  # each decode and verify step: one replayed submit, no drain
        assert totals.decode_counters_max["submits"] == 1 and totals.decode_counters_max["drains"] == 0
    together = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS * 2, params)]
    assert together == plain * 2


def test_constrained_ngram_on_the_default_model_equals_plain_decoding(smollm2_runs: dict[str, LLM]) -> None:
    """A JSON schema whose answer repeats the prompt's list: the grammar's masks on every verify
    row, proposals cut where the schema stops accepting them, the same ids as plain decoding."""
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "minItems": 8, "maxItems": 8}
    prompt = ('Colours as JSON: ["red", "green", "blue", "yellow", "red", "green", "blue", "yellow"]\n'
              "The same colours as JSON: ")
    params = SamplingParams(max_tokens=48, temperature=0.0, guided_decoding=GuidedDecoding("json", schema))
    [plain] = smollm2_runs["plain"].generate([prompt], params)
    spec_llm = smollm2_runs["spec"]
    spec_llm.engine.reset_totals()
    [spec] = spec_llm.generate([prompt], params)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(json.loads(spec.outputs[0].text)) == 8
    assert spec_llm.engine.totals.spec.num_accepted_tokens > 0, spec_llm.engine.totals.spec
