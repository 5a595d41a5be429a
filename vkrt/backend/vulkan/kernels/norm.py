"""rms_norm, rms_norm_add, layer_norm: shaders/norm.comp, one row per workgroup."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, module
from vkrt.core.tensor import Tensor, TensorSpec


def row_workgroup(caps: DeviceCaps) -> int:
    """Lanes per row for the row-reduction shader (norm.comp): spec constant 0.

    Must be a power of two (include/reduce.glsl's tree). On llvmpipe, whose workgroups each
    run on one CPU thread, 8 lanes (its SIMD width) measured fastest: 1 lane leaves the
    vector unit idle, wider groups pay for barriers and shared memory (docs/ARCHITECTURE.md).
    GPUs take 256 lanes so one row fills several warps and the loads coalesce.
    """
    if caps.device_type == "cpu":
        return max(1, min(8, caps.subgroup_size))
    limit = min(256, caps.max_workgroup_invocations or 256)
    return 1 << (limit.bit_length() - 1)  # the largest power of two within the device limit


def _row_grid(rows: int) -> tuple[int, int, int]:
    return grid_1d(rows, 1)  # one workgroup per row


def _rms_norm(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
              out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, w = inputs
    rows, dim = x.shape
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "norm", "rms"),
                       [(x, "f32", False), (w, "f32", False), (y, "f32", True)],
                       _row_grid(rows), ("<IIf", (rows, dim, params["eps"])),
                       {0: row_workgroup(backend.caps)})
    return (y,)


def _rms_norm_add(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                  out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, w, residual = inputs
    rows, dim = x.shape
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "norm", "rms_add"),
                       [(x, "f32", False), (w, "f32", False), (residual, "f32", False), (y, "f32", True)],
                       _row_grid(rows), ("<IIf", (rows, dim, params["eps"])),
                       {0: row_workgroup(backend.caps)})
    return (y,)


def _layer_norm(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, w, b = inputs
    rows, dim = x.shape
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "norm", "layer"),
                       [(x, "f32", False), (w, "f32", False), (b, "f32", False), (y, "f32", True)],
                       _row_grid(rows), ("<IIf", (rows, dim, params["eps"])),
                       {0: row_workgroup(backend.caps)})
    return (y,)


def _gated_rms_norm(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                    out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, z, w = inputs
    rows, width = x.shape
    dim = params.get("group_size") or width  # a workgroup per group of a row
    groups = rows * (width // dim)
    y = backend.empty(out[0].shape, "f32")
    spec = {0: row_workgroup(backend.caps), 1: int(params.get("gate_first", False)), 2: w.shape[0] // dim}
    backend.run_shader(module(backend, "norm", "rms_gated"),
                       [(x, "f32", False), (z, "f32", False), (w, "f32", False), (y, "f32", True)],
                       _row_grid(groups), ("<IIf", (groups, dim, params["eps"])), spec)
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("rms_norm", "norm.rms", _rms_norm))
    backend.register_kernel(Kernel("rms_norm_add", "norm.rms_add", _rms_norm_add))
    backend.register_kernel(Kernel("layer_norm", "norm.layer", _layer_norm))
    backend.register_kernel(Kernel("gated_rms_norm", "norm.rms_gated", _gated_rms_norm))
