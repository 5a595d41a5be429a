"""argmax over the last axis (greedy sampling): shaders/argmax.comp, one row per workgroup."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import grid_1d, module
from vkrt.backend.vulkan.kernels.norm import row_workgroup
from vkrt.ops.tensor import Tensor, TensorSpec


def _argmax(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (x,) = inputs
    rows, n = x.shape
    y = backend.empty(out[0].shape, "i32")
    backend.run_shader(module(backend, "argmax"), [(x, "f32", False), (y, "i32", True)],
                       grid_1d(rows, 1), ("<II", (rows, n)), {0: row_workgroup(backend.caps)})
    return (y,)


def register(backend: Any) -> None:
    backend.register_kernel(Kernel("argmax", "argmax", _argmax))
