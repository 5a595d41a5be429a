"""The normalised model description every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, normalised from config.json or GGUF metadata."""

    architecture: str  # registry key, e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""


@dataclass
class WeightData:
    """One weight as stored on disk: `shape` is logical (out_features, in_features) or (n,).

    `fmt` is a row of vkrt.ops.formats.FORMATS: float formats hold typed arrays (bf16 as
    uint16), block formats the GGUF bytes, one row of blocks per output row."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    data: np.ndarray  # float formats: float32/float16/uint16(bf16); block formats: uint8 [rows, row_bytes]


@dataclass
class LoadedModel:
    """What `vkrt.loader.load_model` returns."""

    path: str
    config: ModelConfig
    weights: dict[str, WeightData]
    file_type: str = ""  # e.g. "Q4_1", "F32", "BF16"
    metadata: dict[str, Any] = field(default_factory=dict)
