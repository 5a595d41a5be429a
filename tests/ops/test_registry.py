"""The op registry: signature errors, backend mixing, deterministic kernel selection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from vkrt import ops
from vkrt.backend.base import Backend, Kernel
from vkrt.backend.reference import ReferenceBackend
from vkrt.core.op import OPS, OpError
from vkrt.errors import VkrtError
from vkrt.ops.dispatch import dispatch


def f32(b: Backend, *shape: int) -> Any:
    return b.upload(np.ones(shape, np.float32))


def i32(b: Backend, *shape: int) -> Any:
    return b.upload(np.zeros(shape, np.int32))


# (op name, a call with bad inputs, the input shapes the message must name)
BAD_CALLS: list[tuple[str, Callable[[Backend], Any], list[str]]] = [
    ("matmul", lambda b: ops.matmul(f32(b, 3, 8), b.upload_weight(np.ones((4, 7), np.float32), "f32", (4, 7))),
     ["f32[3, 8]", "f32[4, 7]"]),
    ("matmul", lambda b: ops.matmul(i32(b, 3, 8), b.upload_weight(np.ones((4, 8), np.float32), "f32", (4, 8))),
     ["i32[3, 8]", "f32[4, 8]"]),
    ("rms_norm", lambda b: ops.rms_norm(f32(b, 2, 16), f32(b, 15), 1e-5), ["f32[2, 16]", "f32[15]"]),
    ("rms_norm", lambda b: ops.rms_norm(f32(b, 2, 16), b.upload(np.ones(16, np.float16)), 1e-5),
     ["f32[2, 16]", "f16[16]"]),
    ("add", lambda b: ops.add(f32(b, 4, 5), f32(b, 5, 4)), ["f32[4, 5]", "f32[5, 4]"]),
    ("add", lambda b: ops.add(f32(b, 4, 5), f32(b, 4)), ["f32[4, 5]", "f32[4]"]),
    ("add", lambda b: ops.add(f32(b, 6), i32(b, 6)), ["f32[6]", "i32[6]"]),
    ("embedding", lambda b: ops.embedding(b.upload_weight(np.ones((10, 4), np.float32), "f32", (10, 4)),
                                          f32(b, 3)), ["f32[10, 4]", "f32[3]"]),
    ("kv_write", lambda b: ops.kv_write(f32(b, 2, 4, 8), f32(b, 2, 4, 8), f32(b, 3, 6), f32(b, 3, 6),
                                        i32(b, 3)), ["f32[2, 4, 8]", "f32[3, 6]", "i32[3]"]),
    ("kv_write", lambda b: ops.kv_write(f32(b, 2, 4, 8), f32(b, 2, 4, 8), f32(b, 3, 8), f32(b, 3, 8),
                                        i32(b, 2)), ["f32[3, 8]", "i32[2]"]),
    ("silu_and_mul", lambda b: ops.silu_and_mul(f32(b, 2, 7)), ["f32[2, 7]"]),
    ("cast", lambda b: ops.cast(f32(b, 3), "q4_0"), ["f32[3]"]),
    ("scale", lambda b: ops.scale(i32(b, 3), 2.0), ["i32[3]"]),
    ("softcap", lambda b: ops.softcap(f32(b, 2, 3), -1.0), ["f32[2, 3]"]),
    ("qkv_norm_rope_kv_write", lambda b: ops.qkv_norm_rope_kv_write(
        f32(b, 2, 64), f32(b, 16), f32(b, 8), i32(b, 2), f32(b, 8, 16), f32(b, 2, 4, 16), f32(b, 2, 4, 16),
        i32(b, 2), 1e-6, 2, 1, 16), ["f32[2, 64]", "f32[16]", "f32[8]"]),
]


@pytest.fixture(params=["reference", "vulkan"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("ref" if request.param == "reference" else "vk_default")


@pytest.mark.parametrize(("op", "call", "shapes"), BAD_CALLS,
                         ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(BAD_CALLS)])
def test_bad_inputs_raise_an_error_naming_op_and_shapes(backend: Backend, op: str,
                                                        call: Callable[[Backend], Any],
                                                        shapes: list[str]) -> None:
    backend.sync()
    before = backend.counters.snapshot()
    with pytest.raises(OpError) as info:
        call(backend)
    assert isinstance(info.value, VkrtError)
    message = str(info.value)
    assert message.startswith(f"{op}: "), message
    for shape in shapes:
        assert shape in message, (shape, message)
    assert backend.counters.since(before)["dispatches"] == 0  # refused before any work
    assert backend.counters.since(before)["drains"] == 0


def test_inputs_on_different_backends_are_refused(vk_default: Backend, ref: Backend) -> None:
    with pytest.raises(OpError, match="add: inputs live on different backends"):
        ops.add(ref.upload(np.ones(4, np.float32)), vk_default.upload(np.ones(4, np.float32)))
    with pytest.raises(OpError, match="different backends"):
        ops.add(ref.upload(np.ones(4, np.float32)), ReferenceBackend().upload(np.ones(4, np.float32)))


def test_non_tensor_inputs_are_refused(ref: Backend) -> None:
    with pytest.raises(OpError, match="add: inputs must be Tensors"):
        dispatch("add", ref.upload(np.ones(4, np.float32)), np.ones(4, np.float32))  # type: ignore[arg-type]


# -- selection ---------------------------------------------------------------------------

def _marker(value: float) -> Any:
    """A kernel whose output says which kernel ran."""

    def run(backend: Any, inputs: Any, params: Any, out: Any) -> Any:
        return (backend.upload(np.full(out[0].shape, value, np.float32)),)

    return run


def _which(backend: Backend) -> float:
    x = backend.upload(np.zeros(3, np.float32))
    return float(ops.add(x, x).numpy()[0])


@pytest.mark.parametrize("reverse", [False, True])
def test_selection_is_priority_then_name_whatever_the_registration_order(reverse: bool) -> None:
    backend = ReferenceBackend()  # its numpy kernels have priority 0
    fakes = [Kernel("add", "zeta", _marker(1.0), priority=5),
             Kernel("add", "alpha", _marker(2.0), priority=5),
             Kernel("add", "omega", _marker(3.0), priority=1)]
    for kernel in reversed(fakes) if reverse else fakes:
        backend.register_kernel(kernel)
    assert [k.name for k in backend.kernels("add")] == ["alpha", "zeta", "omega", "numpy"]
    assert _which(backend) == 2.0  # highest priority; the tie goes to the first name
    assert _which(backend) == 2.0
    assert backend.selections[("add", "alpha")] == 2
    assert backend.selections[("add", "zeta")] == 0
    assert backend.selections[("add", "numpy")] == 0


def test_selection_skips_kernels_that_do_not_support_the_call() -> None:
    backend = ReferenceBackend()
    backend.register_kernel(Kernel("add", "big_only", _marker(7.0), priority=9,
                                   supports=lambda inputs, params: inputs[0].numel >= 100))
    assert _which(backend) == 0.0  # 3 elements: falls through to the numpy kernel
    assert backend.selections[("add", "numpy")] == 1
    big = backend.upload(np.zeros(100, np.float32))
    assert float(ops.add(big, big).numpy()[0]) == 7.0
    assert backend.selections[("add", "big_only")] == 1


def test_reference_backend_has_a_kernel_for_every_op() -> None:
    backend = ReferenceBackend()
    assert all(backend.kernels(op) for op in OPS)


def test_native_kernels_are_counted_on_vulkan(vk_default: Backend) -> None:
    native = vk_default.kernels("add")
    assert native, "add has a native Vulkan kernel"
    key = ("add", native[0].name)
    before = vk_default.selections[key]
    x = vk_default.upload(np.ones(5, np.float32))
    ops.add(x, x).numpy()
    assert vk_default.selections[key] == before + 1


def test_kernel_tests_run_with_fusion_off() -> None:
    """tests/conftest.py turns the fusion layer off here, so compositions of primitives in
    these tests run unfused (a fused-vs-unfused comparison would otherwise compare a kernel
    with itself)."""
    from vkrt.ops import fusion

    assert not fusion.enabled()
