"""sample_top_k: the shader's ids EQUAL the numpy reference's, on both access paths.

The reference fixes every float32 operation and its order, so equality is exact, including
uniforms that land exactly on (or one ulp beside) a cumulative-sum boundary, ties, NaN and
-inf logits. The reference's own semantics are checked against the distribution it defines.
"""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from vkrt.backend.vulkan.kernels import sample as sample_kernel
from vkrt.errors import VkrtError
from vkrt.ops.sampling import (
    LOG2E,
    MAX_TOP_K,
    NONFINITE,
    U_MAX,
    exp2_weights,
    sample_params,
    top_k_order,
)

reference = ops.OPS["sample_top_k"].reference


def random_params(rng: np.random.Generator, rows: int, max_k: int = MAX_TOP_K + 8) -> np.ndarray:
    """Temperatures 0.05-3, top_p and min_p often off, k from 1 past MAX_TOP_K (clamped)."""
    return np.stack([
        sample_params(temperature=float(rng.uniform(0.05, 3.0)),
                      top_p=1.0 if rng.random() < 0.3 else float(rng.uniform(0.05, 1.0)),
                      min_p=0.0 if rng.random() < 0.5 else float(rng.uniform(0.0, 0.5)),
                      top_k=int(rng.integers(1, max_k + 1)))
        for _ in range(rows)])


def run(backend, logits: np.ndarray, params: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    return ops.sample_top_k(backend.upload(logits.astype(np.float32)), backend.upload(params),
                            backend.upload(uniforms.astype(np.float32))).numpy()


# 262144: Gemma 3's vocab, beyond what 8 lanes can scan within llvmpipe's loop limit
# (kernels/sample.py); it drew wrong ids until the lanes grew with the vocab.
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (16, 100), (8, 1001), (4, 49152), (2, 262144)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_ids_equal_reference(vk, rng, shape: tuple[int, int]) -> None:
    rows, vocab = shape
    for trial in range(6):
        x = rng.standard_normal(shape).astype(np.float32) * np.float32(rng.uniform(0.5, 8.0))
        if trial % 2:
            x = np.round(x)  # many ties, inside and across lanes
        params, u = random_params(rng, rows), rng.random(rows).astype(np.float32)
        drains = vk.counters.drains
        got = run(vk, x, params, u)
        assert vk.counters.drains == drains
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, reference(x, params, u))


def test_uniforms_on_cumulative_boundaries(vk, rng) -> None:
    """u * total exactly at, and one ulp around, every running sum: both sides pick alike."""
    vocab, k = 300, 24
    x = rng.standard_normal(vocab).astype(np.float32) * 3
    params = sample_params(temperature=0.7, top_k=k)
    order = top_k_order(x, k)
    t = (x[order[1:]] - x[order[0]]) * (params[0] * LOG2E)
    sums = np.cumsum(np.concatenate([np.ones(1, np.float32), exp2_weights(t)]), dtype=np.float32)
    u = (sums / sums[-1]).astype(np.float32)
    uniforms = np.concatenate([u, np.nextafter(u, 0), np.nextafter(u, 1), [0.0, U_MAX, 1.0, -0.5, 2.0]])
    uniforms = uniforms.astype(np.float32)
    rows = uniforms.shape[0]
    logits = np.repeat(x[None], rows, axis=0)
    want = reference(logits, np.repeat(params[None], rows, axis=0), uniforms)
    assert len(set(want.tolist())) > k // 2  # the boundaries really do move the choice
    np.testing.assert_array_equal(run(vk, logits, np.repeat(params[None], rows, axis=0), uniforms), want)


def test_top_k_1_is_argmax(vk, rng) -> None:
    x = np.round(rng.standard_normal((9, 49152)) * 2).astype(np.float32)
    x[3, :] = 1.0
    params = np.stack([sample_params(1.0, top_k=1)] * 9)
    got = run(vk, x, params, rng.random(9).astype(np.float32))
    np.testing.assert_array_equal(got, x.argmax(axis=-1))


