"""RoPE inverse frequencies per rope_scaling type, in float64 on the host."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vkrt.errors import UnsupportedModelError
from vkrt.ops.attention import rope_cos_sin, rope_inv_freq


def inv_frequencies(rot_dim: int, theta: float, scaling: dict[str, Any] | None,
                    freq_factors: np.ndarray | None = None, max_positions: int = 0) -> np.ndarray:
    """theta^(-2i/rot_dim), adjusted like transformers' ROPE_INIT_FUNCTIONS for `scaling`.

    longrope divides by its long factors when the table covers more than the original
    context (`max_positions`), else by its short ones: the choice llama.cpp makes from the
    context size. transformers switches per call on the current length instead, which
    agrees while sequences stay within the original context.
    """
    inv = rope_inv_freq(rot_dim, theta)
    if freq_factors is not None:  # GGUF rope_freqs: llama3 scaling baked per frequency
        return inv / np.asarray(freq_factors, dtype=np.float64)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    if kind == "longrope":
        assert scaling is not None
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float64)
        if factors.shape != inv.shape:
            raise UnsupportedModelError(f"longrope has {factors.size} factors for {inv.size} frequencies")
        return inv / factors
    if kind == "yarn":
        assert scaling is not None
        return _yarn(inv, rot_dim, theta, scaling)
    if kind == "proportional":  # Gemma 4: the first pairs rotate at the whole head's frequencies, the rest not at all
        assert scaling is not None
        rotating = int(float(scaling.get("partial_rotary_factor", 1.0)) * rot_dim // 2)
        return np.where(np.arange(inv.size) < rotating, inv, 0.0) / float(scaling.get("factor", 1.0))
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported yet "
                                "(supported: default, linear, llama3, longrope, yarn, proportional)")


def _yarn(inv: np.ndarray, rot_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those turning more than beta_fast times kept, a linear ramp
    over the dims between; the ramp's ends rounded outwards unless `truncate` is false."""
    factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times in orig
        return rot_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    ramp = np.clip((np.arange(rot_dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0.0, 1.0)
    return inv / factor * ramp + inv * (1.0 - ramp)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor transformers multiplies cos and sin by (longrope's and yarn's; 1 for the others)."""
    kind = (scaling or {}).get("rope_type")
    return float((scaling or {}).get("attention_factor") or 1.0) if kind in ("longrope", "yarn") else 1.0


def query_temperature_table(positions: int, head_dim: int, beta: float, length: int, shift: int = 0) -> np.ndarray:
    """[positions, head_dim] cos | sin table of a rotation by angle 0 and length
    1 + beta * ln(1 + floor((p + shift) / length)) (Ministral 3's llama_4_scaling_beta; Llama 4's
    attention temperature tuning with shift 1): `rope` with it multiplies each query by its
    position's temperature, exactly."""
    scale = 1.0 + beta * np.log1p(np.floor((np.arange(positions, dtype=np.float64) + shift) / length))
    cos = np.repeat(scale.astype(np.float32)[:, None], head_dim // 2, axis=1)
    return np.concatenate([cos, np.zeros_like(cos)], axis=1)


def rope_table(positions: int, head_dim: int, theta: float, scaling: dict[str, Any] | None,
               freq_factors: np.ndarray | None = None) -> np.ndarray:
    """The f32 [positions, head_dim] cos | sin table one layer type ropes with (float64 math)."""
    inv = inv_frequencies(head_dim, theta, scaling, freq_factors, positions)
    table = rope_cos_sin(positions, head_dim, theta, inv_freq=inv)
    factor = attention_factor(scaling)
    # transformers scales the f32 cos and sin, so the f32 table is scaled too, not the f64 one.
    return table if factor == 1.0 else table * np.float32(factor)
