"""The chunked form of the gated delta rule (an opt-in prefill kernel): its numpy definition against the
recurrent reference, and its kernels (gated_delta_net_{norm,prep,chunk}.comp) against both.

llvmpipe selects the recurrent kernel for prefill, so these tests force the chunked form with
VKRT_DELTA_NET=chunked and each chunk size a device may run (16 on CPU devices, 64 on GPUs).
The steps mix what a prefill step holds: a fresh prompt longer than a chunk, a carried chunk
that crosses chunk boundaries at an offset, a sequence of exactly CHUNKED_FROM tokens, one just
under it, a decode row and a padding sequence; heads grouped or tiled, GQA (k-heads < v-heads),
beta_scale 2.

Bounds (measured on llvmpipe): the chunked reference rounds to the same f32 outputs and state as
the recurrent one (NMSE 0; in float64 the two differ by NMSE <= 1.3e-29), asserted at 1e-12. The
kernels against the float64 reference: NMSE <= 1.2e-12 (state) and <= 2.3e-13 (outputs), under
the recurrent kernel's bound GDN_NMSE = 1e-10. Sequences shorter than CHUNKED_FROM run the
recurrent kernel in the same step and equal it run alone bit for bit (batch invariance).

Run by hand with VKRT_DELTA_NET=chunked, tests/models/test_golden_paths.py's delta-net fixtures
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid; HF and GGUF, so tiled heads) pass against
transformers on both access paths.

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
from tests.ops.test_recurrent import GDN_CASES, GDN_NMSE, gdn_inputs, run_gdn, step_inputs
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import recurrent as native
from vkrt.errors import VkrtError
from vkrt.ops.recurrent import gated_delta_net_chunked

REFERENCE_NMSE = 1e-12
VARIANTS = [(False, 1.0), (True, 1.0), (False, 2.0)]
VARIANT_IDS = ["grouped", "tiled", "negative-eigenvalues"]
# fresh prompt (> a chunk), carried chunk crossing boundaries, exactly CHUNKED_FROM, one under it,
# a decode row, padding
LENGTHS, STARTS, SLOTS = [70, 130, 16, 15, 1, 0], [0, 5, 0, 40, 20, 0], [2, 4, 5, 0, 1, 3]
CHUNKED = [i for i, n in enumerate(LENGTHS) if n >= native.CHUNKED_FROM]
RECURRENT = [i for i, n in enumerate(LENGTHS) if 0 < n < native.CHUNKED_FROM]


def reference(x: dict[str, np.ndarray], state: np.ndarray, step: dict[str, np.ndarray], heads: tuple[int, ...],
              chunk: int = 0, **params: Any) -> tuple[np.ndarray, np.ndarray]:
    """The op's recurrent reference (chunk 0) or the chunked one: outputs and the state it leaves."""
    state = state.copy()
    args = (x["qkv"], x["ba"], x["a_rate"], x["dt_bias"], state, step["seq_start"], step["positions"],
            step["state_slots"], *heads)
    if chunk:
        return gated_delta_net_chunked(*args, chunk=chunk, **params), state
    return ops.OPS["gated_delta_net"].reference(*args, **params), state


def case(rng: np.random.Generator, heads: tuple[int, int, int, int],
         lengths: list[int] = LENGTHS) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
    step = step_inputs(lengths, STARTS[:len(lengths)], SLOTS[:len(lengths)])
    x = gdn_inputs(rng, int(step["seq_start"][-1]), *heads)
    hk, hv, dk, dv = heads
    return x, (rng.standard_normal((6, hv, dk, dv)) * 0.3).astype(np.float32), step


