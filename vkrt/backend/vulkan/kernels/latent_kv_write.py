"""latent_kv_write (multi-head latent attention's cache row): shaders/latent_kv_write.comp, one
workgroup of norm.comp's lanes per token."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.attention import KV_VARIANT
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, module
from vkrt.backend.vulkan.kernels.norm import row_workgroup
from vkrt.core.tensor import Tensor, TensorSpec


def _supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    """An f16 row must be whole words (kv_write's edge halves are not written here)."""
    cache = inputs[4]
    return cache.dtype != "f16" or cache.shape[2] % 2 == 0


def _latent_kv_write(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                     out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    kv_a, w, positions, cos_sin, cache, slots = inputs
    tokens, rank = kv_a.shape[0], w.shape[0]
    max_positions, rot_dim = cos_sin.shape
    kind = "f32" if cache.dtype == "f32" else "u32"
    backend.run_shader(module(backend, "latent_kv_write", KV_VARIANT[cache.dtype]),
                       [(cache, kind, True), (kv_a, "f32", False), (w, "f32", False), (positions, "i32", False),
                        (cos_sin, "f32", False), (slots, "i32", False)],
                       grid_1d(tokens, 1),
                       ("<IIIIfI", (tokens, rank, rot_dim, max_positions, params["eps"],
                                    int(params.get("interleaved", False)))),
                       {0: row_workgroup(backend.caps)})
    return ()


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("latent_kv_write", "latent_kv_write", _latent_kv_write, supports=_supports))
