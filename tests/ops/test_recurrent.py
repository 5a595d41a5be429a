"""The recurrent mixers' ops (vkrt/ops/recurrent.py) natively against their numpy references.

Convolution: every output and the state left in each slot, at odd channel counts and kernel
sizes, for steps that start sequences at position 0 (whatever the slot held) beside ones that
carry a state, with padding sequences; and a prompt run as one step, as chunks, and token by
token gives the same outputs and state. Each output is K products added in order, then the
bias, all `precise`, so the kernel equals the reference bit for bit on llvmpipe (the contract:
NMSE <= 1e-12; silu uses the device's exp, bounded by 1e-10).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from vkrt.backend.base import Backend

EXACT_NMSE = 1e-12
SILU_NMSE = 1e-10


def step_inputs(lengths: list[int], starts: list[int], slots: list[int]) -> dict[str, np.ndarray]:
    """seq_start, positions and state_slots of a step whose sequence s has lengths[s] tokens
    from position starts[s] in slot slots[s] (a length of 0: a padding sequence)."""
    seq_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(starts, lengths, strict=True)]).astype(np.int32)
    return {"seq_start": seq_start, "positions": positions, "state_slots": np.array(slots, np.int32)}


def run_conv(backend: Backend, op: str, x: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray,
             step: dict[str, np.ndarray], **params: str) -> tuple[np.ndarray, np.ndarray]:
    """The op's output and the state it leaves, on `backend` (the state tensor written in place)."""
    s = backend.upload(state)
    drains = backend.counters.drains
    y = getattr(ops, op)(backend.upload(x), backend.upload(w), backend.upload(bias), s,
                         backend.upload(step["seq_start"]), backend.upload(step["positions"]),
                         backend.upload(step["state_slots"]), **params).numpy()
    assert backend.counters.drains == drains, f"{op} ran on the host"
    return y, s.numpy()


def reference_conv(op: str, x: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray,
                   step: dict[str, np.ndarray], **params: str) -> tuple[np.ndarray, np.ndarray]:
    state = state.copy()
    y = ops.OPS[op].reference(x, w, bias, state, step["seq_start"], step["positions"], step["state_slots"], **params)
    return y, state


