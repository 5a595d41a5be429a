"""Structured output's token masks are computed while the device runs the replayed step: the
mask of a constrained row is filled after the step's submit and before its fence wait (a
submit in flight), the step is still 1 submit, 1 fence wait, 0 drains, and the sampled tokens
obey the masks. A guide that fails aborts its request alone; the device is never left waiting.

The guides here are stand-ins with fixed allowed sets (llguidance needs a tokenizer, which the
tiny fixture lacks); tests/engine/test_guided.py runs real grammars on SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vkrt.backend import vulkan_unavailable_reason
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.request import RequestOutput
from vkrt.engine.runner import StepStats

TINY = Path(__file__).parents[1] / "fixtures" / "tiny_llama"
PROMPTS = [[5, 9, 11, 200], [1, 2, 3], [77] * 9, [250, 3, 40, 41, 42, 7], [8, 8], [100, 101, 102], [33]]


def tiny(**kwargs: Any) -> LLM:
    reason = vulkan_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Vulkan unavailable: {reason}")
    return LLM(TINY, device="vulkan", max_model_len=128, kv_dtype="f32", max_num_seqs=8, **kwargs)


class FixedGuide:
    """Allows only `allowed`; notes, per mask, the engine step it was filled in and how many
    submits were not yet waited for then. Raises on mask number `fail_at` (0-based)."""

    def __init__(self, llm: LLM, steps: list[StepStats], allowed: list[int], fail_at: int | None = None) -> None:
        self.counters = llm.engine.model.backend.counters
        self.steps = steps
        self.allowed = allowed
        self.fail_at = fail_at
        self.fills: list[tuple[int, int]] = []  # (step index, submits in flight)
        self.is_complete = False
        self.error = ""

    def fill_mask(self, row: np.ndarray) -> None:
        self.fills.append((len(self.steps), self.counters.submits - self.counters.fence_waits))
        if len(self.fills) - 1 == self.fail_at:
            raise ValueError("the matcher is in an error state")
        row[:] = 0
        for token in self.allowed:
            row[token // 32] |= np.uint32(1 << (token % 32))

    def advance(self, token_id: int) -> bool:
        return token_id in self.allowed


def run(llm: LLM, params: list[SamplingParams], guides: list[FixedGuide | None],
        prompts: list[list[int]] = PROMPTS) -> dict[str, RequestOutput]:
    engine = llm.engine
    for i, (prompt, p, guide) in enumerate(zip(prompts, params, guides, strict=False)):
        engine.add_request(str(i), prompt, p).guide = guide  # type: ignore[assignment]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return final


def record_steps(llm: LLM) -> list[StepStats]:
    steps: list[StepStats] = []
    llm.engine.stats_listeners.append(lambda stats: steps.append(stats.step))
    return steps


@pytest.mark.parametrize("host_sampled", [False, True], ids=["device-sampled", "host-sampled"])
def test_masks_are_computed_while_the_replayed_step_runs(host_sampled: bool) -> None:
    llm = tiny()
    steps = record_steps(llm)
    extra = {"repetition_penalty": 1.2} if host_sampled else {}  # the host samples every row then
    # Two constrained rows, then five unconstrained ones that run longer: 7 rows and then 5
    # replay the same bucket-8 graph, so rows 0 and 1 lose their constraint mid-run.
    free = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **extra),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=40, seed=3, ignore_eos=True, **extra)] + [free] * 5
    guides = [FixedGuide(llm, steps, [17, 40, 41]), FixedGuide(llm, steps, [3, 64, 200, 255])]
    outputs = run(llm, params, [*guides] + [None] * 5)
    for i, guide in enumerate(guides):
        assert len(outputs[str(i)].token_ids) == 6
        assert set(outputs[str(i)].token_ids) <= set(guide.allowed)
        assert len(guide.fills) == 6
        for step, in_flight in guide.fills:
            # Replayed: after the submit, before the fence wait. Eager (the prefill): before.
            assert in_flight == (1 if steps[step].replayed else 0), (step, steps[step])
        assert sum(steps[step].replayed for step, _ in guide.fills) == 5
    constrained = {step for step, _ in guides[0].fills}
    for index, step in enumerate(steps):
        if step.replayed:
            c = step.counters
            assert (c["submits"], c["fence_waits"], c["drains"]) == (1, 1, 0)
            assert c["host_overlaps"] == (1 if index in constrained else 0)
            if not host_sampled:
                assert c["bytes_down"] == 4 * (1 << (step.num_seqs - 1).bit_length())  # ids only
    assert any(s.replayed and s.counters["host_overlaps"] == 0 for s in steps)  # after they finished
    # The unconstrained rows saw all-ones masks throughout (rows 0 and 1 too, once the
    # constrained requests had left them): their tokens are those they get without them.
    alone = run(tiny(), [free] * 5, [None] * 5, PROMPTS[2:])
    assert [outputs[str(i)].token_ids for i in range(2, 7)] == [alone[str(i)].token_ids for i in range(5)]


def test_a_failing_mask_aborts_only_its_request() -> None:
    llm = tiny()
    steps = record_steps(llm)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True) for _ in range(3)]
    failing = FixedGuide(llm, steps, [17, 40, 41], fail_at=3)  # the prefill's mask, then two decode steps
    healthy = FixedGuide(llm, steps, [3, 64, 200])
    outputs = run(llm, params, [failing, healthy, None])
    assert outputs["0"].finish_reason == "abort"
    assert len(outputs["0"].token_ids) == 3 and set(outputs["0"].token_ids) <= {17, 40, 41}
    assert steps[failing.fills[-1][0]].replayed  # it failed inside a replayed step
    for key in ("1", "2"):
        assert outputs[key].finish_reason == "length" and len(outputs[key].token_ids) == 8
    assert set(outputs["1"].token_ids) <= {3, 64, 200}
    for step in steps:
        if step.replayed:
            assert (step.counters["submits"], step.counters["fence_waits"], step.counters["drains"]) == (1, 1, 0)
    counters = llm.engine.model.backend.counters
    assert counters.submits == counters.fence_waits
