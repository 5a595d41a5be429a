"""RoPE inverse frequencies per rope_scaling type, in float64 on the host."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vkrt.errors import UnsupportedModelError


def inv_frequencies(rot_dim: int, theta: float, scaling: dict[str, Any] | None,
                    freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta^(-2i/rot_dim), adjusted like transformers' ROPE_INIT_FUNCTIONS for `scaling`."""
    inv = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
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
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported yet "
                                "(supported: default, linear, llama3)")