CASES = [  # (op, channels, taps, activation)
    ("causal_conv1d", 7, 4, ""), ("causal_conv1d", 37, 3, "silu"), ("causal_conv1d", 64, 2, "silu"),
    ("short_conv", 5, 3, ""), ("short_conv", 48, 4, ""),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-c{c[1]}-k{c[2]}{'-' + c[3] if c[3] else ''}")
def test_conv_matches_reference(vk: Backend, rng: np.random.Generator, case: tuple[str, int, int, str]) -> None:
    op, channels, taps, activation = case
    params = {"activation": activation} if op == "causal_conv1d" else {}
    # Sequences: a fresh prompt (position 0) in a slot holding garbage, a chunk that carries
    # its slot's state, a decode token, a padding sequence, one shorter than the window.
    step = step_inputs([9, 5, 1, 0, 1], [0, 12, 30, 0, 1], [3, 0, 2, 1, 4])
    width = 3 * channels if op == "short_conv" else channels
    x = rng.standard_normal((int(step["seq_start"][-1]), width)).astype(np.float32)
    w = rng.standard_normal((channels, taps)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    state = rng.standard_normal((6, channels, taps - 1)).astype(np.float32)
    got, got_state = run_conv(vk, op, x, w, bias, state, step, **params)
    want, want_state = reference_conv(op, x, w, bias, state, step, **params)
    bound = SILU_NMSE if activation else EXACT_NMSE
    assert nmse(got, want) <= bound and nmse(got_state, want_state) <= EXACT_NMSE
    if not activation:
        np.testing.assert_array_equal(got, want)  # measured bit-exact on llvmpipe
    np.testing.assert_array_equal(got_state, want_state)
    np.testing.assert_array_equal(got_state[[1, 5]], state[[1, 5]])  # slots no sequence used


def test_conv_state_ignored_at_position_zero(ref: Backend, rng: np.random.Generator) -> None:
    """A sequence at position 0 starts from zeros: the slot's old contents never leak in."""
    step = step_inputs([4], [0], [0])
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w, bias = rng.standard_normal((8, 4)).astype(np.float32), np.zeros(8, np.float32)
    a, _ = reference_conv("causal_conv1d", x, w, bias, np.zeros((1, 8, 3), np.float32), step)
    b, _ = reference_conv("causal_conv1d", x, w, bias, np.full((1, 8, 3), 7.0, np.float32), step)
    np.testing.assert_array_equal(a, b)
    # and the first output is the newest tap alone (plus bias 0): nothing before position 0
    np.testing.assert_array_equal(a[0], (w[:, 3] * x[0]).astype(np.float32))


@pytest.mark.parametrize("op", ["causal_conv1d", "short_conv"])
def test_chunks_and_single_tokens_equal_one_step(vk: Backend, rng: np.random.Generator, op: str) -> None:
    """A 13-token prompt in one step, as chunks of 5, 5, 3, and token by token: the same
    outputs and the same final state (prefill then decode == stepwise)."""
    channels, taps, n = 11, 4, 13
    width = 3 * channels if op == "short_conv" else channels
    x = rng.standard_normal((n, width)).astype(np.float32)
    w = rng.standard_normal((channels, taps)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)

    def run(chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        state = vk.upload(np.full((2, channels, taps - 1), 3.0, np.float32))  # slot 1 used; garbage at first
        outs, start = [], 0
        for size in chunks:
            step = step_inputs([size], [start], [1])
            outs.append(getattr(ops, op)(vk.upload(x[start:start + size]), vk.upload(w), vk.upload(bias), state,
                                         vk.upload(step["seq_start"]), vk.upload(step["positions"]),
                                         vk.upload(step["state_slots"])).numpy())
            start += size
        return np.concatenate(outs), state.numpy()[1]

    whole, whole_state = run([n])
    for chunks in ([5, 5, 3], [1] * n):
        got, got_state = run(chunks)
        np.testing.assert_array_equal(got, whole)
        np.testing.assert_array_equal(got_state, whole_state)
    want, _ = reference_conv(op, x, w, bias, np.zeros((1, channels, taps - 1), np.float32),
                             step_inputs([n], [0], [0]))
    np.testing.assert_array_equal(whole, want)


def test_conv_refuses_bad_shapes(ref: Backend) -> None:
    from vkrt.errors import VkrtError

    step = step_inputs([2], [0], [0])
    x, w = ref.upload(np.zeros((2, 4), np.float32)), ref.upload(np.zeros((4, 9), np.float32))
    with pytest.raises(VkrtError, match="2 <= K <= 8"):
        ops.causal_conv1d(x, w, ref.upload(np.zeros(4, np.float32)), ref.upload(np.zeros((1, 4, 8), np.float32)),
                          ref.upload(step["seq_start"]), ref.upload(step["positions"]), ref.upload(step["state_slots"]))


# ---- the gated delta rule ------------------------------------------------------------------------

# The kernel sums dk products in f32 in order against the reference's float64: measured NMSE
# ~1e-14 on these shapes; the bound leaves room for other devices' exp and log.
GDN_NMSE = 1e-10
GDN_CASES = [  # (num_k_heads, num_v_heads, k_head_dim, v_head_dim)
    (1, 1, 8, 8), (2, 4, 16, 12), (2, 2, 32, 5), (1, 3, 128, 16),
]


def gdn_inputs(rng: np.random.Generator, t: int, hk: int, hv: int, dk: int, dv: int) -> dict[str, np.ndarray]:
    return {
        "qkv": rng.standard_normal((t, 2 * hk * dk + hv * dv)).astype(np.float32),
        "ba": (rng.standard_normal((t, 2 * hv)) * 2.0).astype(np.float32),
        "a_rate": -rng.uniform(0.5, 8.0, hv).astype(np.float32),
        "dt_bias": rng.standard_normal(hv).astype(np.float32),
    }


def run_gdn(backend: Backend, x: dict[str, np.ndarray], state: np.ndarray, step: dict[str, np.ndarray],
            heads: tuple[int, int, int, int], tiled: bool = False, beta_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    s = backend.upload(state)
    drains = backend.counters.drains
    o = ops.gated_delta_net(*(backend.upload(x[n]) for n in ("qkv", "ba", "a_rate", "dt_bias")), s,
                            backend.upload(step["seq_start"]), backend.upload(step["positions"]),
                            backend.upload(step["state_slots"]), *heads, tiled_heads=tiled,
                            beta_scale=beta_scale).numpy()
    assert backend.counters.drains == drains, "gated_delta_net ran on the host"
    return o, s.numpy()


@pytest.mark.parametrize(("tiled", "beta_scale"), [(False, 1.0), (True, 1.0), (False, 2.0)],
                         ids=["grouped", "tiled", "negative-eigenvalues"])
@pytest.mark.parametrize("heads", GDN_CASES, ids=lambda h: "hk{}-hv{}-dk{}-dv{}".format(*h))
def test_gated_delta_net_matches_reference(vk: Backend, rng: np.random.Generator,
                                           heads: tuple[int, int, int, int], tiled: bool, beta_scale: float) -> None:
    hk, hv, dk, dv = heads
    step = step_inputs([6, 3, 1, 0], [0, 9, 20, 0], [2, 0, 1, 3])  # fresh, carried, decode, padding
    x = gdn_inputs(rng, int(step["seq_start"][-1]), hk, hv, dk, dv)
    state = (rng.standard_normal((4, hv, dk, dv)) * 0.3).astype(np.float32)
    got, got_state = run_gdn(vk, x, state, step, heads, tiled, beta_scale)
    want_state = state.copy()
    want = ops.OPS["gated_delta_net"].reference(x["qkv"], x["ba"], x["a_rate"], x["dt_bias"], want_state,
                                                step["seq_start"], step["positions"], step["state_slots"], *heads,
                                                tiled_heads=tiled, beta_scale=beta_scale)
    assert nmse(got, want) <= GDN_NMSE and nmse(got_state, want_state) <= GDN_NMSE
    np.testing.assert_array_equal(got_state[3], state[3])  # the padding sequence's slot is untouched


def test_gated_delta_net_chunks_equal_one_step(vk: Backend, rng: np.random.Generator) -> None:
    """Prefill then decode == stepwise: 11 tokens in one step, as 4 + 4 + 3, and one by one."""
    heads = (2, 4, 16, 8)
    x = gdn_inputs(rng, 11, *heads)

    def run(chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        state = vk.upload(np.full((1, 4, 16, 8), 0.5, np.float32))  # garbage until position 0 clears it
        outs, start = [], 0
        for size in chunks:
            step = step_inputs([size], [start], [0])
            part = {n: (a[start:start + size] if n in ("qkv", "ba") else a) for n, a in x.items()}
            outs.append(ops.gated_delta_net(*(vk.upload(part[n]) for n in ("qkv", "ba", "a_rate", "dt_bias")), state,
                                            vk.upload(step["seq_start"]), vk.upload(step["positions"]),
                                            vk.upload(step["state_slots"]), *heads).numpy())
            start += size
        return np.concatenate(outs), state.numpy()

    whole, whole_state = run([11])
    for chunks in ([4, 4, 3], [1] * 11):
        got, got_state = run(chunks)
        np.testing.assert_array_equal(got, whole)  # the state is stored exactly as it is held
        np.testing.assert_array_equal(got_state, whole_state)


@pytest.mark.parametrize("gate_first", [False, True], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("case", [(5, 8, 0, 8), (3, 128, 32, 32), (7, 48, 16, 48), (2, 37, 0, 37)],
                         ids=lambda c: "r{}-d{}-g{}-w{}".format(*c))
def test_gated_rms_norm_matches_reference(vk: Backend, rng: np.random.Generator, case: tuple[int, int, int, int],
                                          gate_first: bool) -> None:
    """Whole rows or groups of them, a weight per group or one for the row, either gate order."""
    rows, dim, group, w_len = case
    x, z = (rng.standard_normal((rows, dim)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(w_len).astype(np.float32)
    got = ops.gated_rms_norm(vk.upload(x), vk.upload(z), vk.upload(w), 1e-6, group, gate_first).numpy()
    want = ops.OPS["gated_rms_norm"].reference(x, z, w, 1e-6, group, gate_first)
    assert nmse(got, want) <= 1e-12
    if group:  # groups normalise apart: one group scaled by 10 leaves the others as they were
        x2 = x.copy()
        x2[:, :group] *= 10.0
        other = ops.OPS["gated_rms_norm"].reference(x2, z, w, 1e-6, group, gate_first)
        np.testing.assert_allclose(other[:, group:], want[:, group:], rtol=1e-6)


# ---- Mamba2's scan --------------------------------------------------------------------------------

SSM_CASES = [  # (num_heads, head_dim, n_groups, state_size)
    (1, 4, 1, 8), (4, 8, 2, 16), (6, 5, 3, 7), (2, 16, 1, 128),
]


def ssm_inputs(rng: np.random.Generator, t: int, heads: int, head_dim: int, groups: int,
               size: int) -> dict[str, np.ndarray]:
    return {
        "xbc": rng.standard_normal((t, heads * head_dim + 2 * groups * size)).astype(np.float32),
        "dt": rng.standard_normal((t, heads)).astype(np.float32),
        "a_rate": -rng.uniform(0.5, 8.0, heads).astype(np.float32),
        "skip": rng.standard_normal(heads).astype(np.float32),
        "dt_bias": rng.standard_normal(heads).astype(np.float32),
    }


SSM_NAMES = ("xbc", "dt", "a_rate", "skip", "dt_bias")


def run_ssm(backend: Backend, x: dict[str, np.ndarray], state: Any, step: dict[str, np.ndarray],
            shape: tuple[int, int, int, int], **limits: float) -> np.ndarray:
    return ops.ssm_scan(*(backend.upload(x[n]) for n in SSM_NAMES), state, backend.upload(step["seq_start"]),
                        backend.upload(step["positions"]), backend.upload(step["state_slots"]), *shape,
                        **limits).numpy()


@pytest.mark.parametrize("limits", [{}, {"dt_min": 0.2, "dt_max": 1.5}], ids=["no-limit", "dt-limit"])
@pytest.mark.parametrize("shape", SSM_CASES, ids=lambda c: "h{}-p{}-g{}-n{}".format(*c))
def test_ssm_scan_matches_reference(vk: Backend, rng: np.random.Generator, shape: tuple[int, int, int, int],
                                    limits: dict[str, float]) -> None:
    heads, head_dim, _, size = shape
    step = step_inputs([6, 3, 1, 0], [0, 9, 20, 0], [2, 0, 1, 3])
    x = ssm_inputs(rng, int(step["seq_start"][-1]), *shape)
    state = (rng.standard_normal((4, heads, head_dim, size)) * 0.3).astype(np.float32)
    s = vk.upload(state)
    drains = vk.counters.drains
    got = run_ssm(vk, x, s, step, shape, **limits)
    assert vk.counters.drains == drains, "ssm_scan ran on the host"
    want_state = state.copy()
    want = ops.OPS["ssm_scan"].reference(*(x[n] for n in SSM_NAMES), want_state, step["seq_start"], step["positions"],
                                         step["state_slots"], *shape, **limits)
    assert nmse(got, want) <= GDN_NMSE and nmse(s.numpy(), want_state) <= GDN_NMSE
    np.testing.assert_array_equal(s.numpy()[3], state[3])


@pytest.mark.parametrize("chunk", [5, 16, 64])
@pytest.mark.parametrize("limits", [{}, {"dt_min": 0.2, "dt_max": 1.5}], ids=["no-limit", "dt-limit"])
@pytest.mark.parametrize("shape", SSM_CASES, ids=lambda c: "h{}-p{}-g{}-n{}".format(*c))
def test_ssm_scan_chunked_reference_equals_recurrent(rng: np.random.Generator, shape: tuple[int, int, int, int],
                                                     limits: dict[str, float], chunk: int) -> None:
    """The chunked (SSD) definition against the scan's reference, sequences longer than a chunk
    and not a multiple of it, fresh and carried: the same f32 outputs and state (measured NMSE 0;
    asserted at 1e-12)."""
    from vkrt.ops.recurrent import ssm_scan_chunked

    heads, head_dim, _, size = shape
    step = step_inputs([70, 130, 16, 1, 0], [0, 5, 0, 20, 0], [2, 4, 0, 1, 3])
    x = ssm_inputs(rng, int(step["seq_start"][-1]), *shape)
    state = (rng.standard_normal((5, heads, head_dim, size)) * 0.3).astype(np.float32)
    args = (step["seq_start"], step["positions"], step["state_slots"], *shape)
    want_state, got_state = state.copy(), state.copy()
    want = ops.OPS["ssm_scan"].reference(*(x[n] for n in SSM_NAMES), want_state, *args, **limits)
    got = ssm_scan_chunked(*(x[n] for n in SSM_NAMES), got_state, *args, **limits, chunk=chunk)
    assert nmse(got, want) <= 1e-12 and nmse(got_state, want_state) <= 1e-12
    np.testing.assert_array_equal(got_state[3], state[3])


def test_ssm_scan_chunks_equal_one_step(vk: Backend, rng: np.random.Generator) -> None:
    shape = (4, 8, 2, 16)
    x = ssm_inputs(rng, 11, *shape)

    def run(chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        state = vk.upload(np.full((1, 4, 8, 16), 0.5, np.float32))
        outs, start = [], 0
        for size in chunks:
            part = {n: (a[start:start + size] if n in ("xbc", "dt") else a) for n, a in x.items()}
            outs.append(run_ssm(vk, part, state, step_inputs([size], [start], [0]), shape))
            start += size
        return np.concatenate(outs), state.numpy()

    whole, whole_state = run([11])
    for chunks in ([4, 4, 3], [1] * 11):
        got, got_state = run(chunks)
        np.testing.assert_array_equal(got, whole)
        np.testing.assert_array_equal(got_state, whole_state)


# ---- copy_state_slots: prefix caching's state snapshots ---------------------------------------------


@pytest.mark.parametrize("shape", [(6, 5, 3), (5, 2, 4, 8)], ids=["conv-state", "delta-state"])
def test_copy_state_slots_matches_reference(vk: Backend, rng: np.random.Generator, shape: tuple[int, ...]) -> None:
    """Each destination slot gets its source's bytes, every other slot keeps its own, and the copy
    runs on the device (no drain) after the writes recorded before it."""
    state = rng.standard_normal(shape).astype(np.float32)
    src, dst = (0, 3), (4, 1)
    want = state.copy()
    ops.OPS["copy_state_slots"].reference(want, src, dst)
    np.testing.assert_array_equal(want[[4, 1]], state[[0, 3]])  # the spec, by arithmetic
    np.testing.assert_array_equal(want[[0, 2, 3]], state[[0, 2, 3]])
    s = vk.upload(state)
    drains = vk.counters.drains
    ops.copy_state_slots(s, src, dst)
    ops.copy_state_slots(s, (4,), (2,))  # reads what the copy before it wrote
    assert vk.counters.drains == drains, "copy_state_slots ran on the host"
    ops.OPS["copy_state_slots"].reference(want, (4,), (2,))
    np.testing.assert_array_equal(s.numpy(), want)


def test_copy_state_slots_refuses_overlaps(ref: Backend) -> None:
    s = ref.upload(np.zeros((4, 3), np.float32))
    with pytest.raises(ops.OpError, match=r"dst slots must be distinct and none a src"):
        ops.copy_state_slots(s, (0, 1), (1, 2))
    with pytest.raises(ops.OpError, match=r"slots in \[0, 4\)"):
        ops.copy_state_slots(s, (0,), (4,))
