"""Per-architecture tables: how GGUF and HF names map onto vkrt's canonical weight names.

Adding an architecture (qwen2, gemma, ...) means adding one `ArchSpec` row here; the
GGUF and HF loaders are driven entirely by these tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vkrt.errors import ModelFormatError
from vkrt.loader.config import ModelConfig, WeightData

# Canonical per-layer weights, in the order a block uses them.
LAYER_WEIGHTS = (
    "attn_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "ffn_norm",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture family is named in GGUF and HF checkpoints."""

    name: str  # ModelConfig.architecture
    gguf_archs: tuple[str, ...]  # values of GGUF `general.architecture`
    hf_archs: tuple[str, ...]  # entries of config.json `architectures`
    gguf_global: dict[str, str]  # GGUF tensor name -> canonical name
    gguf_layer: dict[str, str]  # GGUF per-layer suffix (after "blk.{i}.") -> canonical
    hf_global: dict[str, str]
    hf_layer: dict[str, str]  # HF per-layer suffix (after "model.layers.{i}.") -> canonical
    layer_weights: tuple[str, ...] = LAYER_WEIGHTS  # required per layer
    # llama.cpp's converter interleaves the RoPE halves of q/k rows for this family.
    gguf_qk_permuted: bool = False
    # Tensors present in some checkpoints that carry no information vkrt needs.
    hf_ignored: re.Pattern[str] = re.compile(r"^$")


def canonical_name(name: str, global_names: dict[str, str], layer_pattern: re.Pattern[str],
                   layer_names: dict[str, str]) -> str | None:
    """A checkpoint tensor name -> vkrt's canonical name ("layers.{i}.<name>" for per-layer
    tensors, whose layer index and suffix `layer_pattern` captures), or None if unknown."""
    if name in global_names:
        return global_names[name]
    m = layer_pattern.match(name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


_LLAMA = ArchSpec(
    name="llama",
    gguf_archs=("llama",),
    hf_archs=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_global={
        "token_embd.weight": "embed_tokens",
        "output_norm.weight": "final_norm",
        "output.weight": "lm_head",
        # Llama 3.1-style GGUFs bake the rope scaling into per-frequency factors.
        "rope_freqs.weight": "rope_freqs",
    },
    gguf_layer={
        "attn_norm.weight": "attn_norm",
        "attn_q.weight": "q_proj",
        "attn_k.weight": "k_proj",
        "attn_v.weight": "v_proj",
        "attn_output.weight": "o_proj",
        "ffn_norm.weight": "ffn_norm",
        "ffn_gate.weight": "gate_proj",
        "ffn_up.weight": "up_proj",
        "ffn_down.weight": "down_proj",
    },
    hf_global={
        "model.embed_tokens.weight": "embed_tokens",
        "model.norm.weight": "final_norm",
        "lm_head.weight": "lm_head",
    },
    hf_layer={
        "input_layernorm.weight": "attn_norm",
        "self_attn.q_proj.weight": "q_proj",
        "self_attn.k_proj.weight": "k_proj",
        "self_attn.v_proj.weight": "v_proj",
        "self_attn.o_proj.weight": "o_proj",
        "post_attention_layernorm.weight": "ffn_norm",
        "mlp.gate_proj.weight": "gate_proj",
        "mlp.up_proj.weight": "up_proj",
        "mlp.down_proj.weight": "down_proj",
    },
    gguf_qk_permuted=True,
    hf_ignored=re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
)

ARCHS: tuple[ArchSpec, ...] = (_LLAMA,)


def arch_for_gguf(gguf_arch: str) -> ArchSpec | None:
    """The spec whose GGUF `general.architecture` is `gguf_arch`, or None."""
    return next((a for a in ARCHS if gguf_arch in a.gguf_archs), None)


def arch_for_hf(hf_archs: list[str]) -> ArchSpec | None:
    """The spec matching any entry of config.json `architectures`, or None."""
    return next((a for a in ARCHS for name in hf_archs if name in a.hf_archs), None)


def supported_gguf_archs() -> str:
    return ", ".join(name for a in ARCHS for name in a.gguf_archs)


def supported_hf_archs() -> str:
    return ", ".join(name for a in ARCHS for name in a.hf_archs)


def check_weights(source: str, config: ModelConfig, weights: dict[str, WeightData]) -> None:
    """Raise ModelFormatError unless every canonical weight is present with its logical shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    expected: dict[str, tuple[int, ...]] = {
        "embed_tokens": (config.vocab_size, hidden),
        "final_norm": (hidden,),
    }
    if not config.tie_word_embeddings:
        expected["lm_head"] = (config.vocab_size, hidden)
    per_layer = {
        "attn_norm": (hidden,),
        "q_proj": (q_rows, hidden),
        "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden),
        "o_proj": (hidden, q_rows),
        "ffn_norm": (hidden,),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    for i in range(config.num_layers):
        for name, shape in per_layer.items():
            expected[f"layers.{i}.{name}"] = shape
    for name, shape in expected.items():
        weight = weights.get(name)
        if weight is None:
            raise ModelFormatError(
                f"{source}: weight {name!r} is missing; the file is incomplete or not a "
                f"{config.architecture} checkpoint"
            )
        if weight.shape != shape:
            raise ModelFormatError(
                f"{source}: weight {name!r} has shape {weight.shape}, but the config implies "
                f"{shape}; the checkpoint and its config disagree"
            )
