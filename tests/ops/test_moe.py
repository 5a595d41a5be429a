"""Mixture-of-experts ops against independent definitions.

Router: the top-k is checked against a Python sort by (-logit, expert index) and the
weights against math.exp softmaxes (exact ties included: the lower index wins). Expert
matmul: every storage format against a dense matmul per expert on independently
dequantized 2-D weights. Combine: arithmetic in the test. Bound: the f64 references round
once to f32, so the comparisons are to 1e-6 relative (float64 sums in a different order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.ops.test_matmul import FORMATS, make_weight
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.ops import OpError


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


def test_vulkan_runs_the_reference_after_a_counted_drain(vk: Backend, ref: Backend, rng: np.random.Generator) -> None:
    """No native MoE kernel yet: on Vulkan each op drains and gives the reference's result."""
    w = rng.standard_normal((5, 8, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    logits = rng.standard_normal((3, 5)).astype(np.float32)
    results = []
    for backend in (ref, vk):
        before = backend.counters.snapshot()
        ids, weights = ops.moe_router(backend.upload(logits), 2, True)
        y = ops.moe_combine(ops.moe_matmul(backend.upload(x), backend.upload_weight(w, "f32", w.shape), ids), weights)
        results.append((ids.numpy(), y.numpy()))
        drains = backend.counters.since(before).get("drains", 0)
    assert drains == 3
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
