"""The weights' device layout (vkrt/backend/vulkan/kernels/layouts.py): its size, the row-tile
addressing the kernels use, and what stays untiled. The kernels' parity tests
(tests/ops/test_matmul.py, test_embedding.py) read these images; these tests pin the
layout itself, so a change to it and to the shaders cannot drift apart silently."""

from __future__ import annotations

import numpy as np
import pytest

from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels.layouts import (
    LAYOUTS,
    TILE_ROWS,
    device_layout,
    device_nbytes,
    quants_bytes,
    row_texels,
)
from vkrt.core.quant import quantize
from vkrt.core.tensor import BLOCK_LAYOUT

FORMATS = tuple(LAYOUTS)


def _raw(rng: np.random.Generator, dtype: str, rows: int, k: int) -> np.ndarray:
    if dtype in BLOCK_LAYOUT:
        block_bytes, block_values = BLOCK_LAYOUT[dtype]
        return rng.integers(0, 256, (rows, k // block_values * block_bytes), dtype=np.uint8)
    if dtype == "bf16":
        return rng.integers(0, 1 << 16, (rows, k), dtype=np.uint16)
    return rng.standard_normal((rows, k)).astype(np.float16 if dtype == "f16" else np.float32)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 7, TILE_ROWS, TILE_ROWS + 1, 2 * TILE_ROWS + 3])
def test_size_is_whole_tiles(dtype: str, rows: int) -> None:
    k = 512 if dtype in BLOCK_LAYOUT and BLOCK_LAYOUT[dtype][1] == 256 else 96 if dtype in BLOCK_LAYOUT else 37
    image = device_layout(_raw(np.random.default_rng(rows), dtype, rows, k), dtype)
    tiles = -(-rows // TILE_ROWS)
    assert image.nbytes == device_nbytes(dtype, rows, k)
    assert device_nbytes(dtype, rows, k) == tiles * device_nbytes(dtype, TILE_ROWS, k)
    assert quants_bytes(dtype, rows, k) == tiles * TILE_ROWS * row_texels(dtype, k) * 16


def test_q4_1_addressing(rng: np.random.Generator) -> None:
    """(row n, block b): quants texel ((n // T) * blocks + b) * T + n % T, scales word the
    same index after the quants region; rows past the last are zero padding."""
    rows, k = 2 * TILE_ROWS + 5, 160
    blocks = k // 32
    raw = quantize(rng.standard_normal((rows, k)).astype(np.float32), "q4_1").reshape(rows, blocks, 20)
    image = device_layout(raw.reshape(rows, -1), "q4_1")
    texels = image[:quants_bytes("q4_1", rows, k)].reshape(-1, 16)
    scales = image[quants_bytes("q4_1", rows, k):].view(np.uint32)
    for n in (0, 1, TILE_ROWS - 1, TILE_ROWS, rows - 1):
        for b in (0, blocks - 1):
            i = ((n // TILE_ROWS) * blocks + b) * TILE_ROWS + n % TILE_ROWS
            assert texels[i].tobytes() == raw[n, b, 4:20].tobytes()
            assert scales[i] == raw[n, b, 0:4].view(np.uint32)[0]
    pad = ((rows // TILE_ROWS) * blocks + 1) * TILE_ROWS + rows % TILE_ROWS  # row `rows`, block 1
    assert not texels[pad].any() and scales[pad] == 0


def test_untiled_is_the_plain_row(rng: np.random.Generator) -> None:
    """1-D weights (norms, biases) keep plain order: other kernels read them flat."""
    g = rng.standard_normal((1, 100)).astype(np.float32)
    flat = device_layout(g, "f32", tiled=False).view(np.float32)
    assert np.array_equal(flat[:100], g[0]) and not flat[100:].any()


def test_backend_sizes_match_the_images(vk_default: Backend, rng: np.random.Generator) -> None:
    for dtype, shape in (("q4_1", (70, 64)), ("q8_0", (3, 32)), ("f32", (5, 37)), ("f32", (37,))):
        raw = _raw(rng, dtype, shape[0] if len(shape) == 2 else 1, shape[-1])
        raw = raw if len(shape) == 2 else raw.reshape(-1)
        w = vk_default.upload_weight(raw, dtype, shape)
        assert w.handle.size <= vk_default.weight_nbytes(dtype, shape)
        assert np.array_equal(w.numpy().view(np.uint8), raw.view(np.uint8)), "read() returns the storage bytes"
