"""The normalised model description every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LayerConfig:
    """What can differ between the layers of one model (Gemma's local/global, Mistral's window)."""

    window: int = 0  # sliding window W: attend to positions p - W < j <= p; 0 = full attention
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # transformers' rope_parameters minus rope_theta
    rope: bool = True  # False: no positional rotation at all (SmolLM3's NoPE layers)
    moe: bool = False  # the MLP is a mixture of experts (ModelConfig.num_experts), not dense


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, normalised from config.json or GGUF metadata.

    The family traits below the hyper-parameters default to Llama's; loaders set them from
    the architecture table and the file, so a model reads them and never its family name.
    """

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
    # -- family traits --------------------------------------------------------------------
    layers: tuple[LayerConfig, ...] = ()  # one per layer; empty = every layer full with rope_theta/scaling
    qkv_bias: bool = False  # q/k/v projections add a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # attention and MLP outputs are normed before the residual add (Gemma 2/3)
    norm_offset: float = 0.0  # norms scale by (offset + w): 1.0 for HF Gemma, already folded in GGUF
    embedding_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden))
    query_scale: float = 0.0  # attention score scale; 0 = 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c); 0 = off (Gemma 2)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c); 0 = off (Gemma 2)
    residual_scale: float = 1.0  # attention and MLP outputs times this before the residual add (Granite)
    logit_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    qk_norm_per_head: bool = True  # QK-norm over each head; False: over all of q and of k (OLMoE)
    # -- mixture of experts (layers whose LayerConfig.moe is set) -------------------------
    num_experts: int = 0  # E; 0 = every MLP is dense
    num_experts_per_tok: int = 0  # k experts per token
    moe_intermediate_size: int = 0  # one expert's FFN width
    norm_topk_prob: bool = False  # the k router weights are renormalised to sum to 1
    # A dense gated MLP every token runs beside the experts, scaled by sigmoid of its own gate
    # (Qwen2-MoE's shared_expert and shared_expert_gate); 0 = none.
    shared_expert_intermediate_size: int = 0

    def layer(self, i: int) -> LayerConfig:
        """Layer i's attention window and rope settings."""
        if self.layers:
            return self.layers[i]
        return LayerConfig(0, self.rope_theta, self.rope_scaling)


@dataclass
class WeightData:
    """One weight as stored on disk: `shape` is logical (out_features, in_features) or (n,).

    `fmt` is a row of vkrt.core.formats.FORMATS: float formats hold typed arrays (bf16 as
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
