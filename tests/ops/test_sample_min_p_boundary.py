"""min-p at its boundary: a candidate whose weight equals min_p exactly is kept (w >= min_p,
as transformers' MinPLogitsWarper keeps probs >= min_p * max). With u at its largest the
sample is the last kept candidate, so the expected id is found by arithmetic here, and the
shader must pick the same one."""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from vkrt.ops.sampling import LOG2E, U_MAX, exp2_weights, sample_params, top_k_order

reference = ops.OPS["sample_top_k"].reference


def boundary_case(rng: np.random.Generator, vocab: int, k: int, j: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Logits, params with min_p = candidate j's weight, and candidate j's id."""
    x = (rng.standard_normal(vocab) * 2).astype(np.float32)
    params = sample_params(temperature=0.8, top_k=k)
    order = top_k_order(x, k)
    t = (x[order[1:]] - x[order[0]]) * (params[0] * LOG2E)
    weights = np.concatenate([np.ones(1, np.float32), exp2_weights(t)])
    assert len(set(weights.tolist())) == k  # distinct, so candidate j is the last kept
    params[2] = weights[j]
    return x, params, int(order[j])


@pytest.mark.parametrize("j", [1, 5, 11])
def test_weight_equal_to_min_p_is_kept(rng: np.random.Generator, j: int) -> None:
    x, params, want = boundary_case(rng, 500, 12, j)
    u = np.array([U_MAX], np.float32)
    assert reference(x[None], params[None], u)[0] == want
    above = params.copy()
    above[2] = np.nextafter(params[2], np.float32(1.0))  # one ulp above: candidate j is dropped
    assert reference(x[None], above[None], u)[0] != want


@pytest.mark.parametrize("j", [1, 5, 11])
def test_shader_keeps_the_boundary_candidate(vk, rng: np.random.Generator, j: int) -> None:
    x, params, want = boundary_case(rng, 500, 12, j)
    got = ops.sample_top_k(vk.upload(x[None]), vk.upload(params[None]), vk.upload(np.array([U_MAX], np.float32)))
    assert got.numpy()[0] == want
