"""RoPE tables under linear scaling, longrope and GGUF `rope_freqs`, against arithmetic done here.

- linear (transformers' `_compute_linear_scaling_rope_parameters`: inv_freq / factor):
  position p of the scaled table is position p / factor of the plain one.
- rope_freqs: llama.cpp's converter stores llama3 scaling as one factor per frequency
  (convert_hf_to_gguf.py: 1 where the wavelength is short, `factor` where it is long,
  1 / ((1 - s) / factor + s) between); dividing by them must give transformers' llama3
  frequencies, which vkrt computes from the config by a different formula.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from vkrt.models.rope import inv_frequencies, rope_table

THETA, DIM, POSITIONS = 10000.0, 64, 300


def plain_inv(dim: int = DIM, theta: float = THETA) -> np.ndarray:
    return np.array([theta ** (-2.0 * i / dim) for i in range(dim // 2)], dtype=np.float64)


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_linear_scaling_divides_every_frequency(factor: float) -> None:
    got = inv_frequencies(DIM, THETA, {"rope_type": "linear", "factor": factor})
    np.testing.assert_allclose(got, plain_inv() / factor, rtol=1e-14, atol=0)


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_linear_table_is_the_plain_table_at_scaled_positions(factor: float) -> None:
    table = rope_table(POSITIONS, DIM, THETA, {"rope_type": "linear", "factor": factor})
    angles = np.outer(np.arange(POSITIONS) / factor, plain_inv())
    want = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    assert table.dtype == np.float32 and table.shape == (POSITIONS, DIM)
    np.testing.assert_allclose(table, want, rtol=0, atol=2e-7)  # f32 rounding of the f64 values


def test_linear_scaling_changes_the_table() -> None:
    """The scaled table is not the plain one (a mutation that drops the factor fails here)."""
    plain = rope_table(POSITIONS, DIM, THETA, None)
    scaled = rope_table(POSITIONS, DIM, THETA, {"rope_type": "linear", "factor": 4.0})
    assert np.abs(plain[1:] - scaled[1:]).max() > 0.1


def llama_cpp_rope_freqs(dim: int, theta: float, factor: float, low: float, high: float, old_len: int) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter writes as rope_freqs for llama3."""
    out = []
    for inv in plain_inv(dim, theta):
        wavelen = 2 * math.pi / inv
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)  # stored as an f32 tensor


@pytest.mark.parametrize(("dim", "old_len"), [(64, 64), (128, 8192)])
def test_rope_freqs_reproduce_llama3_scaling(dim: int, old_len: int) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": old_len}
    freqs = llama_cpp_rope_freqs(dim, 500000.0, 8.0, 1.0, 4.0, old_len)
    assert (freqs > 1).any() and (freqs == 1).any()  # the case has every band
    from_gguf = inv_frequencies(dim, 500000.0, None, freq_factors=freqs)
    np.testing.assert_allclose(from_gguf, plain_inv(dim, 500000.0) / freqs.astype(np.float64), rtol=1e-14)
    from_config = inv_frequencies(dim, 500000.0, scaling)
    np.testing.assert_allclose(from_gguf, from_config, rtol=1e-7)  # the factors are f32
    table = rope_table(200, dim, 500000.0, None, freq_factors=freqs)
    np.testing.assert_allclose(table, rope_table(200, dim, 500000.0, scaling), atol=1e-5)


LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 128, "attention_factor": 1.19,
            "short_factor": [1.0 + 0.05 * i for i in range(DIM // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(DIM // 2)]}


@pytest.mark.parametrize("positions", [128, 300])
def test_longrope_table_divides_by_the_factors_of_its_length(positions: int) -> None:
    """transformers' longrope: inv_freq / ext_factors with the long factors beyond the
    original context, the short ones within it; cos and sin times the attention factor.
    A 300-position table (beyond the original 128) must take the long factors."""
    kind = "long_factor" if positions > LONGROPE["original_max_position_embeddings"] else "short_factor"
    inv = plain_inv() / np.array(LONGROPE[kind], dtype=np.float64)
    angles = np.outer(np.arange(positions), inv)
    want = np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * 1.19
    table = rope_table(positions, DIM, THETA, LONGROPE)
    np.testing.assert_allclose(table, want, rtol=0, atol=4e-7)
    other = "short_factor" if kind == "long_factor" else "long_factor"
    wrong = np.outer(np.arange(positions), plain_inv() / np.array(LONGROPE[other]))
    assert np.abs(table[:, : DIM // 2] - np.cos(wrong) * 1.19).max() > 1e-2  # the choice matters here


def test_yarn_keeps_fast_frequencies_and_interpolates_slow_ones() -> None:
    """YaRN (Ministral 3's settings): a frequency that turns more than beta_fast times over the
    original context is kept, one that turns fewer than beta_slow times is divided by the factor,
    and those between are blended: never outside [inv / factor, inv], decreasing in the dim."""
    dim, theta, orig, factor = 128, 1e6, 16384, 16.0
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
               "beta_fast": 32.0, "beta_slow": 1.0}
    got, inv = inv_frequencies(dim, theta, scaling), plain_inv(dim, theta)
    turns = orig * inv / (2 * math.pi)
    fast, slow = turns > 32 * 2, turns < 1 / 2  # clear of the ramp's rounding to whole dims
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    np.testing.assert_allclose(got[fast], inv[fast], rtol=1e-14)
    np.testing.assert_allclose(got[slow], inv[slow] / factor, rtol=1e-14)
    assert (got <= inv * (1 + 1e-14)).all() and (got >= inv / factor * (1 - 1e-14)).all()
    assert (np.diff(got / inv) <= 1e-14).all()


def test_query_temperature_table_scales_by_position() -> None:
    """A rotation by 0 whose length is 1 + beta ln(1 + floor(p / length)): rope with it multiplies."""
    from vkrt.models.rope import query_temperature_table
    from vkrt.ops.attention import rope

    table = query_temperature_table(40, 16, 0.1, 16)
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    positions = np.array([0, 16, 39], np.int32)
    want = x * np.float32([1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)])[:, None].astype(np.float32)
    np.testing.assert_array_equal(rope(x, positions, table, 16), want)
