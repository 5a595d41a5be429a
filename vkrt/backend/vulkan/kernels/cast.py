"""cast (f32 <-> f16 <-> bf16) and copy: shaders/cast.comp, one output word per invocation."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import Tensor, TensorSpec

FORMAT_CODES = {"f32": 0, "f16": 1, "bf16": 2}  # spec constants SRC (1) and DST (2) of cast.comp


def _convert(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
             out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    # Same-dtype casts run the codecs too: bf16 -> bf16 quietens NaNs like the reference.
    (x,) = inputs
    y = backend.empty(out[0].shape, out[0].dtype)
    n = x.numel
    spec = {**local_size(), 1: FORMAT_CODES[x.dtype], 2: FORMAT_CODES[out[0].dtype]}
    backend.run_shader(module(backend, "cast", "convert"), [(x, "u32", False), (y, "u32", True)],
                       grid_1d(-(-n // 2)), ("<I", (n,)), spec)
    return (y,)


def _copy(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
          out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (x,) = inputs
    y = backend.empty(out[0].shape, out[0].dtype)
    words = -(-x.nbytes // 4)  # allocations are padded to whole words (and beyond)
    backend.run_shader(module(backend, "cast", "copy"), [(x, "u32", False), (y, "u32", True)],
                       grid_1d(words), ("<I", (words,)), local_size())
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("cast", "cast.convert", _convert))
    backend.register_kernel(Kernel("copy", "cast.copy", _copy))
