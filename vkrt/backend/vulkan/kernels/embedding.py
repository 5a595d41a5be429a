"""embedding: gather rows of a stored-format table (shaders/embedding.comp), bit-exact."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import (
    KernelBackend,
    backend_of,
    grid_1d,
    local_size,
    module,
)
from vkrt.backend.vulkan.kernels.layouts import LAYOUTS, TILE_ROWS, padded_rows, quants_bytes
from vkrt.core.tensor import Tensor, TensorSpec

FORMATS = tuple(LAYOUTS)  # the shader reads every format that has a device layout


def _supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    table = inputs[0]
    backend = backend_of(table)
    caps = backend.caps
    if caps.access_path == "texel":
        fits = table.handle.size // 4 <= caps.max_texel_elements
    else:
        fits = table.handle.size <= caps.max_storage_range
    return table.dtype in FORMATS and fits


def _run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
         out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    table, ids = inputs
    v, d = table.shape
    y = backend.empty(out[0].shape, "f32")
    n = y.numel
    if n == 0:
        return (y,)
    s_base = quants_bytes(table.dtype, v, d) // 4
    # q6_k's d words after its int8 scales, q2_k's d|dmin words after its scale|min bytes
    d_base = s_base + padded_rows(v) * (d // 256) * 4 if table.dtype in ("q6_k", "q2_k") else 0
    push = (n, d, -(-d // 32), s_base, d_base)
    backend.run_shader(module(backend, "embedding", table.dtype),
                       [(table, "f32" if table.dtype == "f32" else "u32", False), (ids, "i32", False),
                        (y, "f32", True)],
                       grid_1d(n), ("<5I", push), {**local_size(), 7: TILE_ROWS})
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("embedding", "embedding", _run, supports=_supports))
