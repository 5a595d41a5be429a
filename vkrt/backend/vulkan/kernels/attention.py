"""kv_write, paged_attention: shaders/{kv_write,paged_attention,paged_attention_gqa}.comp.

Attention keeps q and the output accumulator in registers (head_dim / 4 vec4s, sized by
specialisation constant 1) and runs an online softmax over the context; both kernels fold and
merge with include/attention.glsl's functions, so a row gets the same bits from either.
- `paged_attention_gqa` (GQA models: a KV head's query heads fit a tile, `gqa_heads`, on a
  device with the subgroup split): one workgroup (a subgroup) per (token, query heads of one KV
  head), loading each key / value row once for all of them; in prefill-shaped steps a tile
  takes 2 consecutive tokens where `gqa_tokens` says so.
- `paged_attention` otherwise: one subgroup per (token, head) where the device has subgroup
  arithmetic (`paged_split`), else one invocation per (token, head).
Lanes split a row's positions round-robin and merge with subgroup max / add. Where
`paged_chunk` says so (GPUs), a row's context splits at absolute multiples of PAGED_CHUNK
positions (flash-decoding): decode-shaped steps give every chunk a workgroup and
paged_attention_merge.comp folds their partial states; prefill-shaped steps (enough work
already) walk a row's chunks in one workgroup and fold them in registers, in the same order
with the same weights (include/chunk_merge.glsl). A sliding window is a push constant (the
walk starts at the window's first position; Llama 4's chunk-aligned window is its width with
bit 31 set); a logit softcap is specialisation constant 2, and
attention sinks (`paged_attention_sinks`, gpt-oss) constant 6, folded into a row's state after its
last chunk (by the merge pass where chunks are split).
Either way the order depends only on per-device constants and the row's own positions, so a
token's result never depends on the rest of the batch.
"""

from __future__ import annotations

import struct
from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import KV_Q8_0, Tensor, TensorSpec
from vkrt.ops.attention import CHUNKED_WINDOW

# Invocations per workgroup for attention: llvmpipe's SIMD width (subgroup size 8), so a
# decode step of a few heads still spreads over more than one workgroup (and CPU thread).
ATTENTION_WORKGROUP = 8
# The widest head the register arrays are sized for: MLA's cached row (DeepSeek-V3: 64 rope + 512
# latent) and Gemma 4's full-attention heads (512). The arrays are specialisation-sized, so a
# model pays for its own width only; a pipeline that wide takes llvmpipe about a minute to compile
# (once per process; Mesa's shader cache keeps it).
MAX_HEAD_DIM = 576


NVIDIA = 0x10DE
# The widest subgroup a CPU device's compute shader really has. llvmpipe reports
# subgroupSize = vector width / 32 (32 at LP_NATIVE_VECTOR_WIDTH=1024) but compiles compute
# shaders min(vector width / 32, 16) lanes wide, so a 32-invocation workgroup there is two
# 16-lane subgroups (gl_NumSubgroups 2, subgroupAdd(1.0) = 16) and a subgroup merge over 32
# lanes silently drops half of them.
CPU_MAX_LANES = 16
# Flash-decoding: where paged_chunk says so, a block table wider than PAGED_CHUNK positions
# splits each (token, head) over chunks of this many positions (a fixed size, so a token's
# chunks and their merge order never depend on the batch) and paged_attention_merge folds
# them. A token whose positions fit one chunk gets the same bits either way. Scratch for the
# partial states is taken PAGED_SCRATCH_BYTES at most at a time (token slabs), so a long
# prefill stays bounded.
PAGED_CHUNK = 256
PAGED_SCRATCH_BYTES = 16 << 20


def paged_chunk(caps: DeviceCaps) -> int:
    """Positions per chunk of a row's context, 0 where the context is one chunk.

    GPUs split: a decode step's few workgroups would leave most compute units idle. CPU
    devices do not: llvmpipe's threads (one per core) are already busy with the decode
    step's workgroups, and the split's extra workgroups and merge dispatch cost more than
    they balance there (docs/BENCHMARKS.md).
    """
    return 0 if caps.device_type == "cpu" else PAGED_CHUNK


def paged_split(caps: DeviceCaps) -> tuple[str, int]:
    """paged_attention's variant and workgroup size on this device.

    ("sub", subgroup size) where compute shaders have subgroup arithmetic and a workgroup of
    `subgroup_size` invocations is sure to be one subgroup: CPU devices (llvmpipe: 8 lanes,
    its SIMD width; a decode step's heads become many small tasks for the CPU threads; at
    most CPU_MAX_LANES) and NVIDIA (always 32). Drivers that pick a subgroup size per shader
    (Intel, AMD wave32/64) could split such a workgroup, so they get ("seq", 8): one
    invocation per (token, head).
    """
    fixed = caps.device_type == "cpu" or caps.vendor_id == NVIDIA
    size = min(caps.subgroup_size, CPU_MAX_LANES) if caps.device_type == "cpu" else caps.subgroup_size
    if fixed and "arithmetic" in caps.subgroup_ops and 4 <= size <= 128 and size & (size - 1) == 0:
        return "sub", size
    return "seq", ATTENTION_WORKGROUP


