"""Mixture-of-experts ops against independent definitions.

Router: the top-k is checked against a Python sort by (-logit, expert index) and the
weights against math.exp softmaxes (exact ties included: the lower index wins). Expert
matmul: every storage format against a dense matmul per expert on independently
dequantized 2-D weights; the gated one (gate|up and the SwiGLU / GeGLU gate in one op)
against the activation written out in float64 here. Combine: arithmetic in the test.
Bound: the f64 references round once to f32, so the comparisons are to 1e-6 relative
(float64 sums in a different order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import REPRESENTATIVE_FORMATS, nmse, ssbo_sample
from tests.ops.test_matmul import FORMATS, NMSE_BOUND, block_k, is_block, make_weight
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels.moe import FORMATS as EXPERT_FORMATS
from vkrt.ops import OpError, fusion


def _expected_route(logits: np.ndarray, k: int, normalize: bool) -> tuple[list[list[int]], list[list[float]]]:
    ids, weights = [], []
    for row in logits.tolist():
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
        top = max(row)
        total = sum(math.exp(v - top) for v in row)
        probs = [math.exp(row[e] - top) / total for e in order]
        if normalize:
            probs = [p / sum(probs) for p in probs]
        ids.append(order)
        weights.append(probs)
    return ids, weights


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(("experts", "k"), [(5, 1), (5, 2), (9, 2), (11, 8), (8, 8), (3, 1)])
def test_router_top_k(ref: Backend, rng: np.random.Generator, experts: int, k: int, normalize: bool) -> None:
    # Integer logits from a small range: most rows hold exact ties, some across the k-th place.
    logits = rng.integers(-2, 3, size=(13, experts)).astype(np.float32)
    logits[0] = 1.0  # every expert tied: the k lowest indices
    ids, weights = ops.moe_router(ref.upload(logits), k, normalize)
    want_ids, want_w = _expected_route(logits, k, normalize)
    assert ids.numpy().tolist() == want_ids
    assert ids.numpy()[0].tolist() == list(range(k))
    np.testing.assert_allclose(weights.numpy(), np.array(want_w), rtol=1e-6)
    if normalize:
        np.testing.assert_allclose(weights.numpy().sum(axis=1), 1.0, rtol=1e-6)


def test_router_ties_lower_index_wins(ref: Backend) -> None:
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 2.0], [3.0, -1.0, 3.0, 3.0, 0.0]], np.float32)
    ids, weights = ops.moe_router(ref.upload(logits), 2, True)
    assert ids.numpy().tolist() == [[1, 2], [0, 2]]
    np.testing.assert_array_equal(weights.numpy(), np.full((2, 2), 0.5, np.float32))


def test_router_random_logits(ref: Backend, rng: np.random.Generator) -> None:
    logits = rng.standard_normal((17, 7)).astype(np.float32) * 3
    ids, weights = ops.moe_router(ref.upload(logits), 3, False)
    want_ids, want_w = _expected_route(logits, 3, False)
    assert ids.numpy().tolist() == want_ids
    np.testing.assert_allclose(weights.numpy(), np.array(want_w), rtol=1e-6)


def _stacked_experts(rng: np.random.Generator, fmt: str, experts: int, n: int, k: int
                     ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Storage bytes of [E, N, K] (experts one after another) and each expert's f32 values."""
    raws, dense = zip(*(make_weight(rng, fmt, n, k) for _ in range(experts)), strict=True)
    return np.concatenate([np.asarray(r) for r in raws], axis=0), list(dense)


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_matmul_equals_dense_matmul_per_expert(ref: Backend, rng: np.random.Generator, fmt: str) -> None:
    experts, n, k, tokens, top_k = 5, 8, 256, 6, 2
    raw, dense = _stacked_experts(rng, fmt, experts, n, k)
    w = ref.upload_weight(raw, fmt, (experts, n, k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    ids = np.array([[0, 4], [4, 0], [2, 3], [3, 3], [1, 0], [4, 2]], np.int32)
    got = ops.moe_matmul(ref.upload(x), w, ref.upload(ids)).numpy()
    assert got.shape == (tokens, top_k, n)
    for e in range(experts):  # the dense op on one expert's matrix, uploaded on its own
        per_expert = ops.matmul(ref.upload(x), ref.upload_weight(raw.reshape(experts, -1)[e], fmt, (n, k))).numpy()
        np.testing.assert_allclose(per_expert, x.astype(np.float64) @ dense[e].T.astype(np.float64),
                                   rtol=1e-5, atol=1e-5)
        for t, j in zip(*np.nonzero(ids == e), strict=True):
            np.testing.assert_allclose(got[t, j], per_expert[t], rtol=1e-6, atol=1e-6)


def _gated_want(x: np.ndarray, dense: list[np.ndarray], ids: np.ndarray, activation: str) -> np.ndarray:
    """act(x_p @ gate_e.T) * (x_p @ up_e.T) per pair in float64, each expert's rows [gate; up]."""
    tokens, top_k = ids.shape
    f = dense[0].shape[0] // 2
    out = np.zeros((tokens, top_k, f))
    for t in range(tokens):
        for j in range(top_k):
            row = (x[t, j] if x.ndim == 3 else x[t]).astype(np.float64)
            w = dense[ids[t, j]].astype(np.float64)
            g, u = row @ w[:f].T, row @ w[f:].T
            if activation == "silu":
                act = g / (1.0 + np.exp(-g))
            else:
                act = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
            out[t, j] = act * u
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_matmul_gated_is_the_gate_of_each_expert(ref: Backend, rng: np.random.Generator, fmt: str,
                                                     activation: str) -> None:
    experts, f, tokens, top_k = 5, 6, 4, 2
    k = block_k(fmt, 64)
    raw, dense = _stacked_experts(rng, fmt, experts, 2 * f, k)
    w = ref.upload_weight(raw, fmt, (experts, 2 * f, k))
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    ids = np.array([[0, 4], [4, 0], [2, 3], [3, 1]], np.int32)
    got = ops.moe_matmul_gated(ref.upload(x), w, ref.upload(ids), activation).numpy()
    assert got.shape == (tokens, top_k, f)
    np.testing.assert_allclose(got, _gated_want(x, dense, ids, activation), rtol=1e-5, atol=1e-6)


def test_moe_matmul_rows_per_chosen_expert(ref: Backend, rng: np.random.Generator) -> None:
    """x [T, k, K]: each chosen expert multiplies its own row (the down projection)."""
    experts, n, k = 3, 4, 32
    w = rng.standard_normal((experts, n, k)).astype(np.float32)
    x = rng.standard_normal((2, 2, k)).astype(np.float32)
    ids = np.array([[2, 0], [1, 2]], np.int32)
    got = ops.moe_matmul(ref.upload(x), ref.upload_weight(w, "f32", w.shape), ref.upload(ids)).numpy()
    for t in range(2):
        for j in range(2):
            want = x[t, j].astype(np.float64) @ w[ids[t, j]].T.astype(np.float64)
            np.testing.assert_allclose(got[t, j], want, rtol=1e-6)


def test_moe_matmul_is_batch_invariant(ref: Backend, rng: np.random.Generator) -> None:
    """A token's rows are the same alone and among others choosing the same experts."""
    w = rng.standard_normal((4, 16, 64)).astype(np.float32)
    wt = ref.upload_weight(w, "f32", w.shape)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    ids = np.array([[1, 3]] * 5, np.int32)
    batch = ops.moe_matmul(ref.upload(x), wt, ref.upload(ids)).numpy()
    alone = ops.moe_matmul(ref.upload(x[2:3]), wt, ref.upload(ids[2:3])).numpy()
    np.testing.assert_array_equal(batch[2:3], alone)


def test_moe_combine(ref: Backend) -> None:
    y = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    weights = np.array([[0.5, 0.25, 0.25], [1.0, 0.0, 2.0]], np.float32)
    got = ops.moe_combine(ref.upload(y), ref.upload(weights)).numpy()
    want = np.array([[0.5 * y[0, 0, i] + 0.25 * y[0, 1, i] + 0.25 * y[0, 2, i] for i in range(4)],
                     [y[1, 0, i] + 2.0 * y[1, 2, i] for i in range(4)]], np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", ["ref", "vk_default"])
def test_moe_add_bias_is_each_experts_bias(backend: str, rng: np.random.Generator,
                                           request: pytest.FixtureRequest) -> None:
    """y[t, j] + bias[ids[t, j]]: one f32 add per element, so both backends are bit-exact."""
    be: Backend = request.getfixturevalue(backend)
    y = rng.standard_normal((5, 3, 7)).astype(np.float32)
    bias = rng.standard_normal((4, 7)).astype(np.float32)
    ids = rng.integers(0, 4, size=(5, 3)).astype(np.int32)
    got = ops.moe_add_bias(be.upload(y), be.upload(bias), be.upload(ids)).numpy()
    want = np.stack([np.stack([y[t, j] + bias[ids[t, j]] for j in range(3)]) for t in range(5)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", ["ref", "vk_default"])
@pytest.mark.parametrize("width", [1, 7])
def test_moe_scale_is_each_experts_scale(backend: str, width: int, rng: np.random.Generator,
                                         request: pytest.FixtureRequest) -> None:
    """y[t, j] * scale[ids[t, j]] (Gemma 4's per-expert scale of the chosen weights, width 1):
    one f32 product per element, so both backends are bit-exact."""
    be: Backend = request.getfixturevalue(backend)
    y = rng.standard_normal((5, 3, width)).astype(np.float32)
    scale = rng.standard_normal((4, width)).astype(np.float32)
    ids = rng.integers(0, 4, size=(5, 3)).astype(np.int32)
    drains = be.counters.drains if backend == "vk_default" else 0
    got = ops.moe_scale(be.upload(y), be.upload(scale), be.upload(ids)).numpy()
    want = np.stack([np.stack([y[t, j] * scale[ids[t, j]] for j in range(3)]) for t in range(5)])
    np.testing.assert_array_equal(got, want)
    assert backend == "ref" or be.counters.drains == drains


def test_moe_combine_shared(ref: Backend) -> None:
    """The routed mix plus sigmoid(g) times the shared expert's row (g = 0: half of it)."""
    y = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
    weights = np.array([[0.5, 0.5], [1.0, 0.0]], np.float32)
    shared = np.array([[2.0, -4.0, 8.0], [1.0, 1.0, 1.0]], np.float32)
    logit = np.array([[0.0], [math.log(3.0)]], np.float32)  # sigmoid: 1/2, 3/4
    got = ops.moe_combine_shared(ref.upload(y), ref.upload(weights), ref.upload(shared), ref.upload(logit)).numpy()
    want = [[0.5 * y[0, 0, i] + 0.5 * y[0, 1, i] + 0.5 * shared[0, i] for i in range(3)],
            [y[1, 0, i] + 0.75 * shared[1, i] for i in range(3)]]
    np.testing.assert_allclose(got, np.array(want), rtol=1e-6)


def test_bad_calls_are_op_errors(ref: Backend) -> None:
    logits = ref.upload(np.zeros((2, 4), np.float32))
    with pytest.raises(OpError, match="top_k"):
        ops.moe_router(logits, 5, False)
    w2 = ref.upload_weight(np.zeros((4, 32), np.float32), "f32", (4, 32))
    ids = ref.upload(np.zeros((2, 2), np.int32))
    with pytest.raises(OpError, match=r"\[E, N, K\]"):
        ops.moe_matmul(ref.upload(np.zeros((2, 32), np.float32)), w2, ids)
    w3 = ref.upload_weight(np.zeros((3, 4, 32), np.float32), "f32", (3, 4, 32))
    with pytest.raises(OpError, match="K = 32"):
        ops.moe_matmul(ref.upload(np.zeros((2, 16), np.float32)), w3, ids)
    with pytest.raises(OpError, match="weights must be"):
        ops.moe_combine(ref.upload(np.zeros((2, 2, 4), np.float32)), ref.upload(np.zeros((2, 3), np.float32)))
    odd = ref.upload_weight(np.zeros((3, 5, 32), np.float32), "f32", (3, 5, 32))
    x = ref.upload(np.zeros((2, 32), np.float32))
    with pytest.raises(OpError, match="even rows"):
        ops.moe_matmul_gated(x, odd, ids)
    with pytest.raises(OpError, match="unknown activation"):
        ops.moe_matmul_gated(x, w3, ids, "relu")
    y, mix = ref.upload(np.zeros((2, 2, 4), np.float32)), ref.upload(np.zeros((2, 2), np.float32))
    with pytest.raises(OpError, match="shared expert's output"):
        ops.moe_combine_shared(y, mix, ref.upload(np.zeros((2, 3), np.float32)), ref.upload(np.zeros((2, 1), np.float32)))
    with pytest.raises(OpError, match=r"gate logit must be f32 \[2, 1\]"):
        ops.moe_combine_shared(y, mix, ref.upload(np.zeros((2, 4), np.float32)), ref.upload(np.zeros((2,), np.float32)))


# -- native kernels (shaders/moe.comp, shaders/matmul_id.comp) vs the references ---------------
# Bounds: router ids exact; router weights rtol 1e-5 (f32 exp and sums against float64;
# measured <= 1.1e-7 relative); expert matmul NMSE <= the dense matmul's 1e-9 per format
# (the same decode and reduction); combine 1e-6 relative (an f32 fma chain against a float64
# sum rounded once; measured <= 5e-7 absolute on values of order 1).

ROUTER_CASES = [(5, 1), (5, 2), (9, 2), (11, 8), (8, 8), (3, 1), (32, 4)]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(("experts", "k"), ROUTER_CASES)
def test_native_router_matches_reference(vk: Backend, rng: np.random.Generator, experts: int, k: int,
                                         normalize: bool) -> None:
    """Exact ties (integer logits, a row of all-equal logits) and random logits."""
    tied = rng.integers(-2, 3, size=(13, experts)).astype(np.float32)
    tied[0] = 1.0
    spread = rng.standard_normal((70, experts)).astype(np.float32) * 3
    for logits in (tied, spread):
        before = vk.counters.snapshot()
        ids, weights = ops.moe_router(vk.upload(logits), k, normalize)
        got_ids, got_w = ids.numpy(), weights.numpy()
        assert vk.counters.since(before)["drains"] == 0
        want_ids, want_w = ops.OPS["moe_router"].reference(logits, k, normalize)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5)
    assert got_ids.dtype == np.int32


def _pairs_case(rng: np.random.Generator, tokens: int, experts: int, k: int) -> np.ndarray:
    """ids [T, k]: each token k distinct experts, as the router gives."""
    return np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)


# (E, k, T): odd expert counts, k = 1, 2, 8; few tokens (one workgroup row per pair) and many
# (one per expert, pairs gathered TOKENS at a time).
MATMUL_CASES = [(5, 1, 1), (5, 2, 3), (9, 8, 2), (3, 2, 13), (7, 1, 40), (9, 8, 5)]


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_native_moe_matmul_matches_reference(vk: Backend, rng: np.random.Generator, fmt: str) -> None:
    n = 37
    k = block_k(fmt, 96) if is_block(fmt) else 37
    for experts, top_k, tokens in MATMUL_CASES:
        raw, dense = _stacked_experts(rng, fmt, experts, n, k)
        w = vk.upload_weight(raw, fmt, (experts, n, k))
        ids = _pairs_case(rng, tokens, experts, top_k)
        for x in (rng.standard_normal((tokens, k)), rng.standard_normal((tokens, top_k, k))):
            x = x.astype(np.float32)
            before = vk.counters.snapshot()
            got = ops.moe_matmul(vk.upload(x), w, vk.upload(ids)).numpy()
            assert vk.counters.since(before)["drains"] == 0, f"{fmt}: the op fell back to the reference"
            want = ops.OPS["moe_matmul"].reference(x, np.stack(dense), ids)
            err = nmse(got, want)
            assert err <= NMSE_BOUND[fmt], f"{fmt} E={experts} k={top_k} T={tokens} x{list(x.shape)}: NMSE {err:.3g}"


@ssbo_sample(lambda fmt, gated: fmt == "q4_1")
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q4_k"])
def test_native_moe_matmul_is_batch_invariant(vk: Backend, rng: np.random.Generator, fmt: str, gated: bool) -> None:
    """A pair's row is bit-identical alone (per-pair split) and among 64 tokens routed to the
    same experts (per-expert split, pairs reduced together), and equals the dense matmul of
    its expert's matrix bit for bit (the same decode and block order); gated, the dense gated
    matmul (matmul_silu_and_mul) of its expert's [gate; up] rows."""
    expert_op, dense_op = (ops.moe_matmul_gated, ops.matmul_silu_and_mul) if gated else (ops.moe_matmul, ops.matmul)
    experts, n = 5, 48 if gated else 40
    k = block_k(fmt, 64) if is_block(fmt) else 64
    raw, _ = _stacked_experts(rng, fmt, experts, n, k)
    w = vk.upload_weight(raw, fmt, (experts, n, k))
    x = rng.standard_normal((64, k)).astype(np.float32)
    ids = np.array([[1, 3]] * 60 + [[3, 0]] * 4, np.int32)
    batch = expert_op(vk.upload(x), w, vk.upload(ids)).numpy()
    for t in (0, 17, 63):
        alone = expert_op(vk.upload(x[t : t + 1]), w, vk.upload(ids[t : t + 1])).numpy()
        assert alone.tobytes() == batch[t : t + 1].tobytes(), f"{fmt} token {t}"
    expert3 = vk.upload_weight(raw.reshape(experts, -1)[3], fmt, (n, k))
    dense = dense_op(vk.upload(x), expert3).numpy()
    assert dense[:60].tobytes() == batch[:60, 1].tobytes()


@ssbo_sample(lambda fmt: fmt in REPRESENTATIVE_FORMATS)  # the plain test loads every format
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_native_moe_matmul_gated_matches_reference(vk: Backend, rng: np.random.Generator, fmt: str) -> None:
    """gate|up and SwiGLU in one dispatch per call, every format and case of the plain test
    (19 output rows: a partial row set in every split)."""
    f = 19
    k = block_k(fmt, 96) if is_block(fmt) else 37
    for experts, top_k, tokens in MATMUL_CASES:
        raw, dense = _stacked_experts(rng, fmt, experts, 2 * f, k)
        w = vk.upload_weight(raw, fmt, (experts, 2 * f, k))
        ids = _pairs_case(rng, tokens, experts, top_k)
        for x in (rng.standard_normal((tokens, k)), rng.standard_normal((tokens, top_k, k))):
            x = x.astype(np.float32)
            before = vk.counters.snapshot()
            got = ops.moe_matmul_gated(vk.upload(x), w, vk.upload(ids)).numpy()
            delta = vk.counters.since(before)
            assert (delta["dispatches"], delta["drains"]) == (1, 0), f"{fmt}: {delta}"
            want = ops.OPS["moe_matmul_gated"].reference(x, np.stack(dense), ids)
            err = nmse(got, want)
            assert err <= NMSE_BOUND[fmt], f"{fmt} E={experts} k={top_k} T={tokens} x{list(x.shape)}: NMSE {err:.3g}"


@pytest.mark.fusion
@ssbo_sample(lambda fmt, activation: fmt in ("f32", "q4_k"))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4_1", "q5_0", "q4_k", "q6_k"])
def test_native_gated_equals_unfused(vk: Backend, rng: np.random.Generator, fmt: str, activation: str) -> None:
    """The fold of silu_and_mul (gelu_tanh_and_mul) into the gate|up expert matmul is one
    dispatch with the unfused pair's bits, in both work splits (3 tokens: per pair; 40
    tokens over 7 experts: per expert, pairs reduced together)."""
    act = ops.silu_and_mul if activation == "silu" else ops.gelu_tanh_and_mul
    experts, f = 7, 21
    k = block_k(fmt, 64) if is_block(fmt) else 64
    raw, _ = _stacked_experts(rng, fmt, experts, 2 * f, k)
    w = vk.upload_weight(raw, fmt, (experts, 2 * f, k))
    for tokens, top_k in ((3, 2), (40, 1), (40, 8)):
        x = vk.upload(rng.standard_normal((tokens, k)).astype(np.float32))
        ids = vk.upload(_pairs_case(rng, tokens, experts, top_k))
        before, counters = dict(vk.selections), vk.counters.snapshot()
        got = act(ops.moe_matmul(x, w, ids)).numpy()
        ran = {op for (op, _), n in vk.selections.items() if n > before.get((op, _), 0)}
        assert ran == {"moe_matmul_gated"} and vk.counters.since(counters)["dispatches"] == 1
        with fusion.disabled():
            want = act(ops.moe_matmul(x, w, ids)).numpy()
        assert got.tobytes() == want.tobytes(), f"{fmt} {activation} T={tokens} k={top_k}"


def test_native_combine_matches_reference(vk: Backend, rng: np.random.Generator) -> None:
    for tokens, k, n in ((1, 1, 5), (3, 2, 64), (17, 8, 33)):
        y = rng.standard_normal((tokens, k, n)).astype(np.float32)
        weights = rng.random((tokens, k)).astype(np.float32)
        before = vk.counters.snapshot()
        got = ops.moe_combine(vk.upload(y), vk.upload(weights)).numpy()
        assert vk.counters.since(before)["drains"] == 0
        np.testing.assert_allclose(got, ops.OPS["moe_combine"].reference(y, weights), rtol=1e-6, atol=1e-6)


def test_native_combine_shared_matches_reference(vk: Backend, rng: np.random.Generator) -> None:
    """Gate logits out to +-30 (sigmoid saturating both ways) among ordinary ones."""
    for tokens, k, n in ((1, 1, 5), (3, 2, 64), (17, 8, 33)):
        y = rng.standard_normal((tokens, k, n)).astype(np.float32)
        weights = rng.random((tokens, k)).astype(np.float32)
        shared = rng.standard_normal((tokens, n)).astype(np.float32)
        logit = (rng.standard_normal((tokens, 1)) * 3).astype(np.float32)
        logit[:2, 0] = [30.0, -30.0][: tokens]
        before = vk.counters.snapshot()
        got = ops.moe_combine_shared(vk.upload(y), vk.upload(weights), vk.upload(shared), vk.upload(logit)).numpy()
        assert vk.counters.since(before)["drains"] == 0
        want = ops.OPS["moe_combine_shared"].reference(y, weights, shared, logit)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_expert_formats_are_the_shader_variants() -> None:
    """The formats the kernel claims are exactly those matmul_id.comp is compiled for."""
    from pathlib import Path

    from vkrt.backend.vulkan.kernels import moe

    source = (Path(__file__).resolve().parents[2] / "shaders" / "matmul_id.comp").read_text()
    line = next(s for s in source.splitlines() if s.startswith("//! variants:"))
    assert line.split("WFMT=")[1].split()[0].split(",") == list(moe.FORMATS)


# (experts, k, groups, top groups): one group (LFM2-MoE), and group-limited choices of odd sizes.
SIGMOID_ROUTER_CASES = [*((e, k, 1, 1) for e, k in ROUTER_CASES), (8, 2, 2, 1), (12, 5, 4, 2), (18, 3, 3, 3),
                        (64, 8, 8, 4), (6, 2, 3, 1)]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(("experts", "k", "groups", "top_groups"), SIGMOID_ROUTER_CASES)
def test_native_sigmoid_router_matches_reference(vk: Backend, rng: np.random.Generator, experts: int, k: int,
                                                 groups: int, top_groups: int, normalize: bool) -> None:
    """Sigmoid routing: the bias steers the choice (ties: integer logits, a zero bias, an
    all-equal row), groups limit it, the weights are the unbiased sigmoids, normalised (+ eps)
    and scaled."""
    # Ties in the groups' values must be ties in f32 too: sigmoid(x) + sigmoid(-x) is 1 in the
    # reals for every x, but not in every rounding, so grouped rows tie with equal ranks only.
    tied = rng.integers(-2 if groups == 1 else 0, 3, size=(13, experts)).astype(np.float32)
    tied[0] = 1.0
    spread = rng.standard_normal((70, experts)).astype(np.float32) * 3
    eps = 1e-6 if groups == 1 else 1e-20
    for logits, bias in ((tied, np.zeros(experts, np.float32)),
                         (spread, (rng.standard_normal(experts) * 0.3).astype(np.float32))):
        before = vk.counters.snapshot()
        ids, weights = ops.moe_router_sigmoid(vk.upload(logits), vk.upload(bias), k, normalize, 2.5, eps, groups,
                                              top_groups)
        got_ids, got_w = ids.numpy(), weights.numpy()
        assert vk.counters.since(before)["drains"] == 0
        want_ids, want_w = ops.OPS["moe_router_sigmoid"].reference(logits, bias, k, normalize, 2.5, eps, groups,
                                                                  top_groups)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5)


def test_sigmoid_router_groups_limit_the_choice(ref: Backend) -> None:
    """Two groups of three: the one whose two best ranks sum higher is the only one chosen
    from, though the other holds the single best expert."""
    logits = np.array([[3.0, -3.0, -3.0, 1.0, 1.0, 0.5]], np.float32)
    bias = np.zeros(6, np.float32)
    ids, _ = ops.moe_router_sigmoid(ref.upload(logits), ref.upload(bias), 2, True, 1.0, 1e-20, 1, 1)
    assert ids.numpy().tolist() == [[0, 3]]
    ids, weights = ops.moe_router_sigmoid(ref.upload(logits), ref.upload(bias), 2, True, 1.0, 1e-20, 2, 1)
    assert ids.numpy().tolist() == [[3, 4]]  # group 1: 0.73 + 0.73 > group 0: 0.95 + 0.05
    np.testing.assert_allclose(weights.numpy()[0], [0.5, 0.5], rtol=1e-6)
    with pytest.raises(OpError, match="groups must divide"):
        ops.moe_router_sigmoid(ref.upload(logits), ref.upload(bias), 2, True, 1.0, 1e-20, 4, 1)
    with pytest.raises(OpError, match="top_k must be in 1..3"):
        ops.moe_router_sigmoid(ref.upload(logits), ref.upload(bias), 4, True, 1.0, 1e-20, 2, 1)


def test_sigmoid_router_bias_steers_only_the_choice(ref: Backend) -> None:
    logits = np.array([[2.0, 0.0, -1.0, 1.0]], np.float32)
    bias = np.array([0.0, 0.9, 0.0, -0.5], np.float32)
    ids, weights = ops.moe_router_sigmoid(ref.upload(logits), ref.upload(bias), 2, False)
    assert ids.numpy().tolist() == [[1, 0]]  # sigmoid + bias: 0.88, 1.4, 0.27, 0.23
    sig = 1 / (1 + np.exp(-np.array([0.0, 2.0])))
    np.testing.assert_allclose(weights.numpy()[0], sig, rtol=1e-6)  # the weights carry no bias
    ids, weights = ops.moe_router_sigmoid(ref.upload(logits), ref.upload(bias), 2, True, 3.0)
    np.testing.assert_allclose(weights.numpy()[0], 3.0 * sig / (sig.sum() + 1e-6), rtol=1e-6)
    with pytest.raises(OpError, match="bias must be f32"):
        ops.moe_router_sigmoid(ref.upload(logits), ref.upload(np.zeros(3, np.float32)), 2, True)
