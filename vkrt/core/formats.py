"""The weight-format registry: every storage format a weight may have, declared once.

A row says what a format is: its name, its GGUF type id, how many values a block holds
and in how many bytes, the byte fields of a block, and its numpy decoding (the readable
spec the shaders are tested against; each equals the `gguf` package's dequantize bit for
bit). Everything else derives from the rows: storage sizes (`vkrt.core.tensor`), the
formats the loaders accept, the shader define (`WFMT_<NAME>`), and the Vulkan device
layouts (`vkrt/backend/vulkan/kernels/layouts.py`, which repacks blocks from `fields`).

Adding a format: one row here with its decoder, its decode function in
shaders/include/quant.glsl, and its name in the `//! variants:` lines of the kernels that
read it.

Decoders take uint8 blocks ``[n, block_bytes]`` and return float32 ``[n, block_values]``,
computing in the order and precision ggml's reference does (f16 scales widened to f32,
products in f32), so the results are bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Decoder = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Field:
    """A run of bytes in a block: `f16` scales (`d`, `dmin`, `m`) or packed bits."""

    name: str
    nbytes: int
    kind: str = "bits"  # "f16" | "e8m0" (a power-of-two exponent byte) | "bits"


@dataclass(frozen=True)
class WeightFormat:
    """One storage format. Float formats have blocks of one value and no decoder."""

    name: str
    gguf_type: int  # GGMLQuantizationType value
    block_values: int
    block_bytes: int
    fields: tuple[Field, ...] = ()  # block formats: the block's bytes in order
    decode: Decoder | None = None  # block formats: [n, block_bytes] uint8 -> [n, block_values] f32

    @property
    def is_block(self) -> bool:
        return self.decode is not None

    @property
    def define(self) -> str:
        """The preprocessor define shaders select this format's decoding with."""
        return f"WFMT_{self.name.upper()}"

    def field_offset(self, name: str) -> int:
        """Byte offset of field `name` in a block."""
        offset = 0
        for f in self.fields:
            if f.name == name:
                return offset
            offset += f.nbytes
        raise KeyError(f"{self.name} has no field {name!r}")

    def field(self, blocks: np.ndarray, name: str) -> np.ndarray:
        """The bytes of field `name` of each block ([..., block_bytes] -> [..., nbytes])."""
        start = self.field_offset(name)
        return blocks[..., start : start + next(f.nbytes for f in self.fields if f.name == name)]


# ---- decoding helpers ---------------------------------------------------------------------

def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] f16 widened to f32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(raw: np.ndarray, count: int) -> np.ndarray:
    """[..., count / 8] bytes -> [..., count] bits, bit i of the little-endian run."""
    return np.unpackbits(raw, axis=-1, count=count, bitorder="little")


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks -> two [..., 8] f32.
    Sub-blocks 0..3 have their 6 bits in bytes 0..3 (scales) and 4..7 (mins); 4..7 take
    their low 4 bits from bytes 8..11 and their top 2 from the top of bytes 0..3 / 4..7."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """K-quants' 2-bit planes: [..., 64] bytes -> [..., 256]. Each 128-value half reads 32
    bytes four times, at shifts 0, 2, 4, 6: element 128h + 32j + i is bits 2j of byte 32h + i."""
    q = qs.reshape(qs.shape[:-1] + (2, 1, 32)) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    return (q & 3).reshape(qs.shape[:-1] + (256,))


# IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit index selects (ggml's kvalues_iq4nl).
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


# MXFP4: the e2m1 values a 4-bit code selects, doubled (bit 3 the sign), as ggml tabulates them;
# the block's E8M0 byte e scales them by 2^(e - 128), which halves them back.
MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) in f32, exactly (subnormal for e < 22): half of the E8M0 scale 2^(e - 127)."""
    return np.ldexp(np.float32(1.0), e.astype(np.int32) - 128).astype(np.float32)


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face's MXFP4 halves (gpt-oss checkpoints: `*_blocks` uint8 [..., G, 16], two codes
    a byte with element 2i low and 2i + 1 high; `*_scales` uint8 [..., G], the E8M0 exponents) as
    llama.cpp's MXFP4 rows: uint8 [..., G * 17], each block its exponent and then its 16 bytes in
    q4_0's nibble order (element i low, i + 16 high). The codes and exponents are the same bits."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(blocks.shape[:-1] + (32,))
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(scales.shape[:-1] + (-1,))


