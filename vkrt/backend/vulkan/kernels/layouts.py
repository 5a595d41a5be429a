"""Device layouts of weights: how each storage format is laid out for the kernels.

Block formats are split into a quants region (one uvec4 texel per 16 bytes of quants) and
a scales region (one uint per block), so every load is aligned: GGUF's 18/20/34-byte blocks
are not. Float rows are padded with zeros to whole 32-value blocks (8 RGBA32F texels or 4
uvec4 texels of f16/bf16), so the matmul kernels read every row as complete blocks, like the
block formats, without bounds checks. Nothing is dequantized.
"""

from __future__ import annotations

import numpy as np

from vkrt.ops.tensor import BLOCK_LAYOUT


def _pad_cols(a: np.ndarray, multiple: int) -> np.ndarray:
    pad = -a.shape[1] % multiple
    return np.pad(a, ((0, 0), (0, pad))) if pad else a


def row_texels(dtype: str, k: int) -> int:
    """uvec4/vec4 texels per row of k values in the device layout."""
    if dtype == "f32":
        return -(-k // 32) * 8
    if dtype in ("f16", "bf16"):
        return -(-k // 32) * 4
    block_values = BLOCK_LAYOUT[dtype][1]
    return k // block_values * (2 if dtype == "q8_0" else 1)


def quants_bytes(dtype: str, rows: int, k: int) -> int:
    """Size of the quants region; the scales region starts right after it."""
    return rows * row_texels(dtype, k) * 16


def device_layout(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Storage-format rows [rows, ...] -> the flat uint8 device image."""
    rows = raw.shape[0]
    if dtype == "f32":
        return _pad_cols(raw.astype(np.float32), 32).view(np.uint8).reshape(-1)
    if dtype in ("f16", "bf16"):
        return _pad_cols(raw.view(np.uint16), 32).view(np.uint8).reshape(-1)
    block_bytes, _ = BLOCK_LAYOUT[dtype]
    blocks = raw.reshape(rows, -1, block_bytes)
    if dtype == "q8_0":
        quants, scales = blocks[..., 2:34], np.pad(blocks[..., 0:2], ((0, 0), (0, 0), (0, 2)))
    elif dtype == "q4_0":
        quants, scales = blocks[..., 2:18], np.pad(blocks[..., 0:2], ((0, 0), (0, 0), (0, 2)))
    elif dtype == "q4_1":
        quants, scales = blocks[..., 4:20], blocks[..., 0:4]  # d in the low half, m in the high
    else:
        # K-quants keep their GGUF blocks (144 / 210 bytes) padded to whole texels.
        padded = np.pad(blocks, ((0, 0), (0, 0), (0, -block_bytes % 16)))
        return np.ascontiguousarray(padded).reshape(-1)
    return np.concatenate([np.ascontiguousarray(quants).reshape(-1), np.ascontiguousarray(scales).reshape(-1)])
