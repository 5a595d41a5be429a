"""Device layouts of weights: how each storage format is laid out for the kernels.

Every format with a kernel has a `DeviceLayout` row in LAYOUTS (sizes per row unit);
formats without one are stored as their raw blocks and run on the reference tier.
Nothing is dequantized.

Block formats are split into a quants region (one uvec4 texel per 16 bytes of quants) and
a scales region, so every load is aligned: GGUF's 18/20/22/24/34-byte blocks are not. For
the 32-value block formats both derive from the registry row (vkrt/core/formats.py): the
`qs` field is the quants, the other fields, in order, the scales entry (f16 fields packed
two to a word, bit fields word-aligned: q8_0/q4_0/iq4_nl one word d, mxfp4 one word whose low
byte is the E8M0 exponent, q4_1 one word d|m,
q5_0 two words d, qh, q5_1 two words d|m, qh). Kernels bind an entry of one word as u32
and of two as u32x2. Float rows are padded with zeros to whole 32-value blocks (8 RGBA32F
texels or 4 uvec4 texels of f16/bf16), so the matmul kernels read every row as complete
blocks, like the block formats, without bounds checks.

Matrices are stored in row tiles of TILE_ROWS rows (the last padded with zero rows): within a
tile, unit u of every row comes before unit u + 1 of any, where a unit is the format's
32-value block (f32 8 texels, f16/bf16 4, q8_0 2, the 4-bit formats and q4_k/iq4_xs 1) or,
for q5_k and q6_k, their 256-value super-block (10 and 12 texels). The scales regions are
tiled the same way, with one entry per (row, block) for the 32-value formats and one per
(row, super-block) for the K-quants (shaders/include/tiles.glsl has the addressing). A
matmul workgroup owns consecutive rows, so for each block it reads one contiguous run of
memory instead of one texel per row, a row's length apart: on llvmpipe the CPU's
prefetchers follow a few long streams but not 64 short ones (cold-cache decode matmuls
~13% faster), and GPU lanes reading neighbouring rows get coalesced loads. 1-D weights
(norms, biases) are not tiled.

K-quants are repacked per 32-value sub-block, with the same nibble order as q4_0/q4_1
(byte j holds element j low, element j + 16 high), so one texel fetch gives a sub-block:
- q4_k (144 bytes / 256 values): quants 8 texels per super-block; scales region one texel
  per super-block = GGUF's 16-byte header (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins).
  Same size as GGUF.
- q5_k (176 bytes / 256 values): q4_k's 8 nibble texels then 2 texels of fifth bits (word
  s: bit i is element i of sub-block s) per super-block; the same header texel. Same size.
- q6_k (210 bytes / 256 values): per super-block 8 texels of low nibbles then 4 texels of
  the 2-bit highs (sub-block s: texel 8 + s/2, words 2(s%2)..+1; element 4i+c's bits at
  8c + 4(i%2), element 16+4i+c's two bits above them); scales region one texel of the 16
  int8 scales per super-block; then a d region of one u32 (f16 d) per super-block.
  212 bytes per super-block.
- iq4_xs (136 bytes / 256 values): GGUF's 16 bytes of level indices per sub-block are
  already in q4 order (one texel each); the scales region holds its first 8 bytes (f16 d,
  the 2-bit scale highs, the 4-bit scale lows) as one uvec2 per super-block. Same size.
The 2-bit planes of q2_k and q3_k are regrouped per 32-value sub-block into two "crumb"
words (word h: element 16h + 4i + c at bits 8c + 2i), so four shifts and one mask of a
word give four byte lanes of consecutive elements (quant.glsl's crumb_vals):
- q2_k (84 bytes / 256 values): quants 4 texels per super-block (sub-block s: texel s/2,
  words 2(s%2)..+1); scales region one texel of GGUF's 16 scale|min bytes per super-block,
  then a region of one u32 (f16 d | f16 dmin) per super-block. Same size.
- q3_k (110 bytes / 256 values): q2_k's 4 crumb texels then 2 texels of high bits (word s:
  element 16h + 4i + c's bit at 8c + 4h + i) per super-block; scales region one texel per
  super-block = GGUF's 12 bytes of 6-bit scales and its f16 d. 112 bytes per super-block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vkrt.core.formats import FORMATS, WeightFormat

TILE_ROWS = 64  # rows per tile; the kernels get it as specialisation constant 7 (TILE)


def padded_rows(rows: int) -> int:
    return -(-rows // TILE_ROWS) * TILE_ROWS


def _tiled(a: np.ndarray) -> np.ndarray:
    """[rows, units, unit_bytes] -> the flat tiled image [tiles, units, TILE_ROWS, unit_bytes]."""
    rows, units, size = a.shape
    a = np.pad(a, ((0, padded_rows(rows) - rows), (0, 0), (0, 0)))
    return np.ascontiguousarray(a.reshape(-1, TILE_ROWS, units, size).transpose(0, 2, 1, 3)).reshape(-1)


def _pad_cols(a: np.ndarray, multiple: int) -> np.ndarray:
    pad = -a.shape[1] % multiple
    return np.pad(a, ((0, 0), (0, pad))) if pad else a


@dataclass(frozen=True)
class DeviceLayout:
    """How one format's rows sit in device memory (sizes per row unit)."""

    unit_values: int  # values per tiled unit of the quants region
    unit_texels: int  # 16-byte texels per unit in the quants region
    side_values: int = 32  # values each scales entry covers
    side_bytes: int = 0  # bytes per scales entry, every region after the quants together
    side_view: str | None = None  # the view kind kernels bind the scales region with


