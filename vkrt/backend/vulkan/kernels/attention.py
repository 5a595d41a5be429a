"""kv_write, paged_attention: shaders/{kv_write,paged_attention}.comp.

Attention keeps q and the output accumulator in registers (head_dim / 4 vec4s, sized by
specialisation constant 1) and runs an online softmax over the context.
`paged_attention` (every model step) is one
subgroup per (token, head) whose lanes split the positions round-robin and merge with
subgroup max / add where the device has subgroup arithmetic (`paged_split`), else that same
one-invocation walk; where `paged_chunk` allows (GPUs), a block table wider than PAGED_CHUNK
positions also splits the context into fixed chunks whose partial states
paged_attention_merge.comp folds (flash-decoding).
A sliding window is a push constant (the walk starts at the window's first position); a
logit softcap is specialisation constant 2, so layers without one run
the same code as before. Either way the order depends only on per-device constants, so a
token's result never depends on the rest of the batch.
Prefill-shaped steps run shaders/paged_prefill.comp instead: a workgroup owns a tile of query
rows sharing one KV head and loads each key / value row once for all of them (PREFILL_*).
"""

from __future__ import annotations

import struct
from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import grid_1d, local_size, module
from vkrt.ops.tensor import KV_Q8_0, Tensor, TensorSpec

# Invocations per workgroup for attention: llvmpipe's SIMD width (subgroup size 8), so a
# decode step of a few heads still spreads over more than one workgroup (and CPU thread).
ATTENTION_WORKGROUP = 8
MAX_HEAD_DIM = 256


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


def paged_chunk(caps: Any) -> int:
    """Positions per chunk where paged_attention splits the context, 0 where it never does.

    GPUs split: a decode step's few (token, head) workgroups would leave most compute units
    idle. CPU devices do not: llvmpipe's threads (one per core) are already all busy with
    the (token, head) workgroups, and the split's extra workgroups, partial-state stores and
    merge dispatch measured slower there (docs/BENCHMARKS.md).
    """
    return 0 if caps.device_type == "cpu" else PAGED_CHUNK


def paged_split(caps: Any) -> tuple[str, int]:
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


def _kv_write(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
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


def _paged_attention(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
                     out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    q, k_cache, v_cache, block_table, seq_index, positions = inputs
    num_heads, num_kv_heads = params["num_heads"], params["num_kv_heads"]
    tokens = q.shape[0]
    prefill_lanes = prefill_split(backend.caps)
    if (prefill_lanes is not None and tokens >= PREFILL_MIN_TOKENS * block_table.shape[0]
            and prefill_heads(num_heads // num_kv_heads, q.shape[1] // num_heads) > 1):
        return _paged_prefill(backend, inputs, params, out, prefill_lanes)
    head_dim = q.shape[1] // num_heads
    _, block_size, kv_dim = k_cache.shape
    kind = KV_READ_KIND[k_cache.dtype]
    y = backend.empty(out[0].shape, "f32")
    split, lanes = paged_split(backend.caps)
    chunk = paged_chunk(backend.caps)
    chunks = -(-block_table.shape[1] * block_size // chunk) if chunk else 1
    hd4 = head_dim // 4
    slab = tokens if chunks == 1 else max(1, PAGED_SCRATCH_BYTES // (num_heads * chunks * (hd4 + 1) * 16))
    for token0 in range(0, tokens, slab):
        count = min(slab, tokens - token0)
        partials = y if chunks == 1 else backend.empty((count * num_heads * chunks, 4 * (hd4 + 1)), "f32")
        backend.run_shader(module(backend, "paged_attention", KV_VARIANT[k_cache.dtype], split),
                           [(q, "f32x4", False), (k_cache, kind, False), (v_cache, kind, False),
                            (block_table, "i32", False), (seq_index, "i32", False), (positions, "i32", False),
                            (partials, "f32x4", True)],
                           grid_1d(count * num_heads * chunks, 1 if split == "sub" else lanes),
                           ("<IIIIIIfIII", (count, num_heads, num_heads // num_kv_heads, kv_dim // 4, block_size,
                                            block_table.shape[1], params["scale"], params.get("window", 0),
                                            chunks, token0)),
                           {0: lanes, 1: hd4, 2: float_bits(params.get("softcap", 0.0)),
                            3: chunk if chunks > 1 else 0})
        if chunks > 1:
            backend.run_shader(module(backend, "paged_attention_merge"),
                               [(partials, "f32x4", False), (seq_index, "i32", False), (y, "f32x4", True)],
                               grid_1d(count * num_heads * hd4),
                               ("<IIIII", (count, num_heads, hd4, chunks, token0)), local_size())
    return (y,)


# Tiled prefill (shaders/paged_prefill.comp): a step with at least PREFILL_MIN_TOKENS query
# tokens per sequence (block-table row) runs it. A tile is PREFILL_TILE tokens x the query heads
# of one KV head, as many as hold PREFILL_ROW_FLOATS floats of query (the most of the GQA group
# that divides it; fewer than 2 heads share nothing, so such models keep the paged kernel).
# Measured on llvmpipe (SmolLM2's 3 heads x 64 per KV head, 1024-token prompt): 3 rows ran 2.2x
# faster than the paged kernel; 6 rows (2 tokens) spilled their state, 7x slower, 150 s of JIT.
PREFILL_MIN_TOKENS = 4
PREFILL_TILE = 1
PREFILL_ROW_FLOATS = 256


def prefill_split(caps: Any) -> int | None:
    """The tiled prefill kernel's lanes on this device, or None where every step keeps the paged
    kernel: it splits each row's positions as the paged kernel's subgroup split does, so it runs
    only where that split does, with its lane count."""
    split, lanes = paged_split(caps)
    return lanes if split == "sub" else None


def prefill_heads(group: int, head_dim: int) -> int:
    """Query heads per tile: the largest divisor of the GQA group within PREFILL_ROW_FLOATS."""
    return max(h for h in range(1, group + 1) if group % h == 0 and h * head_dim <= max(PREFILL_ROW_FLOATS, head_dim))


def _paged_prefill(backend: Any, inputs: tuple[Tensor, ...], params: dict[str, Any],
                   out: tuple[TensorSpec, ...], lanes: int) -> tuple[Tensor, ...]:
    q, k_cache, v_cache, block_table, seq_index, positions = inputs
    num_heads, num_kv_heads = params["num_heads"], params["num_kv_heads"]
    tokens, head_dim = q.shape[0], q.shape[1] // num_heads
    heads = prefill_heads(num_heads // num_kv_heads, head_dim)
    _, block_size, kv_dim = k_cache.shape
    kind = KV_READ_KIND[k_cache.dtype]
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "paged_prefill", KV_VARIANT[k_cache.dtype]),
                       [(q, "f32x4", False), (k_cache, kind, False), (v_cache, kind, False),
                        (block_table, "i32", False), (seq_index, "i32", False), (positions, "i32", False),
                        (y, "f32x4", True)],
                       grid_1d(-(-tokens // PREFILL_TILE) * (num_heads // heads), 1),
                       ("<IIIIIIfI", (tokens, num_heads, num_heads // num_kv_heads, kv_dim // 4, block_size,
                                      block_table.shape[1], params["scale"], params.get("window", 0))),
                       {0: lanes, 1: head_dim // 4, 2: float_bits(params.get("softcap", 0.0)), 3: PREFILL_TILE,
                        4: heads})
    return (y,)


def register(backend: Any) -> None:
    backend.register_kernel(Kernel("kv_write", "kv_write", _kv_write))
    backend.register_kernel(Kernel("paged_attention", "paged_attention", _paged_attention,
                                   supports=_supports))
