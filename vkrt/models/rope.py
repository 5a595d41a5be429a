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
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported yet "
                                "(supported: default, linear, llama3, longrope)")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor transformers multiplies cos and sin by (longrope's; 1 for the others)."""
    return float((scaling or {}).get("attention_factor") or 1.0) if (scaling or {}).get("rope_type") == "longrope" else 1.0


def rope_table(positions: int, head_dim: int, theta: float, scaling: dict[str, Any] | None,
               freq_factors: np.ndarray | None = None) -> np.ndarray:
    """The f32 [positions, head_dim] cos | sin table one layer type ropes with (float64 math)."""
    inv = inv_frequencies(head_dim, theta, scaling, freq_factors, positions)
    table = rope_cos_sin(positions, head_dim, theta, inv_freq=inv)
    factor = attention_factor(scaling)
    # transformers scales the f32 cos and sin, so the f32 table is scaled too, not the f64 one.
    return table if factor == 1.0 else table * np.float32(factor)