def _side_fields(fmt: WeightFormat) -> list[tuple[str, int]]:
    """(field, byte offset in the scales entry) of a 32-value block format's non-quant fields."""
    out, offset = [], 0
    for f in fmt.fields:
        if f.name == "qs":
            continue
        offset = offset if f.kind == "f16" else -(-offset // 4) * 4
        out.append((f.name, offset))
        offset += f.nbytes
    return out


def _block_layout(fmt: WeightFormat) -> DeviceLayout:
    """The generic layout of a 32-value block format: `qs` as texels, the rest one entry."""
    qs = next(f.nbytes for f in fmt.fields if f.name == "qs")
    name, offset = _side_fields(fmt)[-1]
    entry = -(-(offset + next(f.nbytes for f in fmt.fields if f.name == name)) // 4) * 4
    return DeviceLayout(32, qs // 16, 32, entry, "u32" if entry == 4 else "u32x2")


# Formats with a device layout (every format a kernel reads natively). The K-quants are
# repacked by hand (the module docstring); formats not listed here are stored as their raw
# blocks and reach only the reference tier.
LAYOUTS: dict[str, DeviceLayout] = {
    "f32": DeviceLayout(32, 8),
    "f16": DeviceLayout(32, 4),
    "bf16": DeviceLayout(32, 4),
    **{name: _block_layout(FORMATS[name]) for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4")},
    "q4_k": DeviceLayout(32, 1, 256, 16),  # the header texel is read through the quants view
    "q5_k": DeviceLayout(256, 10, 256, 16),  # likewise
    "q6_k": DeviceLayout(256, 12, 256, 20, "u32"),
    "iq4_xs": DeviceLayout(32, 1, 256, 8, "u32x2"),
    "q2_k": DeviceLayout(256, 4, 256, 20, "u32"),  # the scales texel through the quants view, d|dmin words
    "q3_k": DeviceLayout(256, 6, 256, 16),  # the scales texel through the quants view
}


def row_texels(dtype: str, k: int) -> int:
    """uvec4/vec4 texels per row of k values in the device layout (quants region)."""
    layout = LAYOUTS[dtype]
    return -(-k // layout.unit_values) * layout.unit_texels


def quants_bytes(dtype: str, rows: int, k: int) -> int:
    """Size of a matrix's quants region (rows padded to whole tiles); the scales follow it."""
    return padded_rows(rows) * row_texels(dtype, k) * 16


def row_bytes(dtype: str, k: int) -> int:
    """Device bytes per matrix row, every region together."""
    layout = LAYOUTS[dtype]
    return row_texels(dtype, k) * 16 + k // layout.side_values * layout.side_bytes


def device_nbytes(dtype: str, rows: int, k: int) -> int:
    """Size of a [rows, k] matrix's device image."""
    if dtype not in LAYOUTS:
        return FORMATS[dtype].block_bytes * rows * k // FORMATS[dtype].block_values
    return padded_rows(rows) * row_bytes(dtype, k)


def device_layout(raw: np.ndarray, dtype: str, tiled: bool = True) -> np.ndarray:
    """Storage-format rows [rows, ...] -> the flat uint8 device image (row-tiled unless
    `tiled` is False: a 1-D weight, read as one plain row)."""
    parts = device_regions(raw, dtype, tiled)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


# Rows laid out at a time by write_device_image: 64 tiles, a few MiB of image for most formats.
CHUNK_ROWS = 64 * TILE_ROWS


def write_device_image(raw: np.ndarray, dtype: str, write: Callable[[int, np.ndarray], None],
                       tiled: bool = True) -> int:
    """Lay `raw` out as device_layout does, CHUNK_ROWS rows at a time, handing each piece of
    each region to `write(offset, bytes)`: the host never holds the whole image (laying out a
    262k-row embedding in one go held three copies of it). Returns the image's size.

    A region is tiled on its own, so the pieces of a chunk of whole tiles are consecutive runs
    of each region, at the chunk's first row times the region's bytes per row."""
    rows = raw.shape[0]
    if not tiled or rows <= CHUNK_ROWS or dtype not in LAYOUTS:
        image = device_layout(raw, dtype, tiled)
        write(0, image)
        return image.nbytes
    per_row: list[int] = []  # each region's device bytes per (padded) row
    starts: list[int] = []
    for first in range(0, rows, CHUNK_ROWS):
        pieces = device_regions(raw[first : first + CHUNK_ROWS], dtype, tiled)
        if not per_row:
            per_row = [piece.nbytes // CHUNK_ROWS for piece in pieces]
            starts = list(np.cumsum([0] + [n * padded_rows(rows) for n in per_row[:-1]]))
        for start, row_bytes, piece in zip(starts, per_row, pieces, strict=True):
            write(int(start) + first * row_bytes, piece)
    return sum(n * padded_rows(rows) for n in per_row)


def device_regions(raw: np.ndarray, dtype: str, tiled: bool = True) -> list[np.ndarray]:
    """device_layout's regions (the quants, then the scales region(s)), each flat uint8."""
    rows = raw.shape[0]

    def regions(*parts: np.ndarray) -> list[np.ndarray]:  # each [rows, units, unit_bytes]
        return [_tiled(p) if tiled else np.ascontiguousarray(p).reshape(-1) for p in parts]

    if dtype not in LAYOUTS:  # no kernel reads it: the storage bytes as they are
        return [np.ascontiguousarray(raw).view(np.uint8).reshape(-1)]
    if dtype == "f32":
        return regions(_pad_cols(raw.astype(np.float32), 32).view(np.uint8).reshape(rows, -1, 128))
    if dtype in ("f16", "bf16"):
        return regions(_pad_cols(raw.view(np.uint16), 32).view(np.uint8).reshape(rows, -1, 64))
    fmt = FORMATS[dtype]
    blocks = raw.reshape(rows, -1, fmt.block_bytes)
    if dtype == "q4_k":  # quants per 32-value sub-block; the 16-byte header per super-block
        return regions(_k_nibbles(blocks[..., 16:144]).reshape(rows, -1, 16), blocks[..., 0:16])
    if dtype == "q5_k":  # per super-block 8 nibble texels, then 8 words of fifth bits; the header
        fifth = _k_fifth_bits(blocks[..., 16:48]).view(np.uint8)
        return regions(np.concatenate([_k_nibbles(blocks[..., 48:176]).reshape(rows, -1, 128), fifth], -1),
                       blocks[..., 0:16])
    if dtype == "iq4_xs":  # 16 bytes of indices per sub-block (already q4 order); 8 bytes of scales
        return regions(blocks[..., 8:136].reshape(rows, -1, 16), blocks[..., 0:8])
    if dtype == "q2_k":  # 64 crumb bytes; the 16 scale|min bytes; f16 d | f16 dmin
        return regions(_crumb_words(_q2_k_planes(blocks[..., 16:80])), blocks[..., 0:16], blocks[..., 80:84])
    if dtype == "q3_k":  # 64 crumb bytes and 32 of high bits; the 12 scale bytes, f16 d (padded)
        high = _q3_k_high_words(np.unpackbits(blocks[..., 0:32][..., None, :], axis=-2, count=8, bitorder="little"))
        quants = np.concatenate([_crumb_words(_q2_k_planes(blocks[..., 32:96])), high.view(np.uint8)], -1)
        return regions(quants, np.pad(blocks[..., 96:110], ((0, 0), (0, 0), (0, 2))))
    if dtype == "q6_k":  # 192 quant bytes, the 16 int8 scales and the f16 d per super-block
        return regions(_q6_k_quants(blocks), blocks[..., 192:208], np.pad(blocks[..., 208:210], ((0, 0), (0, 0), (0, 2))))
    side = np.zeros(blocks.shape[:2] + (LAYOUTS[dtype].side_bytes,), np.uint8)
    for name, offset in _side_fields(fmt):
        part = fmt.field(blocks, name)
        side[..., offset : offset + part.shape[-1]] = part
    return regions(fmt.field(blocks, "qs"), side)


def _nibble_pairs(v: np.ndarray) -> np.ndarray:
    """[..., 32] 4-bit values per sub-block -> [..., 16] bytes: element j low, j + 16 high."""
    return (v[..., :16] | (v[..., 16:] << 4)).astype(np.uint8)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF q4_k / q5_k nibbles [rows, super-blocks, 128] (4 chunks of 32 bytes: sub-block
    2c low nibbles, 2c+1 high) -> [rows, super-blocks, 8 sub-blocks, 16 bytes]."""
    chunks = qs.reshape(qs.shape[:2] + (4, 32))
    sub = np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(qs.shape[:2] + (8, 32))
    return np.ascontiguousarray(_nibble_pairs(sub))


def _k_fifth_bits(qh: np.ndarray) -> np.ndarray:
    """GGUF q5_k's 32 bytes of fifth bits (bit s of byte i: element i of sub-block s) ->
    [rows, super-blocks, 8] u32 words, bit i of word s the fifth bit of element i."""
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., s, i]
    return np.packbits(bits, axis=-1, bitorder="little").view("<u4")[..., 0]


def _q2_k_planes(qs: np.ndarray) -> np.ndarray:
    """GGUF q2_k / q3_k 2-bit planes [rows, super-blocks, 64] -> [..., 8 sub-blocks, 32] values
    (each 128-value half reads 32 bytes at shifts 0, 2, 4, 6: vkrt.core.formats._crumbs)."""
    q = qs.reshape(qs.shape[:2] + (2, 1, 32)) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    return (q & 3).reshape(qs.shape[:2] + (8, 32))


def _lane_shifts(bits_per_step: int, half_shift: int) -> np.ndarray:
    """Bit position of element e = 16h + 4i + c of a sub-block: 8c + half_shift * h + bits_per_step * i."""
    e = np.arange(32)
    return (8 * (e & 3) + half_shift * (e >> 4) + bits_per_step * ((e >> 2) & 3)).astype(np.uint32)


def _crumb_words(v: np.ndarray) -> np.ndarray:
    """[..., 8, 32] 2-bit values -> [..., 64] bytes: per sub-block word h (0, 1) holds elements
    16h..16h+15, element 16h + 4i + c at bits 8c + 2i."""
    shifted = v.astype(np.uint32) << _lane_shifts(2, 0)
    words = np.stack([shifted[..., :16].sum(-1, dtype=np.uint32), shifted[..., 16:].sum(-1, dtype=np.uint32)], -1)
    return np.ascontiguousarray(words).view(np.uint8).reshape(v.shape[:2] + (64,))


def _q3_k_high_words(bits: np.ndarray) -> np.ndarray:
    """GGUF q3_k's high bits as [..., 8 bits j, 32 bytes i] (element 32j + i) -> [..., 8] u32
    words, one per sub-block j: element 16h + 4i + c's bit at 8c + 4h + i."""
    return (bits.astype(np.uint32) << _lane_shifts(1, 4)).sum(-1, dtype=np.uint32)


def _q6_k_quants(blocks: np.ndarray) -> np.ndarray:
    """GGUF q6_k ql/qh -> [rows, super-blocks, 192 bytes]: 8 texels of low nibbles, then 4
    texels of 2-bit highs (the order vkrt.core.formats decodes q6_k in)."""
    shape = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(shape + (2, 64))
    qh = blocks[..., 128:192].reshape(shape + (2, 32))
    q = np.empty(shape + (2, 4, 32), np.uint8)
    q[..., 0, :] = (ql[..., :32] & 0x0F) | (((qh >> 0) & 3) << 4)
    q[..., 1, :] = (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4)
    q[..., 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q[..., 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = q.reshape(shape + (8, 32))  # 6-bit values 0..63 per 32-value sub-block
    lo = _nibble_pairs(q & 0x0F)  # [..., 8, 16]
    hi = (q >> 4).astype(np.uint32)  # [..., 8, 32], 2 bits each
    j = np.arange(16)
    i, c = j >> 2, j & 3
    shift = (8 * c + 4 * (i & 1)).astype(np.uint32)
    word = i >> 1
    words = np.zeros(shape + (8, 2), np.uint32)
    for w in range(2):
        sel = word == w
        words[..., w] = ((hi[..., :16][..., sel] << shift[sel]) | (hi[..., 16:][..., sel] << (shift[sel] + 2))).sum(
            axis=-1, dtype=np.uint32)
    return np.concatenate([lo.reshape(shape + (128,)), words.view(np.uint8).reshape(shape + (64,))], axis=-1)
