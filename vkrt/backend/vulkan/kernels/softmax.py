"""softmax over the last axis: shaders/softmax.comp, one row per workgroup."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import grid_1d, module
from vkrt.backend.vulkan.kernels.norm import row_workgroup
from vkrt.ops.tensor import Tensor, TensorSpec


def _softmax(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
             out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (x,) = inputs
    rows, n = x.shape
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "softmax"), [(x, "f32", False), (y, "f32", True)],
                       grid_1d(rows, 1), ("<II", (rows, n)), {0: row_workgroup(backend.caps)})
    return (y,)


def register(backend: Any) -> None:
    backend.register_kernel(Kernel("softmax", "softmax", _softmax))
