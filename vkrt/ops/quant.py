"""GGUF block formats in numpy: the readable definition of each format's decoding.

Each function takes uint8 rows of blocks ``[rows, row_bytes]`` and returns float32
``[rows, row_bytes / block_bytes * block_values]``.
"""

from __future__ import annotations

import numpy as np

from vkrt.ops.tensor import BLOCK_LAYOUT


def _blocks(raw: np.ndarray, fmt: str) -> np.ndarray:
    block_bytes, _ = BLOCK_LAYOUT[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "q8_0")
    d = _f16(b, 0)
    q = b[..., 2:34].view(np.int8).astype(np.float32)
    return (d[..., None] * q).reshape(b.shape[0], -1)


def dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "q4_0")
    d = _f16(b, 0)
    q = _nibbles(b[..., 2:18]) - 8.0
    return (d[..., None] * q).reshape(b.shape[0], -1)


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "q4_1")
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[..., 4:20])
    return (d[..., None] * q + m[..., None]).reshape(b.shape[0], -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte, 6-bit scales and mins of Q4_K's 8 sub-blocks."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def dequant_q4_k(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "q4_k")
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144].reshape(b.shape[0], b.shape[1], 4, 32)
    # Each 32-byte chunk holds two sub-blocks: low nibbles then high nibbles.
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(b.shape[0], b.shape[1], 8, 32)
    out = d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * mn[..., None]
    return out.reshape(b.shape[0], -1).astype(np.float32)


def dequant_q6_k(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "q6_k")
    ql = b[..., 0:128].astype(np.int32).reshape(b.shape[0], b.shape[1], 2, 64)
    qh = b[..., 128:192].astype(np.int32).reshape(b.shape[0], b.shape[1], 2, 32)
    scales = b[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    # Per 128-value half: four 32-value groups, 4 low bits from ql, 2 high bits from qh.
    q = np.empty(ql.shape[:3] + (4, 32), np.int32)
    q[..., 0, :] = (ql[..., :32] & 0x0F) | (((qh >> 0) & 3) << 4)
    q[..., 1, :] = (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4)
    q[..., 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q[..., 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = (q - 32).reshape(b.shape[0], b.shape[1], 16, 16).astype(np.float32)
    out = d[..., None, None] * scales[..., None] * q
    return out.reshape(b.shape[0], -1).astype(np.float32)


DEQUANTIZERS = {
    "q8_0": dequant_q8_0,
    "q4_0": dequant_q4_0,
    "q4_1": dequant_q4_1,
    "q4_k": dequant_q4_k,
    "q6_k": dequant_q6_k,
}


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
    return DEQUANTIZERS[dtype](data)


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
