"""ActivationPool: released tensors kept by size, so a repeated eager step rebinds the same
allocations and makes no descriptor set again."""

from __future__ import annotations

import gc

import numpy as np

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.activation_pool import ActivationPool
from vkrt.backend.vulkan.memory import Allocation


def _alloc(size: int, purpose: str = "activations") -> Allocation:
    return Allocation(block=None, offset=0, size=size, purpose=purpose)  # type: ignore[arg-type]


def test_the_lowest_id_of_a_size_comes_first_whatever_the_release_order() -> None:
    pool = ActivationPool()
    first, second, third = _alloc(64), _alloc(64), _alloc(64)
    for alloc in (third, first, second):
        assert pool.put(alloc) == []
    assert [pool.take("activations", 64) for _ in range(3)] == [first, second, third]
    assert pool.take("activations", 64) is None and pool.nbytes == 0


def test_sizes_and_purposes_are_kept_apart() -> None:
    pool = ActivationPool()
    pool.put(_alloc(64))
    assert pool.take("activations", 128) is None
    assert pool.take("inputs", 64) is None
    assert pool.nbytes_by_purpose == {"activations": 64, "inputs": 0}


def test_past_capacity_the_least_recently_released_size_goes_back() -> None:
    pool = ActivationPool(capacity=256)
    old, recent = _alloc(128), _alloc(64)
    pool.put(old)
    pool.put(recent)
    pool.put(_alloc(64))
    assert pool.put(_alloc(64)) == [old]  # 128 + 3 * 64 > 256: the size released longest ago
    assert pool.nbytes == 192 and pool.take("activations", 128) is None


def _step(backend: Backend, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A few dependent ops, as a forward makes them: fresh inputs, intermediates dropped."""
    x, w = backend.upload(a), backend.upload(b, purpose="inputs")
    h = ops.add(ops.scale(x, 2.0), w)
    return ops.add(ops.scale(h, 0.5), h).numpy()


def test_a_repeated_eager_step_makes_no_descriptor_set(vk_default: Backend, rng: np.random.Generator) -> None:
    a = rng.standard_normal((5, 97)).astype(np.float32)
    b = rng.standard_normal((5, 97)).astype(np.float32)
    descriptors = vk_default.descriptors  # type: ignore[attr-defined]
    np.testing.assert_allclose(_step(vk_default, a, b), 1.5 * (2 * a + b), rtol=1e-6)
    gc.collect()
    created = descriptors.created
    for k in range(1, 3):  # new values, the same shapes
        np.testing.assert_allclose(_step(vk_default, a + k, b), 1.5 * (2 * (a + k) + b), rtol=1e-6)
        gc.collect()
    assert descriptors.created == created
