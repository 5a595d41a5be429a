"""matmul (y = x @ w.T) against stored-format weights: shaders/matmul_vec.comp.

One shader, two registered kernels that differ only in specialisation constants:
`matmul.vec` for the decode buckets (T <= MAX_TOKENS: one token tile of TOKENS = T rounded
up to a power of two) and `matmul.tiled` for prefill (tiles of MAX_TOKENS tokens). Each
invocation computes ROWS rows x TOKENS tokens, reducing every output in quant.glsl's fixed
block order, so a token's row of y is bit-identical whatever T is and whichever
configuration ran (invariant 9). CPU devices give each invocation its own rows; GPUs get
split-K (SPLIT lanes share ROWS rows, each folding every SPLIT-th block, the partial sums
added in shared memory by a fixed tree), with SPLIT chosen per device and K only, so that
order is just as independent of T. Weights are read in the row-tiled layout of layouts.py.

`matmul_silu_and_mul` (w = gate rows stacked over up rows) runs the same shader with spec
constant GATES = 2: each invocation reduces ROWS gate rows and the matching ROWS up rows in
that same order and writes silu(g) * u, bit-identical to matmul then silu_and_mul.

Spec constant 6 (FUSE, bits FUSE_CODES) adds a prologue or epilogue to any of these, over
bindings the shader always declares (the norm weight, then the residual; x is bound where
one is unused): `rms_norm_matmul` (rms: the pass over x also sums x^2 per token, x is
multiplied by the norm weight as it loads, and the finished sums are scaled by 1/rms; equal
to rms_norm then matmul up to rounding), `matmul_add` (add: + residual [T, N], or a bias [N]
broadcast over the tokens with spec constant 12; bit-identical to matmul then add) and
`rms_norm_matmul_add` (rms_add: both, bit-identical to rms_norm_matmul then add). So each
format and access path is one `plain` module. `rms_norm_qkv_rope_kv_write` is the
EPILOGUE=qkv variant, whose bindings and push constants are its own: the rms prologue plus
include/qkv_epilogue.glsl, rope and the f32 / f16 KV-cache write, chosen by spec constant
9; bit-identical to rms_norm_matmul then qkv_rope_kv_write, which is what runs for shapes
its 8-row groups cannot take.

On GPUs (`staged_device`) on the storage-buffer path, `matmul.tiled` runs
shaders/matmul_tiled.comp instead: a workgroup per tile of rows x tokens with both operands
staged in shared memory, in matmul_vec's split-K order for the split matmul_vec runs there,
so its rows are bit-identical to the vec kernel's (every op above but the qkv one, which
keeps matmul_vec).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels.common import KernelBackend, backend_of, float_bits, module
from vkrt.backend.vulkan.kernels.layouts import LAYOUTS, TILE_ROWS, quants_bytes, row_texels
from vkrt.core.tensor import Tensor, TensorSpec

FORMATS = tuple(LAYOUTS)  # the shader decodes every format that has a device layout
MAX_GROUPS = 65535


@dataclass(frozen=True)
class MatmulConfig:
    """Specialisation constants for one (weight format, N, T) on one device."""

    workgroup: int
    rows: int  # per invocation (split-K: per workgroup); matmul_tiled: per workgroup tile
    tokens: int  # per invocation; matmul_tiled: per workgroup tile
    split: int = 1  # > 1: lanes splitting K per row set (the workgroup); at most this many
    shader: str = "matmul_vec"  # or "matmul_tiled" (the fields below are its own)
    lanes: int = 1  # invocations sharing one output (each carrying split / lanes slices)
    lane_rows: int = 1  # output rows per lane group
    lane_tokens: int = 1  # tokens per lane group


def _pow2_at_least(t: int) -> int:
    return 1 << max(0, t - 1).bit_length()


def max_tokens(caps: DeviceCaps) -> int:
    """Largest token tile: `matmul.vec` takes T up to this, `matmul.tiled` the rest."""
    return 8 if caps.device_type == "cpu" else 4


def config_for(caps: DeviceCaps, dtype: str, n: int, t: int, prefill: bool = False) -> MatmulConfig:
    """Choose sizes for weights of `dtype` with n rows and t tokens (measured reasons inline)."""
    tokens = max_tokens(caps) if prefill else min(_pow2_at_least(t), max_tokens(caps))
    if caps.device_type == "cpu":
        # llvmpipe: subgroup 8 = one AVX2 register of lanes; each workgroup is one task for
        # its thread pool (2 threads here). Measured with device timestamps, 2-core EPYC,
        # SmolLM2 shapes, q4_1 and q8_0 (T = 1..8), interleaved, best of 5:
        # - workgroup 8 beat 16 nearly everywhere (more, smaller tasks balance 2 threads:
        #   576x576 q4_1 T=8 0.15 ms vs 0.24).
        # - rows: large matrices gain from more rows sharing each activation load
        #   (49152x576 q8_0 T=1: 8 rows 5.7 ms, 16 rows 4.2, 32 rows 3.0; T=8: 15.3 / 10.4
        #   / 8.3), but a 576-row matrix then has too few workgroups to balance
        #   (576x1536 q4_1 T=1: 8 rows 0.10 ms, 32 rows 0.13). So rows grow with n while
        #   keeping >= ~10 workgroups.
        # - tokens: one pass over TOKENS tokens reuses each decoded weight block:
        #   3072x576 q4_1, one 8-token pass 0.47 ms vs 8 one-token passes 1.15 ms.
        # - float rows are 4-8x larger than 4-bit ones: 8 rows win up to 3072x576 (f32 T=1
        #   0.30 ms vs 2 rows 0.39; T=8 0.74 vs 1.46), but with few tokens on a huge matrix
        #   more rows in flight thrash the cache (f32 49152x576 T=1: 2 rows 13.5 ms, 8 rows
        #   29.7; T=8: 4 and 8 rows 22.5, 2 rows 25.6).
        if dtype in ("f32", "f16", "bf16"):
            rows = (2 if t <= 2 else 4) if n >= 16384 else 8
        else:
            rows = 32 if n >= 2560 else 16 if n >= 1280 else 8
        return MatmulConfig(workgroup=8, rows=rows, tokens=tokens)
    # GPUs (not measured yet: no GPU was available): split-K, a workgroup of up to 32 lanes
    # per 4 rows, so a 576-row decode matvec is 144 workgroups instead of 288 lone threads
    # each walking all of K; the lanes' partial sums meet in shared memory.
    return MatmulConfig(workgroup=32, rows=4, tokens=tokens, split=32)


# matmul_tiled.comp's tile (not measured: no GPU was available). 8 rows x 16 tokens, 4 lanes
# per output, each lane group 2 rows x 2 tokens: 128 invocations and 13.1 KiB of shared
# memory at most (q2_k's 16-byte scales), within Vulkan's minimum limits (128, 16 KiB), so no
# device limit decides whether it runs. A weight block is decoded once per 16 tokens and an
# activation block loaded once per 8 rows (matmul_vec on GPUs: 4 and 4).
STAGED = MatmulConfig(workgroup=128, rows=8, tokens=16, split=32, shader="matmul_tiled", lanes=4, lane_rows=2,
                      lane_tokens=2)


def staged_device(caps: DeviceCaps) -> bool:
    """Whether prefill takes matmul_tiled.comp here: GPUs only (llvmpipe's shared memory is
    slow; tests force it there by replacing this function)."""
    return caps.device_type in ("discrete", "integrated")


def dispatch_config(caps: DeviceCaps, dtype: str, n: int, k: int, t: int, tiled: bool, gated: bool = False,
                    qkv: bool = False, norm_and_add: bool = False) -> MatmulConfig:
    """The configuration `dispatch_matmul` runs for n weight rows, K = k and t tokens on `caps`:
    `config_for`, adjusted for the gated / qkv row groups and split-K's lanes per K; prefill
    on a `staged_device`'s storage-buffer path takes matmul_tiled.comp at the same split,
    except for the fused qkv epilogue and a folded norm with an add (FUSE "rms_add"), which
    matmul_tiled's one fused operand cannot carry."""
    cfg = config_for(caps, dtype, n, t, prefill=tiled)
    blocks = -(-k // 32)
    split = min(cfg.split, 1 << (blocks.bit_length() - 1))  # a power of two <= the blocks (fixed per K)
    if tiled and not qkv and not norm_and_add and caps.access_path == "ssbo" and staged_device(caps):
        # matmul_vec's split for this K (config_for's split depends on the device only), so
        # both kernels reduce every output in one order.
        lanes = min(STAGED.lanes, split)
        rows, lane_rows = (STAGED.rows // 2, STAGED.lane_rows // 2) if gated else (STAGED.rows, STAGED.lane_rows)
        workgroup = lanes * (rows // lane_rows) * (STAGED.tokens // STAGED.lane_tokens)
        return replace(STAGED, split=split, lanes=lanes, rows=rows, lane_rows=lane_rows, workgroup=workgroup)
    if gated:
        # Sized for all 2F weight rows: each invocation streams ROWS gate + ROWS up rows.
        cfg = replace(cfg, rows=max(1, cfg.rows // 2))
    if qkv:  # the epilogue's rotation groups are 8 rows (include/qkv_epilogue.glsl)
        cfg = replace(cfg, rows=8)
    if cfg.split > 1:
        cfg = replace(cfg, split=split, workgroup=split)
    return cfg


def _fits(backend: KernelBackend, w: Tensor, x: Tensor) -> bool:
    """Whether the device can bind these operands whole (texel-count or range limits)."""
    caps = backend.caps
    size = w.handle.size
    if caps.access_path == "texel":
        return size // 4 <= caps.max_texel_elements and x.numel <= caps.max_texel_elements
    return size <= caps.max_storage_range and x.numel * 4 <= caps.max_storage_range


def supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    x, w = inputs
    return w.dtype in FORMATS and _fits(backend_of(w), w, x)


def _groups(invocations: int, workgroup: int, y: int) -> tuple[int, int, int]:
    groups = max(1, -(-invocations // workgroup))
    if groups > MAX_GROUPS:
        raise ValueError(f"matmul: {groups} workgroups exceed the dispatch limit")
    return (groups, y, 1)


@dataclass(frozen=True)
class QkvEpilogue:
    """EPILOGUE=qkv: rope q and k of the stacked qkv rows, return q, store k and v."""

    positions: Tensor
    cos_sin: Tensor
    k_cache: Tensor
    v_cache: Tensor
    slots: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    interleaved: bool


def dispatch_matmul(backend: KernelBackend, x: Tensor, w: Tensor, tiled: bool, gated: bool = False,
                    norm: tuple[Tensor, float] | None = None, residual: Tensor | None = None,
                    qkv: QkvEpilogue | None = None, activation: str = "silu", scale: float = 1.0) -> Tensor:
    """Record y = x @ w.T with the decode (vec) or prefill (tiled) sizes; any T works with either.

    gated: y = silu_and_mul(x @ w.T) of w = [gate; up] (2F rows), y [T, F], in one dispatch
    (gelu_tanh_and_mul for activation "gelu_tanh": spec constant 10).
    scale: y = (x @ w.T) * scale before any residual add (spec constant 11).
    norm = (g, eps): x is normalised first, rms_norm(x, g, eps) (spec constant 6, FUSE "rms").
    residual: y += residual (FUSE "add"; with norm "rms_add"), [T, N] or a bias [N] (spec constant 12).
    qkv (with norm): y is rope(q) [T, num_heads * head_dim]; rope(k), v go to the caches (the
    matmul_vec EPILOGUE=qkv module).
    """
    t, k = x.shape
    gates = 2 if gated else 1
    n = w.shape[0] // gates
    y = backend.empty((t, qkv.num_heads * qkv.head_dim if qkv else n), "f32")
    if t == 0 or n == 0:
        return y
    cfg = dispatch_config(backend.caps, w.dtype, w.shape[0], k, t, tiled, gated, qkv is not None,
                          norm_and_add=norm is not None and residual is not None)
    texel = backend.caps.access_path == "texel"
    x_vec4 = texel and k % 4 == 0
    x_binding = (x, "f32x4" if x_vec4 else "f32", False)
    bindings = [(w, "f32x4" if w.dtype == "f32" else "u32x4", False), x_binding, (y, "f32", True)]
    side_view = LAYOUTS[w.dtype].side_view
    if side_view:  # the scales region, through its own view of the weight
        bindings.append((w, side_view, False))
    fuse = "rms" if norm is not None else "none"
    if residual is not None:
        fuse = "rms_add" if norm is not None else "add"
    eps = norm[1] if norm is not None else 0.0
    push_format = "<6If"
    push_values: tuple = (t, n, k, -(-k // 32), row_texels(w.dtype, k), quants_bytes(w.dtype, w.shape[0], k) // 4,
                          eps)
    # The fused operands' bindings are always declared; where one is unread x is bound there,
    # in x's own view (no texel view is made for it).
    if cfg.shader == "matmul_tiled":  # one operand: the norm weight or the residual
        operand = norm[0] if norm is not None else residual
        bindings.append((operand, "f32", False) if operand is not None else x_binding)
        bias = residual is not None and len(residual.shape) == 1
        _dispatch_tiled(backend, cfg, w.dtype, FUSE_CODES[fuse], bindings, (push_format, push_values),
                        gates, activation, scale, n, t, bias)
        return y
    bindings.append((norm[0], x_binding[1], False) if norm is not None else x_binding)  # read like x
    if qkv:  # the caches are bound as uint words (f32 caches written as their bits)
        bindings += [(qkv.positions, "i32", False), (qkv.cos_sin, "f32", False), (qkv.k_cache, "u32", True),
                     (qkv.v_cache, "u32", True), (qkv.slots, "i32", False)]
        max_positions, rot_dim = qkv.cos_sin.shape
        push_format += "6I"
        push_values += (qkv.num_heads, qkv.num_kv_heads, qkv.head_dim, rot_dim, max_positions, int(qkv.interleaved))
    else:
        bindings.append((residual, "f32", False) if residual is not None else x_binding)
    push = (push_format, push_values)
    spec = {0: cfg.workgroup, 1: cfg.rows, 3: cfg.tokens, 4: gates, 7: TILE_ROWS, 8: cfg.split}
    if not qkv and fuse != "none":  # the qkv variant's norm prologue is not a constant
        spec[6] = FUSE_CODES[fuse]
    if gated and activation == "gelu_tanh":
        spec[10] = 1
    if scale != 1.0:
        spec[11] = float_bits(scale)
    if residual is not None and len(residual.shape) == 1:
        spec[12] = 1  # a bias: one row for every token
    if qkv:
        spec[9] = int(qkv.k_cache.dtype == "f16")
    if texel:
        spec[2] = int(x_vec4)
    row_sets = -(-n // cfg.rows)  # invocations, or with split-K workgroups
    groups = _groups(row_sets * cfg.split if cfg.split > 1 else row_sets, cfg.workgroup, -(-t // cfg.tokens))
    backend.run_shader(module(backend, "matmul_vec", w.dtype, "qkv" if qkv else "plain"), bindings, groups, push,
                       spec)
    return y


# FUSE (spec constant 6) of both shaders: bits rms (the norm prologue) and add (the residual
# epilogue); matmul_tiled takes none, rms and add (its one fused operand).
FUSE_CODES = {"none": 0, "rms": 1, "add": 2, "rms_add": 3}


def _dispatch_tiled(backend: KernelBackend, cfg: MatmulConfig, dtype: str, fuse: int, bindings: list,
                    push: tuple[str, tuple], gates: int, activation: str, scale: float, n: int, t: int,
                    bias: bool = False) -> None:
    """Record matmul_tiled.comp: a workgroup per tile of cfg.rows rows x cfg.tokens tokens."""
    spec = {0: cfg.workgroup, 1: cfg.rows, 3: cfg.tokens, 4: gates, 5: cfg.lanes, 6: fuse, 7: TILE_ROWS,
            8: cfg.split, 12: cfg.lane_rows, 13: cfg.lane_tokens}
    if bias:
        spec[14] = 1  # FUSE_ADD's operand is a bias [N]: one row for every token
    if gates == 2 and activation == "gelu_tanh":
        spec[10] = 1
    if scale != 1.0:
        spec[11] = float_bits(scale)
    row_tiles = -(-n // cfg.rows)
    if row_tiles > MAX_GROUPS or -(-t // cfg.tokens) > MAX_GROUPS:
        raise ValueError(f"matmul: {row_tiles} x {-(-t // cfg.tokens)} tiles exceed the dispatch limit")
    backend.run_shader(module(backend, "matmul_tiled", dtype), bindings, (row_tiles, -(-t // cfg.tokens), 1),
                       push, spec)


Runner = Callable[[Any, tuple[Tensor, ...], dict[str, Any], tuple[TensorSpec, ...]], tuple[Tensor, ...]]


def _runner(op: str, tiled: bool) -> Runner:
    """The kernel body of `op` at the vec (decode) or tiled (prefill) sizes."""
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        if op == "rms_norm_matmul":
            x, g, w = inputs
            return (dispatch_matmul(backend, x, w, tiled, gated=params.get("gated", False),
                                    norm=(g, params["eps"]), activation=params.get("activation", "silu")),)
        if op == "rms_norm_matmul_add":
            x, g, w, residual = inputs
            return (dispatch_matmul(backend, x, w, tiled, norm=(g, params["eps"]), residual=residual),)
        if op == "matmul_add":
            x, w, residual = inputs
            return (dispatch_matmul(backend, x, w, tiled, residual=residual, scale=params.get("scale", 1.0)),)
        gated = op in GATED_OPS
        return (dispatch_matmul(backend, inputs[0], inputs[1], tiled, gated=gated,
                                activation=GATED_OPS.get(op, "silu"), scale=params.get("scale", 1.0)),)
    return run


def _operands(op: str, inputs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """(x, w) of a matmul-family op's inputs."""
    return (inputs[0], inputs[2]) if op in NORMED_OPS else (inputs[0], inputs[1])


def _supports(op: str, vec: bool) -> Callable[[tuple[Tensor, ...], dict[str, Any]], bool]:
    def check(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
        x, w = _operands(op, inputs)
        backend = backend_of(w)
        if vec and x.shape[0] > max_tokens(backend.caps):
            return False
        return supports((x, w), params)
    return check


OPS = ("matmul", "matmul_silu_and_mul", "matmul_gelu_tanh_and_mul", "rms_norm_matmul", "matmul_add",
       "rms_norm_matmul_add")
NORMED_OPS = ("rms_norm_matmul", "rms_norm_matmul_add")  # (x, g, w, ...): the norm weight before w
GATED_OPS = {"matmul_silu_and_mul": "silu", "matmul_gelu_tanh_and_mul": "gelu_tanh"}  # op -> activation
QKV_OP = "rms_norm_qkv_rope_kv_write"


def _qkv_shapes_fit(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    """EPILOGUE=qkv's row grouping (include/qkv_epilogue.glsl): whole 8-dim groups per head and,
    for NeoX rotation, a rotated part of whole 8-dim groups (4 dims from each half)."""
    head_dim = params["head_dim"]
    rot_dim = inputs[4].shape[1]
    return head_dim % 8 == 0 and (params.get("interleaved", False) or rot_dim % 8 == 0)


def _qkv_fused_supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    """Also f32 / f16 caches only: a q8_0 block's scale needs all 32 of its values, which the
    epilogue's 8-row groups spread over invocations (rms_norm_matmul then qkv_rope_kv_write)."""
    x, _, w = inputs[:3]
    return inputs[5].dtype in ("f32", "f16") and _qkv_shapes_fit(inputs, params) and supports((x, w), params)


def _run_qkv_fused(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                   out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    """One dispatch: EPILOGUE=qkv (an f32 or f16 cache, spec constant 9)."""
    x, g, w, positions, cos_sin, k_cache, v_cache, slots = inputs
    epilogue = QkvEpilogue(positions, cos_sin, k_cache, v_cache, slots, params["num_heads"],
                           params["num_kv_heads"], params["head_dim"], params.get("interleaved", False))
    return (dispatch_matmul(backend, x, w, tiled=x.shape[0] > max_tokens(backend.caps),
                            norm=(g, params["eps"]), qkv=epilogue),)


def register(backend: KernelBackend) -> None:
    # Higher priority first: vec for T <= max_tokens, tiled for the rest.
    for op in OPS:
        backend.register_kernel(Kernel(op, f"{op}.vec", _runner(op, tiled=False), priority=10,
                                       supports=_supports(op, vec=True)))
        backend.register_kernel(Kernel(op, f"{op}.tiled", _runner(op, tiled=True), priority=5,
                                       supports=_supports(op, vec=False)))
    backend.register_kernel(Kernel(QKV_OP, f"{QKV_OP}.fused", _run_qkv_fused, priority=10,
                                   supports=_qkv_fused_supports))
