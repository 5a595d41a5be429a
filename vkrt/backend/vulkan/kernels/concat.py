"""concat_columns: shaders/concat.comp, one invocation per output element."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import Tensor, TensorSpec


def _concat(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    a, b, *rest = inputs
    c = rest[0] if rest else b  # two parts: b bound again with width 0, never read
    y = backend.empty(out[0].shape, "f32")
    widths = (a.shape[1], b.shape[1], c.shape[1] if rest else 0)
    backend.run_shader(module(backend, "concat"),
                       [(a, "f32", False), (b, "f32", False), (c, "f32", False), (y, "f32", True)],
                       grid_1d(y.numel), ("<IIII", (y.numel, *widths)), local_size())
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("concat_columns", "concat", _concat))
