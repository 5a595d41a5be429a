"""qkv_rope_kv_write: shaders/qkv_rope.comp, rope of q and k plus the KV cache write in one dispatch.

One invocation per q element and per cache item of a token (f32: an element of k and v;
f16: a u32 word, two halves of each; q8_0: a 32-value block of each). Even head_dim only, so f16 cache rows are whole
words; other shapes run the reference (rope + kv_write composition).

qkv_norm_rope_kv_write (QK-norm) is the same shader's NORM=qk variant: one workgroup per
(token, head) whose lanes first reduce the head's sum of squares as norm.comp reduces a row
(v heads too with `v_norm`: specialisation constant 1).
"""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.attention import KV_VARIANT
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.backend.vulkan.kernels.norm import row_workgroup
from vkrt.core.tensor import KV_Q8_0, Tensor, TensorSpec

KV_ELEMS = {"f32": 1, "f16": 2, KV_Q8_0: 32}  # cache values per item of the `none` variant


def _supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    return params["head_dim"] % 2 == 0


def _qkv_rope_kv_write(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                       out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    qkv, positions, cos_sin, k_cache, v_cache, slots = inputs
    head_dim = params["head_dim"]
    q_width, kv_dim = params["num_heads"] * head_dim, params["num_kv_heads"] * head_dim
    max_positions, rot_dim = cos_sin.shape
    row_items = q_width + kv_dim // KV_ELEMS[k_cache.dtype]
    tokens = qkv.shape[0]
    kind = "f32" if k_cache.dtype == "f32" else "u32"
    q = backend.empty(out[0].shape, "f32")
    push = (tokens, q_width, kv_dim, head_dim, rot_dim, max_positions,
            int(params.get("interleaved", False)), row_items)
    backend.run_shader(module(backend, "qkv_rope", KV_VARIANT[k_cache.dtype], "none"),
                       [(qkv, "f32", False), (positions, "i32", False), (cos_sin, "f32", False),
                        (k_cache, kind, True), (v_cache, kind, True), (slots, "i32", False),
                        (q, "f32", True)],
                       grid_1d(tokens * row_items), ("<8I", push), local_size())
    return (q,)


def _qkv_norm_rope_kv_write(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    qkv, q_norm, k_norm, positions, cos_sin, k_cache, v_cache, slots = inputs
    head_dim = params["head_dim"]
    q_width, kv_dim = params["num_heads"] * head_dim, params["num_kv_heads"] * head_dim
    max_positions, rot_dim = cos_sin.shape
    tokens = qkv.shape[0]
    kind = "f32" if k_cache.dtype == "f32" else "u32"
    q = backend.empty(out[0].shape, "f32")
    push = (tokens, q_width, kv_dim, head_dim, rot_dim, max_positions, int(params.get("interleaved", False)),
            0, params["eps"])
    heads = params["num_heads"] + 2 * params["num_kv_heads"]
    backend.run_shader(module(backend, "qkv_rope", KV_VARIANT[k_cache.dtype], "qk"),
                       [(qkv, "f32", False), (positions, "i32", False), (cos_sin, "f32", False),
                        (k_cache, kind, True), (v_cache, kind, True), (slots, "i32", False),
                        (q, "f32", True), (q_norm, "f32", False), (k_norm, "f32", False)],
                       grid_1d(tokens * heads, 1), ("<8If", push),
                       {0: row_workgroup(backend.caps), 1: int(params.get("v_norm", False))})
    return (q,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("qkv_rope_kv_write", "qkv_rope_kv_write", _qkv_rope_kv_write,
                                   supports=_supports))
    backend.register_kernel(Kernel("qkv_norm_rope_kv_write", "qkv_norm_rope_kv_write", _qkv_norm_rope_kv_write,
                                   supports=_supports))
