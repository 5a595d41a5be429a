"""matmul (y = x @ w.T) against stored-format weights: shaders/matmul_vec.comp and matmul_tiled.comp.

Two kernels for one op, chosen by the number of tokens T: `matmul.vec` (one invocation per
ROWS rows of one token; decode) and `matmul.tiled` (one invocation per TILE_TOKENS x
TILE_ROWS outputs; prefill). Both reduce every output in quant.glsl's fixed block order, so
a token's row of y is bit-identical whatever T is and whichever kernel ran (invariant 9).
K-quants (q4_k, q6_k) are not handled here yet and fall back to the reference tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import module
from vkrt.backend.vulkan.kernels.layouts import quants_bytes, row_texels
from vkrt.ops.tensor import Tensor, TensorSpec

FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
SCALED_FORMATS = ("q8_0", "q4_0", "q4_1")
MAX_GROUPS = 65535


@dataclass(frozen=True)
class MatmulConfig:
    """Specialisation constants of both kernels and the vec/tiled switch, per device."""

    vec_workgroup: int
    vec_rows: int
    tiled_workgroup: int
    tile_rows: int
    tile_tokens: int
    vec_max_tokens: int


def config_for(caps: Any, dtype: str) -> MatmulConfig:
    """Choose sizes for weights of `dtype` on the probed device (measured reasons inline)."""
    if caps.device_type == "cpu":
        # llvmpipe (subgroup 8 = one AVX2 register of lanes; each workgroup is one task for
        # its 2-thread pool). Measured with tools/bench_ops.py-style timing, 2-core EPYC,
        # noisy shared box, medians:
        # - vec, workgroup 16: fewer than 16 leaves 576-row matrices badly balanced, more
        #   gave no gain (8/16/32/64 within noise at 1536 rows; 16 best at 49152 rows).
        # - vec rows per invocation: 4-bit/8-bit weights gain from more rows sharing one x
        #   load (q4_1 49152x576: 1 row 22.6 ms, 2 rows 17.3, 4 rows 10.5, 8 rows 6.7);
        #   float rows are 4-8x larger and more rows in flight thrash the cache
        #   (f32 49152x576: 2 rows 22 ms, 4 rows 36 ms, 8 rows 45 ms).
        # - tiled 8 rows x 8 tokens, workgroup 16: q4_1 128x1536x576 ~17 ms (4x8: 25 ms,
        #   8x4: 18 ms, 4x16: 30 ms); f32 ~11-19 ms (4x8: 20 ms, 16x4: 26 ms).
        # - vec up to 4 tokens: a vec pass per token costs ~1/4 of one tiled pass over 8.
        float_weights = dtype in ("f32", "f16", "bf16")
        return MatmulConfig(vec_workgroup=16, vec_rows=2 if float_weights else 8, tiled_workgroup=16,
                            tile_rows=8, tile_tokens=8, vec_max_tokens=4)
    # GPUs (not measured yet): a few subgroups per workgroup, few rows per invocation so
    # that a decode matvec still spreads over thousands of invocations.
    sub = max(caps.subgroup_size, 8)
    return MatmulConfig(vec_workgroup=min(4 * sub, 256), vec_rows=2, tiled_workgroup=min(2 * sub, 128),
                        tile_rows=4, tile_tokens=4, vec_max_tokens=4)


def _fits(backend: Any, w: Tensor, x: Tensor) -> bool:
    """Whether the device can bind these operands whole (texel-count or range limits)."""
    caps = backend.caps
    size = w.handle.size
    if caps.access_path == "texel":
        return size // 4 <= caps.max_texel_elements and x.numel <= caps.max_texel_elements
    return size <= caps.max_storage_range and x.numel * 4 <= caps.max_storage_range


def supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    x, w = inputs
    return w.dtype in FORMATS and _fits(w.backend, w, x)


def _groups(invocations: int, workgroup: int, y: int) -> tuple[int, int, int]:
    groups = max(1, -(-invocations // workgroup))
    if groups > MAX_GROUPS:
        raise ValueError(f"matmul: {groups} workgroups exceed the dispatch limit")
    return (groups, y, 1)


def dispatch_matmul(backend: Any, x: Tensor, w: Tensor, tiled: bool) -> Tensor:
    """Record y = x @ w.T with the vec or the tiled kernel (any T works with either)."""
    t, k = x.shape
    n = w.shape[0]
    y = backend.empty((t, n), "f32")
    if t == 0 or n == 0:
        return y
    cfg = config_for(backend.caps, w.dtype)
    texel = backend.caps.access_path == "texel"
    x_vec4 = texel and k % 4 == 0
    bindings = [(w, "f32x4" if w.dtype == "f32" else "u32x4", False),
                (x, "f32x4" if x_vec4 else "f32", False), (y, "f32", True)]
    if w.dtype in SCALED_FORMATS:
        bindings.append((w, "u32", False))
    blocks = -(-k // 32)
    push = ("<6I", (t, n, k, blocks, row_texels(w.dtype, k), quants_bytes(w.dtype, n, k) // 4))
    if tiled:
        name = module(backend, "matmul_tiled", w.dtype)
        spec = {0: cfg.tiled_workgroup, 1: cfg.tile_rows, 3: cfg.tile_tokens}
        groups = _groups(-(-n // cfg.tile_rows), cfg.tiled_workgroup, -(-t // cfg.tile_tokens))
    else:
        name = module(backend, "matmul_vec", w.dtype)
        spec = {0: cfg.vec_workgroup, 1: cfg.vec_rows}
        groups = _groups(-(-n // cfg.vec_rows), cfg.vec_workgroup, t)
    if texel:
        spec[2] = int(x_vec4)
    backend.run_shader(name, bindings, groups, push, spec)
    return y


def _run_vec(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
             out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    return (dispatch_matmul(backend, inputs[0], inputs[1], tiled=False),)


def _run_tiled(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
               out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    return (dispatch_matmul(backend, inputs[0], inputs[1], tiled=True),)


def _vec_supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    x, w = inputs
    backend: Any = w.backend
    return x.shape[0] <= config_for(backend.caps, w.dtype).vec_max_tokens and supports(inputs, params)


def register(backend: Any) -> None:
    # Higher priority first: vec for T <= vec_max_tokens, tiled for the rest.
    backend.register_kernel(Kernel("matmul", "matmul.vec", _run_vec, priority=10, supports=_vec_supports))
    backend.register_kernel(Kernel("matmul", "matmul.tiled", _run_tiled, priority=5, supports=supports))
