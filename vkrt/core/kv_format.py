"""KV-cache storage formats and their numpy codecs: the spec the cache-writing and attention
kernels are tested against.

`--kv-cache-dtype` names the format: f32, f16 (one rounding per value) or q8_0, GGUF's Q8_0 as
llama.cpp's reference quantizer (quantize_row_q8_0_ref) writes it: per block of 32 values
along a cache row, d = max |x| / 127 in f32, q = round(x * (1 / d)) with halves away from zero
(0 when d = 0), and d stored as f16; a value reads back as q * d. Blocks never straddle an
attention head (q8_0 needs head_dim % 32 == 0) and pair up along the row (kv_dim % 64 == 0): a
pair is stored as its 64 int8 quants (16 u32 words, value j in byte j % 4 of word j / 4), then
one word holding the even block's f16 scale in its low half and the odd block's in its high
half, so every load a shader makes is a whole aligned word. The numpy array of a q8_0 cache is
those words, [blocks, block_size, kv_dim / 64 * 17] uint32 (vkrt.core.tensor.KV_Q8_0).
"""

from __future__ import annotations

import numpy as np

from vkrt.core.tensor import KV_Q8_0, KV_Q8_0_PAIR_VALUES, KV_Q8_0_PAIR_WORDS

KV_DTYPES = ("f16", "f32", "q8_0")  # --kv-cache-dtype choices, the default first
Q8_0_BLOCK = 32


def tensor_dtype(kv_dtype: str) -> str:
    """The tensor dtype of a cache of this --kv-cache-dtype."""
    return KV_Q8_0 if kv_dtype == "q8_0" else kv_dtype


def unsupported(kv_dtype: str, num_kv_heads: int, head_dim: int) -> str | None:
    """Why a model with these KV heads cannot use this cache format, or None if it can."""
    if kv_dtype != "q8_0":
        return None
    if head_dim % Q8_0_BLOCK:
        return f"q8_0 quantizes blocks of {Q8_0_BLOCK} values of a head, and head_dim is {head_dim}"
    if num_kv_heads * head_dim % KV_Q8_0_PAIR_VALUES:
        return (f"q8_0 stores blocks in pairs along a cache row, and num_kv_heads * head_dim is "
                f"{num_kv_heads * head_dim}, not a multiple of {KV_Q8_0_PAIR_VALUES}")
    return None


def bytes_per_value(kv_dtype: str) -> float:
    """Cache bytes per stored K or V value: 4, 2, or 34 / 32 for q8_0."""
    return {"f32": 4.0, "f16": 2.0, "q8_0": KV_Q8_0_PAIR_WORDS * 4 / KV_Q8_0_PAIR_VALUES}[kv_dtype]


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [..., n] (n % 32 == 0) -> (int8 quants [..., n / 32, 32], f16 scales [..., n / 32])."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inverse[..., None]  # f32 products, as the C reference
    # roundf: halves away from zero; exact in float64 for these f32 values (|scaled| <= 127).
    quants = np.trunc(scaled.astype(np.float64) + np.copysign(0.5, scaled))
    return quants.astype(np.int8), d.astype(np.float16)


def dequantize_q8_0(quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """quantize_q8_0's pair back to f32 rows [..., n]: q * d (exact in f32)."""
    values = quants.astype(np.float32) * scales.astype(np.float32)[..., None]
    return values.reshape(*values.shape[:-2], -1)


def encode(rows: np.ndarray, kv_dtype: str) -> np.ndarray:
    """f32 cache rows [..., kv_dim] -> the cache's numpy array in format `kv_dtype`."""
    if kv_dtype == "f32":
        return np.asarray(rows, np.float32)
    if kv_dtype == "f16":
        return np.asarray(rows, np.float32).astype(np.float16)
    quants, scales = quantize_q8_0(rows)
    pairs = quants.shape[-2] // 2
    words = np.empty((*rows.shape[:-1], pairs, KV_Q8_0_PAIR_WORDS), np.uint32)
    words[..., :16] = quants.reshape(*rows.shape[:-1], pairs, 64).view(np.uint32)
    words[..., 16] = scales.reshape(*rows.shape[:-1], pairs, 2).view(np.uint32)[..., 0]
    return words.reshape(*rows.shape[:-1], pairs * KV_Q8_0_PAIR_WORDS)


def decode(cache: np.ndarray) -> np.ndarray:
    """A cache's numpy array (any format) -> its rows as f32 [..., kv_dim]."""
    if cache.dtype != np.uint32:
        return cache.astype(np.float32)
    pairs = cache.reshape(*cache.shape[:-1], -1, KV_Q8_0_PAIR_WORDS)
    quants = np.ascontiguousarray(pairs[..., :16]).view(np.int8)  # [..., pairs, 64]
    scales = np.ascontiguousarray(pairs[..., 16:]).view(np.float16)  # [..., pairs, 2]
    return dequantize_q8_0(quants.reshape(*quants.shape[:-2], -1, Q8_0_BLOCK),
                           scales.reshape(*scales.shape[:-2], -1))


def read_rows(cache: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The f32 rows [len(slots), kv_dim] at cache slots (block * block_size + offset)."""
    return decode(cache.reshape(-1, cache.shape[-1])[slots])


def write_rows(cache: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """Store f32 rows [len(slots), kv_dim] at cache slots, encoded in the cache's format, in place."""
    flat = cache.reshape(-1, cache.shape[-1])
    kv_dtype = "q8_0" if cache.dtype == np.uint32 else "f16" if cache.dtype == np.float16 else "f32"
    flat[slots] = encode(rows, kv_dtype)