# Per cache tensor dtype: its shader variant (KV=...) and the kind its words bind as (a texel of
# the attention kernels is 4 values: 4 f32, 2 words of 4 halves, or 1 word of q8_0 quants).
KV_VARIANT = {"f32": "f32", "f16": "f16", KV_Q8_0: "q8_0"}
KV_READ_KIND = {"f32": "f32x4", "f16": "u32x2", KV_Q8_0: "u32"}


def float_bits(value: float) -> int:
    """A float specialisation constant as the int32 its bits spell (pipelines take int32 data)."""
    return int(struct.unpack("<i", struct.pack("<f", value))[0])


def paged_kv_variant(kv_dtype: str, head_dim: int) -> tuple[str, str]:
    """paged_attention's cache variant and the kind its cache binds as: an f16 cache whose
    head_dim is a multiple of 8 is read 8 halves per texel (KV=f16x8: half the loads of 4 per
    texel, the same values, so the same bits), as the GQA kernel always reads it."""
    if kv_dtype == "f16" and head_dim % 8 == 0:
        return "f16x8", "u32x4"
    return KV_VARIANT[kv_dtype], KV_READ_KIND[kv_dtype]


def _kv_write(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
              out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    k_cache, v_cache, k, v, slots = inputs
    tokens, kv_dim = k.shape
    # f16: words a row can touch; q8_0: its 32-value blocks
    row_items = {"f32": kv_dim, "f16": kv_dim // 2 + 1, KV_Q8_0: kv_dim // 32}[k_cache.dtype]
    kind = "f32" if k_cache.dtype == "f32" else "u32"
    backend.run_shader(module(backend, "kv_write", KV_VARIANT[k_cache.dtype]),
                       [(k_cache, kind, True), (v_cache, kind, True), (k, "f32", False),
                        (v, "f32", False), (slots, "i32", False)],
                       grid_1d(tokens * row_items), ("<III", (tokens, kv_dim, row_items)), local_size())
    return ()


def _supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    """q (input 0) rows split into heads of whole vec4s; the register arrays cap head_dim."""
    head_dim = inputs[0].shape[1] // params["num_heads"]
    return head_dim % 4 == 0 and 0 < head_dim <= MAX_HEAD_DIM


# A step with fewer than SPLIT_TOKENS tokens per sequence (block-table row) is decode-shaped:
# where rows have several chunks, each chunk gets a workgroup. Others walk a row's chunks in one.
SPLIT_TOKENS = 4
# Query heads per GQA tile: as many of a KV head's as hold GQA_ROW_FLOATS floats of query (the
# most of the group that divides it; fewer than 2 heads share nothing, so such models keep the
# paged kernel). Measured on llvmpipe (SmolLM2's 3 heads x 64 per KV head, 1024-token prompt):
# 3 rows ran 2.2x faster than the paged kernel. Gemma-3-270M's heads of 256 in tiles of 2
# decode no faster than the paged kernel and prefill ~13% faster, but take ~3x its JIT
# (docs/BENCHMARKS.md).
GQA_ROW_FLOATS = 256
# A prefill-shaped step's tile takes 2 consecutive tokens where their rows hold at most this
# many floats of query: SmolLM2's 2 tokens x 3 heads x 64, whose 2048-token prompt's attention
# runs ~15% faster than in tiles of 1 token on llvmpipe; 3 or 4 tokens (9, 12 rows) ran slower
# than 2 (docs/BENCHMARKS.md), and larger heads are unmeasured.
GQA_TILE_FLOATS = 384


def gqa_lanes(caps: DeviceCaps) -> int | None:
    """The GQA kernel's lanes on this device, or None where every step keeps the paged kernel:
    it splits each row's positions as the paged kernel's subgroup split does, so it runs only
    where that split does, with its lane count."""
    split, lanes = paged_split(caps)
    return lanes if split == "sub" else None


def gqa_heads(group: int, head_dim: int) -> int:
    """Query heads per tile: the largest divisor of the GQA group within GQA_ROW_FLOATS; 1 (the
    paged kernel) where head_dim is not a multiple of 8, since the GQA kernel reads an f16
    cache 8 halves per texel (one rule for every cache format, so the format never picks the
    kernel)."""
    if head_dim % 8:
        return 1
    return max(h for h in range(1, group + 1) if group % h == 0 and h * head_dim <= max(GQA_ROW_FLOATS, head_dim))


def gqa_tokens(heads: int, head_dim: int, window: int) -> int:
    """Tokens per GQA tile in a prefill-shaped step: 2 where their rows fit GQA_TILE_FLOATS and
    no sliding window moves each token's first position (neighbours would walk apart), else 1."""
    return 2 if 2 * heads * head_dim <= GQA_TILE_FLOATS and not window else 1


def _paged_attention(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                     out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    """paged_attention, or paged_attention_sinks (a 7th input, the sinks: spec constant SINKS; without
    them q is bound in the sinks' unread place)."""
    q, k_cache, v_cache, block_table, seq_index, positions, *with_sinks = inputs
    sinks = with_sinks[0] if with_sinks else q
    window = params.get("window", 0) | (CHUNKED_WINDOW if params.get("chunked") else 0)  # the push constant
    num_heads, num_kv_heads = params["num_heads"], params["num_kv_heads"]
    tokens, head_dim = q.shape[0], q.shape[1] // num_heads
    group, hd4 = num_heads // num_kv_heads, head_dim // 4
    _, block_size, kv_dim = k_cache.shape
    kind = KV_READ_KIND[k_cache.dtype]
    chunk = paged_chunk(backend.caps)
    chunks = -(-block_table.shape[1] * block_size // chunk) if chunk else 1
    prefill = tokens >= SPLIT_TOKENS * block_table.shape[0]  # else decode-shaped
    split = chunks > 1 and not prefill
    lanes = gqa_lanes(backend.caps)
    heads = gqa_heads(group, head_dim) if lanes is not None else 1
    step_chunks = chunks if split else 1  # chunks per row in the grid: 1 walks them all
    if heads > 1:  # a workgroup per (tokens, query heads of one KV head[, chunk])
        assert lanes is not None  # gqa_heads > 1 only where the GQA kernel runs
        shader = module(backend, "paged_attention_gqa", KV_VARIANT[k_cache.dtype])
        tile_tokens = gqa_tokens(heads, head_dim, window) if prefill else 1  # never split
        items, per_group, spec = num_heads // heads, 1, {0: lanes, 4: heads, 5: tile_tokens}
        if k_cache.dtype == "f16":
            kind = "u32x4"  # 8 halves per texel
    else:  # a workgroup (sub) or invocation (seq) per (token, head[, chunk])
        variant, lanes = paged_split(backend.caps)
        kv_variant, kind = paged_kv_variant(k_cache.dtype, head_dim)
        shader = module(backend, "paged_attention", kv_variant, variant)
        items, per_group, spec = num_heads, 1 if variant == "sub" else lanes, {0: lanes}
        tile_tokens = 1
    spec |= {1: hd4, 2: float_bits(params.get("softcap", 0.0)), 3: chunk if chunks > 1 else 0, 6: int(bool(with_sinks))}
    y = backend.empty(out[0].shape, "f32")
    slab = max(1, PAGED_SCRATCH_BYTES // (num_heads * chunks * (hd4 + 1) * 16)) if split else tokens
    for token0 in range(0, tokens, slab):
        count = min(slab, tokens - token0)
        partials = backend.empty((count * num_heads * chunks, 4 * (hd4 + 1)), "f32") if split else y
        backend.run_shader(shader,
                           [(q, "f32x4", False), (k_cache, kind, False), (v_cache, kind, False),
                            (block_table, "i32", False), (seq_index, "i32", False), (positions, "i32", False),
                            (partials, "f32x4", True), (sinks, "f32", False)],
                           grid_1d(-(-count // tile_tokens) * items * step_chunks, per_group),
                           ("<IIIIIIfIII", (count, num_heads, group, kv_dim // 4, block_size,
                                            block_table.shape[1], params["scale"], window,
                                            step_chunks, token0)),
                           spec)
        if split:
            backend.run_shader(module(backend, "paged_attention_merge"),
                               [(partials, "f32x4", False), (seq_index, "i32", False), (positions, "i32", False),
                                (y, "f32x4", True), (sinks, "f32", False)],
                               grid_1d(count * num_heads * hd4),
                               ("<IIIIIIII", (count, num_heads, hd4, chunks, token0, chunk,
                                              block_table.shape[1] * block_size, window)),
                               local_size() | {1: int(bool(with_sinks))})
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("kv_write", "kv_write", _kv_write))
    backend.register_kernel(Kernel("paged_attention", "paged_attention", _paged_attention,
                                   supports=_supports))
    backend.register_kernel(Kernel("paged_attention_sinks", "paged_attention", _paged_attention,
                                   supports=_supports))