# ---- decoders -------------------------------------------------------------------------------

def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, 0:2])[:, None] * b[:, 2:34].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, 0:2])[:, None] * (_nibbles(b[:, 2:18]).astype(np.float32) - 8.0)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, 0:2])[:, None] * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b[:, 2:4])[:, None]


def _q5_0(b: np.ndarray) -> np.ndarray:
    """f16 d, 32 high bits (bit i: element i), 16 bytes of low nibbles: d * (q - 16)."""
    q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
    return _f16(b[:, 0:2])[:, None] * (q.astype(np.float32) - 16.0)


def _q5_1(b: np.ndarray) -> np.ndarray:
    """f16 d, f16 m, 32 high bits, 16 bytes of low nibbles: d * q + m."""
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, 0:2])[:, None] * q.astype(np.float32) + _f16(b[:, 2:4])[:, None]


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    """f16 d and 16 bytes of 4-bit indices into IQ4_LEVELS (q4_0's nibble order)."""
    return _f16(b[:, 0:2])[:, None] * IQ4_LEVELS[_nibbles(b[:, 2:18])]


def _mxfp4(b: np.ndarray) -> np.ndarray:
    """An E8M0 byte and 16 bytes of 4-bit e2m1 codes (q4_0's nibble order), llama.cpp's MXFP4."""
    return e8m0_half(b[:, 0])[:, None] * MXFP4_LEVELS[_nibbles(b[:, 1:17])]


