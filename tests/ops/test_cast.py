"""Native cast (f32/f16/bf16) and copy: bit-exact with the numpy reference on both access paths.

The f16 codecs are integer code (shaders/include/cast.glsl) that must round like numpy's
astype(float16): every f16 and bf16 bit pattern is checked, and f32 -> f16 on exact ties,
ties +- 1 ulp, the overflow and subnormal boundaries, NaN payloads and random bit patterns.
"""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from vkrt.core.quant import f32_to_bf16
from vkrt.errors import VkrtError

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

DTYPES = ("f32", "f16", "bf16")
SIZES = [(1,), (7,), (576,), (1000,), (3, 333)]  # (3, 333): odd total length in 2-D


def _host(values: np.ndarray, dtype: str) -> np.ndarray:
    """f32 values in the numpy representation of `dtype` (bf16 as uint16 bits)."""
    if dtype == "f16":
        return values.astype(np.float16)
    return f32_to_bf16(values) if dtype == "bf16" else values


def _random_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = (rng.standard_normal(shape) * 100).astype(np.float32)
    flat = x.reshape(-1)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 70000.0, 3e-6], np.float32)
    flat[: min(flat.size, specials.size)] = specials[: flat.size]
    return x


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_cast_exact(vk, x: np.ndarray, src: str, dst: str) -> None:
    drains = vk.counters.drains
    got = ops.cast(vk.upload(x, src), dst).numpy()
    assert vk.counters.drains == drains
    want = ops.OPS["cast"].reference(x, dst)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
def test_cast_is_bit_exact(vk, rng, src: str, dst: str, shape: tuple[int, ...]) -> None:
    _assert_cast_exact(vk, _host(_random_values(rng, shape), src), src, dst)


@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("src", ["f16", "bf16"])
def test_cast_every_16bit_pattern(vk, src: str, dst: str) -> None:
    """All 65536 patterns: subnormals, infs and NaN payloads included."""
    patterns = np.arange(65536, dtype=np.uint16)
    _assert_cast_exact(vk, patterns.view(np.float16) if src == "f16" else patterns, src, dst)


def _f16_edge_values() -> np.ndarray:
    """f32 values around every f16 rounding decision."""
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = (halves[:-1] + halves[1:]) / 2  # exact in f32: half-way between neighbours
    ties32 = ties.astype(np.float32).view(np.uint32)
    near = np.concatenate([ties32 - 1, ties32, ties32 + 1]).view(np.float32)
    boundaries = np.array([65504.0, 65519.996, 65520.0, 65535.0, 65536.0, 1e9, np.inf,
                           2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 2.0**-14,
                           2.0**-14 * (1 - 2.0**-11), 1e-45, 0.0], np.float32)
    nans = np.array([0x7FC00000, 0x7F800001, 0x7F802000, 0x7FFFFFFF, 0x7FA00000], np.uint32).view(np.float32)
    values = np.concatenate([halves.astype(np.float32), near, boundaries, nans])
    return np.concatenate([values, -values])


def test_f32_to_f16_rounds_like_numpy(vk) -> None:
    _assert_cast_exact(vk, _f16_edge_values(), "f32", "f16")


def test_f32_casts_on_random_bit_patterns(vk, rng) -> None:
    x = rng.integers(0, 2**32, 200_001, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for dst in DTYPES:
        _assert_cast_exact(vk, x, "f32", dst)


@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i32", "u32"])
def test_copy_is_bit_exact(vk, rng, dtype: str, shape: tuple[int, ...]) -> None:
    raw = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    if dtype in ("f16", "bf16"):
        raw = raw.astype(np.uint16)
    host = raw.view({"f32": np.float32, "f16": np.float16, "bf16": np.uint16,
                     "i32": np.int32, "u32": np.uint32}[dtype])
    drains = vk.counters.drains
    got = ops.copy(vk.upload(host, dtype)).numpy()
    assert vk.counters.drains == drains
    assert got.dtype == host.dtype and got.shape == host.shape
    np.testing.assert_array_equal(_bits(got), _bits(host))


def test_cast_and_copy_reject_bad_input(vk) -> None:
    with pytest.raises(VkrtError, match="cast"):
        ops.cast(vk.upload(np.zeros(4, np.int32)), "f32")
    with pytest.raises(VkrtError, match="cast"):
        ops.cast(vk.upload(np.zeros(4, np.float32)), "i32")
    with pytest.raises(VkrtError, match="copy"):
        ops.copy(vk.upload_weight(np.zeros(34, np.uint8), "q8_0", (1, 32)))
