"""Mamba2's chunked scan (SSD, an opt-in prefill kernel): its kernels (ssm_scan_{prep,chunk}.comp)
against the scan's numpy reference and the chunked one (`ssm_scan_chunked`, itself tested against
the scan in tests/ops/test_recurrent.py).

llvmpipe selects the recurrent scan for prefill, so these tests force the chunked form with
VKRT_MAMBA2=chunked and each chunk size a device may run (16 on CPU devices, 64 on GPUs). The
steps mix what a prefill step holds: a fresh prompt longer than a chunk, a carried sequence that
crosses chunk boundaries at an offset, a sequence of exactly CHUNKED_FROM tokens, one just under
it, a decode row and a padding sequence; at odd head counts, head dims and state sizes, several
heads per group, with and without time-step limits.

Bounds (measured on llvmpipe, both access paths): the kernels against the float64 references,
NMSE <= 4.6e-14 (outputs) and <= 9.6e-14 (state), asserted at the recurrent scan's bound
GDN_NMSE = 1e-10; a 2100-token prompt at state size 128, <= 2.1e-13. Sequences shorter than CHUNKED_FROM run the
recurrent kernel in the same step and equal it run alone bit for bit (batch invariance).

Not verified here: the kernels on a GPU (none was available), nor their speed there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from tests.ops.conftest import Shaders
from tests.ops.test_recurrent import (
    GDN_NMSE,
    SSM_CASES,
    SSM_NAMES,
    run_ssm,
    ssm_inputs,
    step_inputs,
)
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import recurrent as native
from vkrt.errors import VkrtError
from vkrt.ops.recurrent import ssm_scan_chunked

LIMITS = [{}, {"dt_min": 0.2, "dt_max": 1.5}]
LIMIT_IDS = ["no-limit", "dt-limit"]
# fresh prompt (> a chunk), carried sequence crossing boundaries, exactly CHUNKED_FROM, one under
# it, a decode row, padding
LENGTHS, STARTS, SLOTS = [70, 130, 16, 15, 1, 0], [0, 5, 0, 40, 20, 0], [2, 4, 5, 0, 1, 3]
CHUNKED = [i for i, n in enumerate(LENGTHS) if n >= native.CHUNKED_FROM]
RECURRENT = [i for i, n in enumerate(LENGTHS) if 0 < n < native.CHUNKED_FROM]
SHAPE_IDS = "h{}-p{}-g{}-n{}".format


def reference(x: dict[str, np.ndarray], state: np.ndarray, step: dict[str, np.ndarray], shape: tuple[int, ...],
              chunk: int = 0, **limits: Any) -> tuple[np.ndarray, np.ndarray]:
    """The scan's reference (chunk 0) or the chunked one: outputs and the state it leaves."""
    state = state.copy()
    args = (*(x[n] for n in SSM_NAMES), state, step["seq_start"], step["positions"], step["state_slots"], *shape)
    if chunk:
        return ssm_scan_chunked(*args, chunk=chunk, **limits), state
    return ops.OPS["ssm_scan"].reference(*args, **limits), state


def case(rng: np.random.Generator, shape: tuple[int, int, int, int], lengths: list[int] = LENGTHS,
         ) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
    step = step_inputs(lengths, STARTS[:len(lengths)], SLOTS[:len(lengths)])
    x = ssm_inputs(rng, int(step["seq_start"][-1]), *shape)
    heads, head_dim, _, size = shape
    return x, (rng.standard_normal((6, heads, head_dim, size)) * 0.3).astype(np.float32), step


def run(vk: Backend, x: dict[str, np.ndarray], state: np.ndarray, step: dict[str, np.ndarray],
        shape: tuple[int, ...], **limits: Any) -> tuple[np.ndarray, np.ndarray]:
    s = vk.upload(state)
    drains = vk.counters.drains
    y = run_ssm(vk, x, s, step, shape, **limits)  # type: ignore[arg-type]
    assert vk.counters.drains == drains, "ssm_scan ran on the host"
    return y, s.numpy()


def force(monkeypatch: pytest.MonkeyPatch, form: str, chunk: int = 16) -> None:
    monkeypatch.setenv("VKRT_MAMBA2", form)
    monkeypatch.setattr(native, "prefill_chunk", lambda caps: chunk)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("limits", LIMITS, ids=LIMIT_IDS)
@pytest.mark.parametrize("shape", SSM_CASES, ids=lambda c: SHAPE_IDS(*c))
def test_chunked_kernel_matches_references(vk: Backend, shaders: Shaders, monkeypatch: pytest.MonkeyPatch,
                                           rng: np.random.Generator, shape: tuple[int, int, int, int],
                                           limits: dict[str, float], chunk: int) -> None:
    x, state, step = case(rng, shape)
    force(monkeypatch, "chunked", chunk)
    got, got_state = run(vk, x, state, step, shape, **limits)
    assert shaders.families() == ["ssm_scan_prep", "ssm_scan_chunk", "ssm_scan"]
    assert shaders.seen[0][1][2] == chunk
    for chunked in (0, chunk):
        want, want_state = reference(x, state, step, shape, chunked, **limits)
        assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
    np.testing.assert_array_equal(got_state[3], state[3])  # the padding sequence's slot is untouched
    # the short sequences ran the recurrent kernel: the same bits as a step the chunked kernels sit out
    force(monkeypatch, "recurrent")
    alone, alone_state = run(vk, x, state, step, shape, **limits)
    rows = np.concatenate([np.arange(step["seq_start"][s], step["seq_start"][s + 1]) for s in RECURRENT])
    np.testing.assert_array_equal(got[rows], alone[rows])
    slots = step["state_slots"][RECURRENT]
    np.testing.assert_array_equal(got_state[slots], alone_state[slots])
    chunked_rows = np.concatenate([np.arange(step["seq_start"][s], step["seq_start"][s + 1]) for s in CHUNKED])
    assert not np.array_equal(got[chunked_rows], alone[chunked_rows])  # those did run another kernel