def _q2_k(b: np.ndarray) -> np.ndarray:
    """16 bytes of 4-bit (scale, min) per 16 values, 64 bytes of 2-bit quants, f16 d, dmin:
    (d * sc) * q - dmin * m."""
    n = b.shape[0]
    sc = (b[:, 0:16] & 0x0F).astype(np.float32)
    mn = (b[:, 0:16] >> 4).astype(np.float32)
    d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
    q = _crumbs(b[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(n, 256)


def _q3_k(b: np.ndarray) -> np.ndarray:
    """32 bytes of high bits (bit j of byte i: element 32j + i; a clear bit subtracts 4),
    64 bytes of 2-bit quants, 12 bytes of 6-bit scales (biased by 32) per 16 values, f16 d."""
    n = b.shape[0]
    s = b[:, 96:108]
    lo = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=-1)  # scale j's low 4 bits
    hi = (s[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(n, 16) & 3
    scale = ((lo | (hi << 4)).astype(np.int8) - 32).astype(np.float32)
    high = np.unpackbits(b[:, 0:32][:, None, :], axis=1, count=8, bitorder="little").reshape(n, 256)
    q = _crumbs(b[:, 32:96]).astype(np.int8) - ((1 - high.astype(np.int8)) << 2)
    d = _f16(b[:, 108:110])[:, None]
    return ((d * scale)[..., None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    """f16 d, dmin, 12 bytes of 6-bit scales/mins per 32 values, 128 bytes of nibbles (chunk
    c of 32 bytes: sub-block 2c low nibbles, 2c + 1 high): (d * sc) * q - dmin * m."""
    n = b.shape[0]
    sc, mn = _k_scales_mins(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32).astype(np.float32)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(n, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    """Q4_K plus 32 bytes of fifth bits (bit s of byte i: element i of sub-block s)."""
    n = b.shape[0]
    sc, mn = _k_scales_mins(b[:, 4:16])
    qs = b[:, 48:176].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    high = np.unpackbits(b[:, 16:48][:, None, :], axis=1, count=8, bitorder="little")
    q = ((qs & 0x0F).reshape(n, 8, 32) | (high << 4)).astype(np.float32)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    """128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales per 16 values, f16 d:
    (d * sc) * (q - 32). Per 128-value half h, group j of 32: low nibbles of ql bytes
    64h + 32(j % 2) + i (high nibble when j >= 2), highs at shift 2j of qh byte 32h + i."""
    n = b.shape[0]
    shifted = b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (shifted & 0x0F).reshape(n, 2, 4, 32)
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q = (ql | (qh << 4)).astype(np.int8) - 32
    d = _f16(b[:, 208:210])[:, None]
    scale = b[:, 192:208].view(np.int8).astype(np.float32)
    return ((d * scale)[..., None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    """f16 d, 6-bit scales (biased by 32) per 32 values: low 4 bits in 4 bytes of nibbles,
    high 2 bits in a u16; 128 bytes of 4-bit IQ4_LEVELS indices, q4_0's order per 32 values."""
    n = b.shape[0]
    lo = (b[:, 4:8][:, :, None] >> np.array([0, 4], np.uint8)).reshape(n, 8) & 0x0F
    hi = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    scale = ((lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - 32).astype(np.float32)
    idx = _nibbles(b[:, 8:136].reshape(n, 8, 16))
    d = _f16(b[:, 0:2])[:, None]
    return ((d * scale)[..., None] * IQ4_LEVELS[idx]).reshape(n, 256)


def _row(name: str, gguf_type: int, block_values: int, fields: tuple[Field, ...], decode: Decoder) -> WeightFormat:
    return WeightFormat(name, gguf_type, block_values, sum(f.nbytes for f in fields), fields, decode)


D, DMIN, M = Field("d", 2, "f16"), Field("dmin", 2, "f16"), Field("m", 2, "f16")

# The registry (the order is the one error messages list formats in).
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("f32", 0, 1, 4),
    WeightFormat("f16", 1, 1, 2),
    WeightFormat("bf16", 30, 1, 2),
    _row("q8_0", 8, 32, (D, Field("qs", 32)), _q8_0),
    _row("q4_0", 2, 32, (D, Field("qs", 16)), _q4_0),
    _row("q4_1", 3, 32, (D, M, Field("qs", 16)), _q4_1),
    _row("q5_0", 6, 32, (D, Field("qh", 4), Field("qs", 16)), _q5_0),
    _row("q5_1", 7, 32, (D, M, Field("qh", 4), Field("qs", 16)), _q5_1),
    _row("q2_k", 10, 256, (Field("scales", 16), Field("qs", 64), D, DMIN), _q2_k),
    _row("q3_k", 11, 256, (Field("hmask", 32), Field("qs", 64), Field("scales", 12), D), _q3_k),
    _row("q4_k", 12, 256, (D, DMIN, Field("scales", 12), Field("qs", 128)), _q4_k),
    _row("q5_k", 13, 256, (D, DMIN, Field("scales", 12), Field("qh", 32), Field("qs", 128)), _q5_k),
    _row("q6_k", 14, 256, (Field("ql", 128), Field("qh", 64), Field("scales", 16), D), _q6_k),
    _row("iq4_nl", 20, 32, (D, Field("qs", 16)), _iq4_nl),
    _row("iq4_xs", 23, 256, (D, Field("scales_h", 2), Field("scales_l", 4), Field("qs", 128)), _iq4_xs),
    _row("mxfp4", 39, 32, (Field("e", 1, "e8m0"), Field("qs", 16)), _mxfp4),
)}

FLOAT_FORMATS = tuple(name for name, f in FORMATS.items() if not f.is_block)
BLOCK_FORMATS = tuple(name for name, f in FORMATS.items() if f.is_block)


def weight_format(name: str) -> WeightFormat:
    """The registry row of `name`; a ValueError names the known formats otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})") from None


def by_gguf_type(gguf_type: int) -> WeightFormat | None:
    """The row of a GGUF tensor type id, or None for a type vkrt does not read."""
    return next((f for f in FORMATS.values() if f.gguf_type == gguf_type), None)


def decode_rows(raw: np.ndarray, name: str) -> np.ndarray:
    """Block-format rows ``[rows, row_bytes]`` uint8 -> float32 ``[rows, values]``."""
    fmt = weight_format(name)
    if fmt.decode is None:
        raise ValueError(f"{name} is not a block format")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0] if raw.ndim > 1 else 1
    blocks = raw.reshape(-1, fmt.block_bytes)
    return fmt.decode(blocks).astype(np.float32, copy=False).reshape(rows, -1)