@pytest.mark.parametrize("chunk", [16, 64, 5])
@pytest.mark.parametrize(("tiled", "beta_scale"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("heads", GDN_CASES, ids=lambda h: "hk{}-hv{}-dk{}-dv{}".format(*h))
def test_chunked_reference_equals_recurrent(rng: np.random.Generator, heads: tuple[int, int, int, int],
                                            tiled: bool, beta_scale: float, chunk: int) -> None:
    x, state, step = case(rng, heads)
    want, want_state = reference(x, state, step, heads, tiled_heads=tiled, beta_scale=beta_scale)
    got, got_state = reference(x, state, step, heads, chunk, tiled_heads=tiled, beta_scale=beta_scale)
    assert nmse(got, want) <= REFERENCE_NMSE and nmse(got_state, want_state) <= REFERENCE_NMSE
    np.testing.assert_array_equal(got_state[3], state[3])  # the padding sequence's slot


def force(monkeypatch: pytest.MonkeyPatch, form: str, chunk: int = 16) -> None:
    monkeypatch.setenv("VKRT_DELTA_NET", form)
    monkeypatch.setattr(native, "prefill_chunk", lambda caps: chunk)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize(("tiled", "beta_scale"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("heads", GDN_CASES, ids=lambda h: "hk{}-hv{}-dk{}-dv{}".format(*h))
def test_chunked_kernel_matches_references(vk: Backend, shaders: Shaders, monkeypatch: pytest.MonkeyPatch,
                                           rng: np.random.Generator, heads: tuple[int, int, int, int], tiled: bool,
                                           beta_scale: float, chunk: int) -> None:
    x, state, step = case(rng, heads)
    force(monkeypatch, "chunked", chunk)
    got, got_state = run_gdn(vk, x, state, step, heads, tiled, beta_scale)
    assert shaders.families() == ["gated_delta_net_norm", "gated_delta_net_prep", "gated_delta_net_chunk",
                                  "gated_delta_net"]
    assert shaders.seen[1][1][2] == chunk
    for chunked in (0, chunk):
        want, want_state = reference(x, state, step, heads, chunked, tiled_heads=tiled, beta_scale=beta_scale)
        assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
    np.testing.assert_array_equal(got_state[3], state[3])  # the padding sequence's slot is untouched
    # the short sequences ran the recurrent kernel: the same bits as a step the chunked kernels sit out
    force(monkeypatch, "recurrent")
    alone, alone_state = run_gdn(vk, x, state, step, heads, tiled, beta_scale)
    rows = np.concatenate([np.arange(step["seq_start"][s], step["seq_start"][s + 1]) for s in RECURRENT])
    np.testing.assert_array_equal(got[rows], alone[rows])
    slots = step["state_slots"][RECURRENT]
    np.testing.assert_array_equal(got_state[slots], alone_state[slots])
    chunked_rows = np.concatenate([np.arange(step["seq_start"][s], step["seq_start"][s + 1]) for s in CHUNKED])
    assert not np.array_equal(got[chunked_rows], alone[chunked_rows])  # those did run another kernel


def test_prefill_then_decode_equals_stepwise(vk: Backend, monkeypatch: pytest.MonkeyPatch,
                                             rng: np.random.Generator) -> None:
    """A 100-token prompt prefilled in one chunked step, or in chunked steps of 40 + 60, then 5
    decode steps: each equals the same 105 tokens walked one at a time (recurrent), within the
    bound, and the recurrent reference over all 105."""
    heads = (2, 4, 32, 24)
    n = 105
    x = gdn_inputs(rng, n, *heads)
    force(monkeypatch, "chunked", 16)

    def run(steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
        state = vk.upload(np.full((1, 4, 32, 24), 0.5, np.float32))  # garbage until position 0 clears it
        outs, start = [], 0
        for size in steps:
            step = step_inputs([size], [start], [0])
            part = {k: (a[start:start + size] if k in ("qkv", "ba") else a) for k, a in x.items()}
            outs.append(ops.gated_delta_net(*(vk.upload(part[k]) for k in ("qkv", "ba", "a_rate", "dt_bias")), state,
                                            vk.upload(step["seq_start"]), vk.upload(step["positions"]),
                                            vk.upload(step["state_slots"]), *heads).numpy())
            start += size
        return np.concatenate(outs), state.numpy()

    stepwise, stepwise_state = run([1] * n)
    want, want_state = reference(x, np.zeros((1, 4, 32, 24), np.float32), step_inputs([n], [0], [0]), heads)
    assert nmse(stepwise, want) <= GDN_NMSE
    for steps in ([100] + [1] * 5, [40, 60] + [1] * 5):
        got, got_state = run(steps)
        assert nmse(got, stepwise) <= GDN_NMSE and nmse(got_state, stepwise_state) <= GDN_NMSE
        assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
        assert not np.array_equal(got[:100], stepwise[:100])  # the prefill did run the chunked form


def test_selection(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recurrent prefill on every device by default (the chunked form is opt-in until measured on a
    GPU); VKRT_DELTA_NET picks either."""
    caps = vk_default.caps  # type: ignore[attr-defined]
    monkeypatch.delenv("VKRT_DELTA_NET", raising=False)
    for kind in ("cpu", "discrete", "integrated"):
        assert native.delta_net_form(replace(caps, device_type=kind)) == "recurrent"
    monkeypatch.setenv("VKRT_DELTA_NET", "chunked")
    assert native.delta_net_form(replace(caps, device_type="cpu")) == "chunked"
    monkeypatch.setenv("VKRT_DELTA_NET", "recurrent")
    assert native.delta_net_form(replace(caps, device_type="discrete")) == "recurrent"
    monkeypatch.setenv("VKRT_DELTA_NET", "fast")
    with pytest.raises(VkrtError, match="VKRT_DELTA_NET"):
        native.delta_net_form(caps)


@pytest.mark.parametrize("vk", ["texel"], indirect=True)
def test_decode_and_short_steps_stay_recurrent(vk: Backend, shaders: Shaders, monkeypatch: pytest.MonkeyPatch,
                                               rng: np.random.Generator) -> None:
    """Chunked forced: a decode step, and a step whose sequences cannot reach CHUNKED_FROM tokens,
    dispatch the recurrent kernel alone; a lone long sequence the chunked kernels alone."""
    heads = (1, 2, 8, 8)
    force(monkeypatch, "chunked")
    for lengths, want in (([1, 1, 1], ["gated_delta_net"]), ([8, 8, 1], ["gated_delta_net"]),
                          ([40], ["gated_delta_net_norm", "gated_delta_net_prep", "gated_delta_net_chunk"])):
        shaders.seen.clear()
        x, state, step = case(rng, heads, lengths)
        got, _ = run_gdn(vk, x, state, step, heads)
        assert shaders.families() == want, lengths
        assert nmse(got, reference(x, state, step, heads)[0]) <= GDN_NMSE


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("vk", ["texel"], indirect=True)
def test_chunked_kernel_long_prompt(vk: Backend, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator,
                                    chunk: int) -> None:
    """A 2100-token prompt (a bench prefill's length, not a multiple of either chunk) after a
    carried state: within the bound of the reference, so no loop of the walk ran out of
    gallivm's budget (which ends loops silently) and errors do not grow over many chunks."""
    heads = (1, 2, 128, 8)
    x = gdn_inputs(rng, 2100, *heads)
    step = step_inputs([2100], [7], [0])
    state = (rng.standard_normal((1, 2, 128, 8)) * 0.3).astype(np.float32)
    force(monkeypatch, "chunked", chunk)
    got, got_state = run_gdn(vk, x, state, step, heads)
    want, want_state = reference(x, state, step, heads)
    assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
    assert nmse(got[-100:], want[-100:]) <= GDN_NMSE  # the last chunks too, not only on average