def test_prefill_then_decode_equals_stepwise(vk: Backend, monkeypatch: pytest.MonkeyPatch,
                                             rng: np.random.Generator) -> None:
    """A 100-token prompt prefilled in one chunked step, or in chunked steps of 40 + 60 (the
    second carrying the first's state), then 5 decode steps: each equals the same 105 tokens
    walked one at a time, within the bound, and the scan's reference over all 105."""
    shape = (6, 5, 3, 7)
    n = 105
    x = ssm_inputs(rng, n, *shape)
    force(monkeypatch, "chunked", 16)

    def walk(steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
        state = vk.upload(np.full((1, 6, 5, 7), 0.5, np.float32))  # garbage until position 0 clears it
        outs, start = [], 0
        for size in steps:
            part = {k: (a[start:start + size] if k in ("xbc", "dt") else a) for k, a in x.items()}
            outs.append(run_ssm(vk, part, state, step_inputs([size], [start], [0]), shape))
            start += size
        return np.concatenate(outs), state.numpy()

    stepwise, stepwise_state = walk([1] * n)
    want, want_state = reference(x, np.zeros((1, 6, 5, 7), np.float32), step_inputs([n], [0], [0]), shape)
    assert nmse(stepwise, want) <= GDN_NMSE
    for steps in ([100] + [1] * 5, [40, 60] + [1] * 5):
        got, got_state = walk(steps)
        assert nmse(got, stepwise) <= GDN_NMSE and nmse(got_state, stepwise_state) <= GDN_NMSE
        assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
        assert not np.array_equal(got[:100], stepwise[:100])  # the prefill did run the chunked form


def test_selection(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrent scan for prefill on every device by default (the chunked form is opt-in until
    measured on a GPU); VKRT_MAMBA2 picks either, independently of VKRT_DELTA_NET."""
    caps = vk_default.caps  # type: ignore[attr-defined]
    monkeypatch.delenv("VKRT_MAMBA2", raising=False)
    monkeypatch.setenv("VKRT_DELTA_NET", "chunked")
    for kind in ("cpu", "discrete", "integrated"):
        assert native.mamba2_form(replace(caps, device_type=kind)) == "recurrent"
    monkeypatch.setenv("VKRT_MAMBA2", "Chunked")
    assert native.mamba2_form(replace(caps, device_type="cpu")) == "chunked"
    monkeypatch.setenv("VKRT_MAMBA2", "recurrent")
    assert native.mamba2_form(replace(caps, device_type="discrete")) == "recurrent"
    monkeypatch.setenv("VKRT_MAMBA2", "ssd")
    with pytest.raises(VkrtError, match="VKRT_MAMBA2 must be 'chunked' or 'recurrent', not 'ssd'"):
        native.mamba2_form(caps)


@pytest.mark.parametrize("vk", ["texel"], indirect=True)
def test_decode_and_short_steps_stay_recurrent(vk: Backend, shaders: Shaders, monkeypatch: pytest.MonkeyPatch,
                                               rng: np.random.Generator) -> None:
    """Chunked forced: a decode step, and a step whose sequences cannot reach CHUNKED_FROM tokens,
    dispatch the recurrent scan alone; a lone long sequence the chunked kernels alone."""
    shape = (4, 8, 2, 16)
    force(monkeypatch, "chunked")
    for lengths, want in (([1, 1, 1], ["ssm_scan"]), ([8, 8, 1], ["ssm_scan"]),
                          ([40], ["ssm_scan_prep", "ssm_scan_chunk"])):
        shaders.seen.clear()
        x, state, step = case(rng, shape, lengths)
        got, _ = run(vk, x, state, step, shape)
        assert shaders.families() == want, lengths
        assert nmse(got, reference(x, state, step, shape)[0]) <= GDN_NMSE


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("vk", ["texel"], indirect=True)
def test_chunked_kernel_long_prompt(vk: Backend, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator,
                                    chunk: int) -> None:
    """A 2100-token prompt (a bench prefill's length, not a multiple of either chunk) after a
    carried state, at a real model's state size: within the bound of the reference, so no loop of
    the walk ran out of gallivm's budget (which ends loops silently) and errors do not grow over
    many chunks."""
    shape = (2, 4, 1, 128)
    x = ssm_inputs(rng, 2100, *shape)
    x["dt"] -= 3.0  # steps around softplus(-3) ~ 0.05, as trained models' are: the state remembers far back
    step = step_inputs([2100], [7], [0])
    state = (rng.standard_normal((1, 2, 4, 128)) * 0.3).astype(np.float32)
    force(monkeypatch, "chunked", chunk)
    got, got_state = run(vk, x, state, step, shape)
    want, want_state = reference(x, state, step, shape)
    assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
    assert nmse(got[-100:], want[-100:]) <= GDN_NMSE  # the last chunks too, not only on average
