"""Weight-format conversions: dequantize any storage format (the decoders are the rows of
vkrt/core/formats.py), the bf16 codecs, and simple quantizers for tests and tools."""

from __future__ import annotations

import numpy as np

from vkrt.core.formats import decode_rows


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaN kept quiet: the codec the shaders implement."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def dequantize(data: np.ndarray, dtype: str) -> np.ndarray:
    """Any weight storage format -> float32 with the logical shape."""
    if dtype == "f32":
        return np.asarray(data, dtype=np.float32)
    if dtype == "f16":
        return np.asarray(data, dtype=np.float16).astype(np.float32)
    if dtype == "bf16":
        return bf16_to_f32(data)
    return decode_rows(data, dtype)


def quantize(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows -> block bytes (tests and tools only; simple round-to-nearest)."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    rows = x.shape[0]
    if dtype == "q8_0":
        blk = x.reshape(rows, -1, 32)
        amax = np.abs(blk).max(axis=-1)
        d = (amax / 127.0).astype(np.float16)
        inv = np.where(d.astype(np.float32) > 0, 1.0 / np.maximum(d.astype(np.float32), 1e-30), 0)
        q = np.clip(np.rint(blk * inv[..., None]), -127, 127).astype(np.int8)
        out = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    elif dtype in ("q4_0", "q4_1"):
        blk = x.reshape(rows, -1, 32)
        if dtype == "q4_0":
            idx = np.abs(blk).argmax(axis=-1)
            vmax = np.take_along_axis(blk, idx[..., None], -1)[..., 0]
            d = (vmax / -8.0).astype(np.float16)
            df = d.astype(np.float32)
            inv = np.where(df != 0, 1.0 / np.where(df != 0, df, 1), 0)
            q = np.clip(np.floor(blk * inv[..., None] + 8.5), 0, 15).astype(np.uint8)
            head = d[..., None].view(np.uint8)
        else:
            lo, hi = blk.min(axis=-1), blk.max(axis=-1)
            d = ((hi - lo) / 15.0).astype(np.float16)
            m = lo.astype(np.float16)
            df = d.astype(np.float32)
            inv = np.where(df != 0, 1.0 / np.where(df != 0, df, 1), 0)
            q = np.clip(np.rint((blk - m.astype(np.float32)[..., None]) * inv[..., None]), 0, 15)
            q = q.astype(np.uint8)
            head = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8)], -1)
        packed = q[..., :16] | (q[..., 16:] << 4)
        out = np.concatenate([head, packed], axis=-1)
    else:
        raise ValueError(f"quantize does not support {dtype}")
    return out.reshape(rows, -1)
