"""sample_top_k (token sampling): shaders/sample.comp, one row per workgroup."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import grid_1d, module
from vkrt.backend.vulkan.kernels.norm import row_workgroup
from vkrt.ops.sampling import MAX_TOP_K
from vkrt.ops.tensor import Tensor, TensorSpec

CHUNK = 32  # the shader's CHUNK: columns per lane noted between list insertions


def shared_bytes(lanes: int) -> int:
    """The shader's shared memory for `lanes` lanes: per-lane lists and notes, candidates."""
    return 4 * (2 * MAX_TOP_K * lanes + CHUNK * lanes + 2 * MAX_TOP_K + 2 * lanes)


def sample_workgroup(caps: Any) -> int:
    """The row workgroup (spec constant 0), halved until the per-lane lists fit in shared
    memory (a 256-lane GPU row would need 165 KiB). The ids do not depend on it."""
    lanes = row_workgroup(caps)
    while lanes > 1 and shared_bytes(lanes) > caps.max_shared_memory:
        lanes //= 2
    return lanes


def _sample_top_k(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
                  out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    logits, sample_params, uniforms, mask = inputs
    rows, n = logits.shape
    ids = backend.empty(out[0].shape, "i32")
    backend.run_shader(module(backend, "sample"),
                       [(logits, "f32", False), (sample_params, "f32x4", False), (uniforms, "f32", False),
                        (mask, "u32", False), (ids, "i32", True)],
                       grid_1d(rows, 1), ("<II", (rows, n)), {0: sample_workgroup(backend.caps)})
    return (ids,)


def register(backend: Any) -> None:
    backend.register_kernel(Kernel("sample_top_k", "sample_top_k", _sample_top_k))