@pytest.mark.parametrize("top_k", [1, 40])
def test_a_row_without_a_finite_best_logit_gives_nonfinite(vk, rng, top_k: int) -> None:
    """NaN or +inf anywhere in a row, or every logit -inf: no distribution, the id is -1
    (the engine ends the request with an error instead of emitting a token)."""
    x = rng.standard_normal((6, 3001)).astype(np.float32)
    x[1, [7, 3000]] = np.nan
    x[2, 1500] = np.inf
    x[3, :] = -np.inf
    x[4, ::2] = -np.inf  # finite logits remain: a token is drawn
    x[5, 9] = -np.inf
    params = np.stack([sample_params(1.0, top_k=top_k)] * 6)
    u = rng.random(6).astype(np.float32)
    want = reference(x, params, u)
    assert want[1:4].tolist() == [NONFINITE] * 3 and (want[[0, 4, 5]] >= 0).all()
    np.testing.assert_array_equal(run(vk, x, params, u), want)
    allowed = np.ones(x.shape, bool)
    allowed[1, [7, 3000]] = allowed[2, 1500] = False  # a disallowed NaN or inf is never read
    masked = reference(x, params, u, pack_mask(allowed))
    assert masked[1] >= 0 and masked[2] >= 0
    np.testing.assert_array_equal(run_masked(vk, x, params, u, pack_mask(allowed)), masked)


def test_special_values(vk, rng) -> None:
    x = rng.standard_normal((8, 500)).astype(np.float32)
    x[0, ::3] = -np.inf               # -inf weighs 0 and is never drawn
    x[1, :] = -np.inf                 # all -inf: NONFINITE
    x[2, [10, 20, 400]] = np.nan      # NaN leads: NONFINITE
    x[3, [5, 6]] = np.inf             # inf leads: NONFINITE
    x[4, :490] = -np.inf              # fewer finite columns than k
    x[5] = 1e30 * np.sign(x[5])       # differences overflow to -inf
    x[6] = 1e-30 * x[6]               # tiny but normal logits
    x[7, ::2] = 3.0                   # ties at the top across all lanes
    params = random_params(rng, 8, max_k=MAX_TOP_K)
    params[:, 3] = 40
    for u in (0.0, 0.5, float(U_MAX)):
        uniforms = np.full(8, u, np.float32)
        np.testing.assert_array_equal(run(vk, x, params, uniforms), reference(x, params, uniforms))


def test_batch_invariant(vk, rng) -> None:
    x = rng.standard_normal((32, 4096)).astype(np.float32) * 4
    params, u = random_params(rng, 32), rng.random(32).astype(np.float32)
    batched = run(vk, x, params, u)
    for r in (0, 13, 31):
        assert run(vk, x[r:r + 1], params[r:r + 1], u[r:r + 1])[0] == batched[r]


@pytest.mark.parametrize("lanes", [1, 2, 4, 16, 32])
def test_ids_do_not_depend_on_the_workgroup(vk_default, rng, monkeypatch, lanes: int) -> None:
    assert sample_kernel.shared_bytes(lanes) <= vk_default.caps.max_shared_memory
    monkeypatch.setattr(sample_kernel, "sample_workgroup", lambda caps, vocab=0: lanes)
    x = np.round(rng.standard_normal((6, 3000)) * 3).astype(np.float32)
    params, u = random_params(rng, 6), rng.random(6).astype(np.float32)
    np.testing.assert_array_equal(run(vk_default, x, params, u), reference(x, params, u))


def test_reference_draws_from_the_filtered_softmax(rng) -> None:
    """Frequencies over evenly spread uniforms match softmax(x / T) over the top k."""
    x = rng.standard_normal(50).astype(np.float32) * 2
    n = 20000
    u = ((np.arange(n) + 0.5) / n).astype(np.float32)
    for temperature, k in ((0.5, 50), (2.0, 10)):
        ids = reference(np.repeat(x[None], n, axis=0), np.stack([sample_params(temperature, top_k=k)] * n), u)
        top = np.argsort(-x, kind="stable")[:k]
        p = np.exp((x[top] - x[top].max()) / temperature)
        expected = np.zeros(50)
        expected[top] = p / p.sum()
        assert np.abs(np.bincount(ids, minlength=50) / n - expected).max() < 1e-3


def test_reference_top_p_and_min_p() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.log(probs).astype(np.float32)[None]
    u = np.linspace(0, 1, 400, endpoint=False, dtype=np.float32)

    def seen(**kw: float) -> set[int]:
        params = sample_params(1.0, top_k=4, **kw)
        return set(reference(np.repeat(row, u.size, axis=0), np.stack([params] * u.size), u).tolist())

    assert seen(top_p=0.8) == {0, 1}
    assert seen(top_p=0.81) == {0, 1, 2}
    assert seen(top_p=0.3) == {0}
    assert seen(min_p=0.2) == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert seen(min_p=1.0) == {0}


