"""The weight-format registry (vkrt/core/formats.py): each row agrees with the `gguf`
package (type id, block size and bytes), and each numpy decoder equals
`gguf.quants.dequantize` bit for bit on random blocks."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from vkrt.core.formats import (
    BLOCK_FORMATS,
    FORMATS,
    IQ4_LEVELS,
    by_gguf_type,
    mxfp4_from_hf,
    weight_format,
)
from vkrt.core.quant import dequantize
from vkrt.core.tensor import storage_nbytes


def random_blocks(rng: np.random.Generator, name: str, rows: int, blocks_per_row: int,
                  scale: float = 0.01) -> np.ndarray:
    """Rows of random blocks of `name`: every bit random except the f16 scale fields, which
    get finite values of either sign up to `scale` (random bits would be NaN or inf), and
    E8M0 exponents small powers of two."""
    fmt = FORMATS[name]
    blocks = rng.integers(0, 256, (rows, blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    for f in fmt.fields:
        if f.kind == "f16":
            start = fmt.field_offset(f.name)
            d = rng.uniform(-scale, scale, (rows, blocks_per_row)).astype(np.float16)
            blocks[..., start : start + 2] = d[..., None].view(np.uint8)
        elif f.kind == "e8m0":  # exponents giving scales 2^-14 .. 2^-7, the size of scale
            blocks[..., fmt.field_offset(f.name)] = rng.integers(114, 121, (rows, blocks_per_row), dtype=np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", list(FORMATS))
def test_row_matches_gguf(name: str) -> None:
    fmt = FORMATS[name]
    qtype = gguf.GGMLQuantizationType(fmt.gguf_type)
    assert qtype.name == name.upper()
    assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_values, fmt.block_bytes)
    assert by_gguf_type(fmt.gguf_type) is fmt
    if fmt.is_block:
        assert sum(f.nbytes for f in fmt.fields) == fmt.block_bytes
        assert fmt.define == f"WFMT_{name.upper()}"


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_decoder_is_bit_exact_with_gguf(rng: np.random.Generator, name: str) -> None:
    fmt = FORMATS[name]
    raw = random_blocks(rng, name, 7, 3)
    expected = gguf_dequantize(raw, gguf.GGMLQuantizationType(fmt.gguf_type))
    got = dequantize(raw, name)
    assert got.dtype == np.float32 and got.shape == (7, 3 * fmt.block_values)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), name
    assert storage_nbytes((7, 3 * fmt.block_values), name) == raw.nbytes


def test_mxfp4_every_exponent_and_code_is_gguf_s(rng: np.random.Generator) -> None:
    """All 256 E8M0 exponents (subnormal halves below 2, overflow to inf at the top) with all 16
    codes in both nibble halves: bit for bit the gguf package's dequantize."""
    blocks = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:9] = np.arange(16, dtype=np.uint8)[0::2] | (np.arange(16, dtype=np.uint8)[1::2] << 4)
    with np.errstate(over="ignore"):
        expected = gguf_dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
        got = dequantize(blocks, "mxfp4")
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]  # the OCP values at scale 2^0 (e = 127)
    assert got[127, :8].tolist() == e2m1[0::2] and got[127, 16:24].tolist() == e2m1[1::2]


def test_mxfp4_from_hf_keeps_every_value(rng: np.random.Generator) -> None:
    """gpt-oss's checkpoint halves (codes two a byte, element 2i low; exponents apart) repacked
    into llama.cpp's blocks decode to what the checkpoint's own rule gives: the OCP e2m1 value
    of each code times 2^(exponent - 127) (transformers' decoder, written out here)."""
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 2), dtype=np.uint8)
    rows = mxfp4_from_hf(blocks, scales)
    assert rows.shape == (3, 5, 2 * 17) and rows.dtype == np.uint8
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(3, 5, 2, 32)
    expected = np.ldexp(lut[codes], scales.astype(np.int32)[..., None] - 127).reshape(15, 64)
    assert np.array_equal(dequantize(rows.reshape(15, -1), "mxfp4"), expected)


def test_iq4_polynomial_gives_every_level() -> None:
    """shaders/include/quant.glsl computes IQ4_LEVELS as round(IQ4_POLY(q)) instead of
    indexing a table: exact for all 16 indices, whether a device fuses the multiply-adds
    (one rounding each) or not (two), with room to spare."""
    source = (Path(__file__).resolve().parents[2] / "shaders" / "include" / "quant.glsl").read_text()
    found = re.search(r"IQ4_POLY\[5\] = float\[5\]\(([^)]*)\)", source)
    assert found, "IQ4_POLY not found in quant.glsl"
    coeffs = np.array([float(c) for c in found.group(1).split(",")], np.float32)
    q = np.arange(16, dtype=np.float32)
    split, fused = np.full(16, coeffs[0], np.float32), np.full(16, coeffs[0], np.float32)
    for c in coeffs[1:]:
        split = (split * q).astype(np.float32) + c
        fused = (fused.astype(np.float64) * q + np.float64(c)).astype(np.float32)
    for p in (split, fused):
        assert np.array_equal(np.round(p), IQ4_LEVELS)
        assert np.abs(p - IQ4_LEVELS).max() < 0.45


def test_zero_scales_decode_to_zero(rng: np.random.Generator) -> None:
    """With every f16 field zero, each block format decodes to zeros whatever its bits (mxfp4's
    E8M0 scale has no zero: 2^-128 at least)."""
    for name in (n for n in BLOCK_FORMATS if n != "mxfp4"):
        raw = random_blocks(rng, name, 2, 2, scale=0.0)
        assert not dequantize(raw, name).any(), name


def test_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown weight format 'q7_0'"):
        weight_format("q7_0")
    assert by_gguf_type(9999) is None
