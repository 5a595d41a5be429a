"""An op without a native Vulkan kernel runs its numpy reference after one counted drain."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

import vkrt.backend
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.op import OPS, register_op, require
from vkrt.core.tensor import TensorSpec
from vkrt.ops.dispatch import dispatch


def _square_infer(x: TensorSpec) -> tuple[TensorSpec, ...]:
    require(x.dtype == "f32", "test_square", (x,), "x must be f32")
    return (x,)


def _double_infer(x: TensorSpec) -> tuple[TensorSpec, ...]:
    require(x.dtype == "f32", "test_double_inplace", (x,), "x must be f32")
    return ()


@pytest.fixture
def temp_ops() -> Iterator[None]:
    """Two ops that exist only for this test: no backend has a native kernel for them."""

    @register_op("test_square", _square_infer)
    def square(x: np.ndarray) -> np.ndarray:
        return (x * x).astype(np.float32)

    @register_op("test_double_inplace", _double_infer, inplace=(0,))
    def double_inplace(x: np.ndarray) -> None:
        x *= 2

    try:
        yield
    finally:
        singleton = vkrt.backend._vulkan_singleton  # one Vulkan backend per process
        for name in ("test_square", "test_double_inplace"):
            OPS.pop(name, None)
            if singleton is not None:
                singleton._warned_fallback.discard(name)


def _fallback_warnings(caplog: pytest.LogCaptureFixture, op: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "vkrt" and op in r.getMessage()]


def test_fallback_drains_once_and_warns_once(vk_default: Backend, temp_ops: None,
                                             caplog: pytest.LogCaptureFixture,
                                             rng: np.random.Generator) -> None:
    assert not vk_default.kernels("test_square")
    a = rng.standard_normal((5, 33)).astype(np.float32)
    b = rng.standard_normal((5, 33)).astype(np.float32)
    x, w = vk_default.upload(a), vk_default.upload(b)
    vk_default.sync()
    caplog.set_level(logging.WARNING, logger="vkrt")
    before = vk_default.counters.snapshot()
    s = ops.add(x, w)  # recorded, not yet run: the drain must submit it before reading s
    y = dispatch("test_square", s)
    delta = vk_default.counters.since(before)
    assert delta["drains"] == 1
    assert delta["submits"] == 1 and delta["fence_waits"] == 1
    assert y.backend is vk_default and y.shape == (5, 33) and y.dtype == "f32"
    np.testing.assert_array_equal(y.numpy(), ((a + b) * (a + b)).astype(np.float32))
    warnings = _fallback_warnings(caplog, "test_square")
    assert len(warnings) == 1, warnings
    assert "f32[5, 33]" in warnings[0]
    assert vk_default.selections[("test_square", "reference-fallback")] == 1

    caplog.clear()
    before = vk_default.counters.snapshot()
    z = dispatch("test_square", y)
    assert vk_default.counters.since(before)["drains"] == 1  # every call drains...
    assert _fallback_warnings(caplog, "test_square") == []  # ...but warns only once
    np.testing.assert_allclose(z.numpy(), ((a + b) ** 4).astype(np.float32), rtol=1e-6)


def test_inplace_fallback_writes_back_to_the_device(vk_default: Backend, temp_ops: None,
                                                    rng: np.random.Generator) -> None:
    a = rng.standard_normal(77).astype(np.float32)
    x = vk_default.upload(a)
    s = ops.add(x, x)  # pending in the open batch
    before = vk_default.counters.snapshot()
    assert dispatch("test_double_inplace", s) is None
    assert vk_default.counters.since(before)["drains"] == 1
    np.testing.assert_array_equal(s.numpy(), 4 * a)
    # The device copy changed, not just a host copy: a native op reads the new value.
    np.testing.assert_array_equal(ops.add(s, x).numpy(), 5 * a)


def test_reference_backend_never_drains(temp_ops: None) -> None:
    from vkrt.backend.reference import ReferenceBackend

    ref = ReferenceBackend()  # made after the op exists, as backends are in real use
    x = ref.upload(np.arange(6, dtype=np.float32))
    y = dispatch("test_square", x)
    np.testing.assert_array_equal(y.numpy(), np.arange(6, dtype=np.float32) ** 2)
    assert ref.counters.drains == 0


def test_a_drain_submits_the_whole_open_batch(vk_default: Backend, temp_ops: None) -> None:
    """Even work the fallback does not read: a drain leaves nothing recorded behind it."""
    unrelated = vk_default.upload(np.arange(9, dtype=np.float32))
    x = vk_default.upload(np.full(4, 3, np.float32))
    vk_default.sync()
    before = vk_default.counters.snapshot()
    pending = ops.add(unrelated, unrelated)
    dispatch("test_square", x)
    assert vk_default.counters.since(before)["submits"] == 1
    pending.numpy()  # already computed: reading it needs no second submit
    assert vk_default.counters.since(before)["submits"] == 1
    np.testing.assert_array_equal(pending.numpy(), 2 * np.arange(9, dtype=np.float32))
