"""reshape: a view on the same storage, no copy and no dispatch, on both backends.

The expected per-head norm is computed in the test (float64 numpy), not by the op under test.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from vkrt.backend.base import Backend
from vkrt.errors import VkrtError


@pytest.fixture(params=["reference", "vulkan"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("ref" if request.param == "reference" else "vk_default")


def test_reshape_is_a_free_view(backend: Backend, rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 4 * 8)).astype(np.float32)
    t = backend.upload(x)
    before = backend.counters.snapshot()
    v = ops.reshape(t, (-1, 8))
    assert v.shape == (12, 8) and v.dtype == "f32"
    assert backend.counters.since(before)["dispatches"] == 0
    np.testing.assert_array_equal(v.numpy(), x.reshape(12, 8))
    backend.write(v, np.zeros((12, 8), np.float32))  # writes through to the base
    assert not t.numpy().any()


def test_per_head_rms_norm_through_views(backend: Backend, rng: np.random.Generator) -> None:
    """[T, H*D] -> [T*H, D] -> rms_norm -> [T, H*D]: the QK-norm of models with separate q/k/v."""
    tokens, heads, head_dim, eps = 5, 3, 16, 1e-6
    x = rng.standard_normal((tokens, heads * head_dim)).astype(np.float32)
    w = rng.standard_normal(head_dim).astype(np.float32)
    xt, wt = backend.upload(x), backend.upload(w)
    drains = backend.counters.drains  # the backend is shared: count this test's drains only
    y = ops.rms_norm(ops.reshape(xt, (tokens * heads, head_dim)), wt, eps)
    got = ops.reshape(y, (tokens, heads * head_dim)).numpy()
    per_head = x.astype(np.float64).reshape(tokens, heads, head_dim)
    want = per_head / np.sqrt((per_head**2).mean(-1, keepdims=True) + eps) * w
    assert nmse(got, want.reshape(tokens, -1)) <= 1e-12
    assert backend.counters.drains == drains or backend.name == "reference"


def test_in_place_op_on_a_view_mutates_the_base(backend: Backend, rng: np.random.Generator) -> None:
    """kv_write through a [blocks, block_size, kv_dim] view of a flat cache."""
    blocks, block_size, kv_dim = 3, 4, 8
    k_cache = backend.upload(np.zeros((blocks * block_size * kv_dim,), np.float32))
    v_cache = backend.upload(np.zeros((blocks * block_size * kv_dim,), np.float32))
    k = rng.standard_normal((2, kv_dim)).astype(np.float32)
    shape = (blocks, block_size, kv_dim)
    ops.kv_write(ops.reshape(k_cache, shape), ops.reshape(v_cache, shape), backend.upload(k),
                 backend.upload(k), backend.upload(np.array([5, 0], np.int32)))
    flat = k_cache.numpy().reshape(-1, kv_dim)
    np.testing.assert_array_equal(flat[5], k[0])
    np.testing.assert_array_equal(flat[0], k[1])


def test_view_keeps_its_base_alive(backend: Backend, rng: np.random.Generator) -> None:
    x = rng.standard_normal((6, 10)).astype(np.float32)
    view = ops.reshape(backend.upload(x), (60,))
    gc.collect()
    filler = [backend.upload(np.full((6, 10), 7.0, np.float32)) for _ in range(4)]  # would reuse freed memory
    np.testing.assert_array_equal(view.numpy(), x.reshape(-1))
    del filler


def test_bad_reshapes_are_refused(backend: Backend) -> None:
    t = backend.upload(np.zeros((4, 6), np.float32))
    for shape in [(5, 5), (-1, -1), (-1, 7), (0, -1), (-2, -12)]:
        with pytest.raises(VkrtError, match="reshape"):
            ops.reshape(t, shape)
    w = backend.upload_weight(np.zeros((32, 32), np.float32), "f32", (32, 32))
    with pytest.raises(VkrtError, match="reshape"):
        ops.reshape(w, (1024,))