def test_rejects_bad_input(vk_default) -> None:
    x = vk_default.upload(np.zeros((2, 8), np.float32))
    with pytest.raises(VkrtError, match="sample_top_k"):
        ops.sample_top_k(x, vk_default.upload(np.zeros((2, 3), np.float32)), vk_default.upload(np.zeros(2, np.float32)))
    with pytest.raises(VkrtError, match="sample_top_k"):
        ops.sample_top_k(x, vk_default.upload(np.zeros((2, 4), np.float32)), vk_default.upload(np.zeros(3, np.float32)))


# ---- the token mask (structured output) ------------------------------------------------------


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """bool [R, V] -> u32 [R, ceil(V / 32)], bit j % 32 of word j // 32 (written out here, not
    with the module's helpers, so a bit-order slip in either shows)."""
    rows, vocab = allowed.shape
    words = np.zeros((rows, -(-vocab // 32)), np.uint64)
    for j in range(vocab):
        words[:, j // 32] |= allowed[:, j].astype(np.uint64) << np.uint64(j % 32)
    return words.astype(np.uint32)


def run_masked(backend, logits: np.ndarray, params: np.ndarray, uniforms: np.ndarray,
               mask: np.ndarray) -> np.ndarray:
    return ops.sample_top_k(backend.upload(logits.astype(np.float32)), backend.upload(params),
                            backend.upload(uniforms.astype(np.float32)), backend.upload(mask, "u32")).numpy()


@pytest.mark.parametrize("shape", [(3, 31), (6, 1001), (4, 49152)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_masked_ids_equal_reference_and_stay_allowed(vk, rng, shape: tuple[int, int]) -> None:
    rows, vocab = shape
    for density in (0.5, 0.01, 1 / vocab):
        x = rng.standard_normal(shape).astype(np.float32) * 4
        allowed = rng.random(shape) < density
        allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True  # >= 1 token per row
        mask = pack_mask(allowed)
        params, u = random_params(rng, rows), rng.random(rows).astype(np.float32)
        want = reference(x, params, u, mask)
        assert allowed[np.arange(rows), want].all()
        got = run_masked(vk, x, params, u, mask)
        np.testing.assert_array_equal(got, want)


def test_masked_greedy_takes_the_best_allowed_token(vk, rng) -> None:
    x = rng.standard_normal((5, 3000)).astype(np.float32)
    allowed = rng.random(x.shape) < 0.05
    allowed[:, 0] = True
    allowed[4] = False
    allowed[4, [2999]] = True  # one allowed token, in the last (partial) word
    params = np.stack([sample_params(1.0, top_k=1)] * 5)
    got = run_masked(vk, x, params, rng.random(5).astype(np.float32), pack_mask(allowed))
    expected = np.where(allowed, x, -np.inf).argmax(axis=1)
    np.testing.assert_array_equal(got, expected)


def test_masked_draws_never_leave_the_mask(rng) -> None:
    """Over many uniforms and k up to MAX_TOP_K, every draw is an allowed token, and all of the
    allowed candidates among the top k get drawn."""
    x = rng.standard_normal(200).astype(np.float32)
    allowed = np.zeros(200, bool)
    allowed[[3, 50, 51, 120, 199]] = True
    n = 2000
    u = ((np.arange(n) + 0.5) / n).astype(np.float32)
    mask = np.repeat(pack_mask(allowed[None]), n, axis=0)
    ids = reference(np.repeat(x[None], n, axis=0), np.stack([sample_params(1.0, top_k=MAX_TOP_K)] * n), u, mask)
    assert set(ids.tolist()) == {3, 50, 51, 120, 199}


def test_all_ones_mask_is_the_unmasked_op(vk, rng) -> None:
    x = np.round(rng.standard_normal((8, 1001)) * 3).astype(np.float32)
    x[1, [4, 70]] = np.nan
    x[2, ::3] = -np.inf
    params, u = random_params(rng, 8), rng.random(8).astype(np.float32)
    ones = np.full((8, 32), 0xFFFFFFFF, np.uint32)
    unmasked = run(vk, x, params, u)
    np.testing.assert_array_equal(run_masked(vk, x, params, u, ones), unmasked)
    np.testing.assert_array_equal(reference(x, params, u, ones), reference(x, params, u))
    np.testing.assert_array_equal(unmasked, reference(x, params, u))


def test_rejects_a_mask_of_the_wrong_shape(vk_default) -> None:
    x = vk_default.upload(np.zeros((2, 40), np.float32))
    params = vk_default.upload(np.zeros((2, 4), np.float32))
    u = vk_default.upload(np.zeros(2, np.float32))
    with pytest.raises(VkrtError, match="mask"):
        ops.sample_top_k(x, params, u, vk_default.upload(np.zeros((2, 1), np.uint32), "u32"))
