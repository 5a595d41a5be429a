"""Multi-head latent attention's hyper-parameters (DeepSeek-V3, GLM-4 MoE Lite), from config.json or
from the `attention.*_lora_rank` / `*_mla` keys llama.cpp writes for a deepseek2 GGUF.

MLA caches per token one row of the compressed latent c_kv (kv_lora_rank) and the roped key
k_rope (qk_rope_head_dim) every head shares. vkrt runs it absorbed: as MQA with one KV head of
head_dim = qk_rope_head_dim + kv_lora_rank (rope first), whose value is that same row
(ModelConfig's MLA fields say more).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container
from typing import TYPE_CHECKING, Any

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.config import ModelConfig

if TYPE_CHECKING:  # (normalize calls in here)
    from vkrt.loader.normalize import ConfigFields

# <arch>.<suffix> -> config.json's field (a deepseek2 GGUF).
_GGUF_MLA = {"attention.kv_lora_rank": "kv_lora_rank", "attention.q_lora_rank": "q_lora_rank",
             "rope.dimension_count": "qk_rope_head_dim", "attention.value_length_mla": "v_head_dim"}


def _is_int(value: Any) -> bool:  # (normalize.is_int: that module imports this one)
    return isinstance(value, int) and not isinstance(value, bool)


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude 0.1 mscale ln(factor) + 1 (1 when the context is not stretched)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def latent_attention_config(src: ConfigFields, config: ModelConfig) -> ModelConfig:
    """`config` with its MLA fields, checked: one KV head of the cached row's width, RoPE on its
    first qk_rope_head_dim dims, and the softmax scale 1 / sqrt(qk_head_dim) times YaRN's
    mscale(factor, mscale_all_dim)^2, as transformers scales it."""
    if src.get("attention_bias"):
        raise UnsupportedModelError(f"{src.source}: {src.name('attention_bias')} is set; vkrt does not run biases on "
                                    "the latent attention's projections")
    ranks = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = src.get(key)
        if not _is_int(value) or value < 1:
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive integer, got {value!r}")
        ranks[key] = value
    q_lora = src.get("q_lora_rank")
    if q_lora is not None and (not _is_int(q_lora) or q_lora < 0):
        raise ModelFormatError(f"{src.source}: {src.name('q_lora_rank')} must be a count or null, got {q_lora!r}")
    rope = ranks["qk_rope_head_dim"]
    if rope % 2:
        raise ModelFormatError(f"{src.source}: {src.name('qk_rope_head_dim')} is {rope}; RoPE needs an even number")
    scale = (ranks["qk_nope_head_dim"] + rope) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return dataclasses.replace(config, num_kv_heads=1, head_dim=rope + ranks["kv_lora_rank"], rotary_dim=rope,
                               query_scale=scale, rope_interleaved=bool(src.get("rope_interleave", True)),
                               q_lora_rank=q_lora or 0, **ranks)


def gguf_latent_attention(arch: str, meta: dict[str, Any], values: dict[str, Any], spelled: dict[str, str]) -> None:
    """A deepseek2 GGUF's MLA keys under config.json's names. llama.cpp's converter writes
    key_length_mla = qk_nope + qk_rope (older files: key_length), YaRN's log multiplier as
    0.1 mscale_all_dim, and runs cos and sin unscaled (mscale = mscale_all_dim); its RoPE pairs
    are always interleaved."""
    for suffix, key in _GGUF_MLA.items():
        values[key] = meta.get(f"{arch}.{suffix}")
        spelled[key] = f"{arch}.{suffix}"
    qk = meta.get(f"{arch}.attention.key_length_mla", meta.get(f"{arch}.attention.key_length"))
    rope = values["qk_rope_head_dim"]
    values["qk_nope_head_dim"] = qk - rope if _is_int(qk) and _is_int(rope) else None  # (checked as a count later)
    spelled["qk_nope_head_dim"] = f"{arch}.attention.key_length_mla"
    if values["v_head_dim"] is None:  # (older files: value_length)
        values["v_head_dim"] = meta.get(f"{arch}.attention.value_length")
    values.pop("head_dim", None)  # key_length is the cached row's width; latent_attention_config sets it
    values.pop("partial_rotary_factor", None)
    values["rope_interleave"] = True
    scaling = values.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("mscale_all_dim"):
        mscale = 10.0 * float(scaling["mscale_all_dim"])
        values["rope_scaling"] = scaling | {"mscale": mscale, "mscale_all_dim": mscale}


def mla_weight_shapes(config: ModelConfig, layer: str, stored: Container[str]) -> dict[str, tuple[int, ...]]:
    """An MLA layer's attention weights and their shapes (layer: "layers.{i}."): q through the q
    LoRA or q_proj, kv_a_proj's latent and rope rows, the up-projection as one kv_b_proj (HF) or
    per head as k_b [H, kv_lora, nope] and v_b [H, v, kv_lora] (llama.cpp's converter), o_proj."""
    c = config
    heads, hidden, qk = c.num_heads, c.hidden_size, c.qk_nope_head_dim + c.qk_rope_head_dim
    out: dict[str, tuple[int, ...]] = {"kv_a_proj": (c.kv_lora_rank + c.qk_rope_head_dim, hidden),
                                       "kv_a_norm": (c.kv_lora_rank,), "o_proj": (hidden, heads * c.v_head_dim)}
    if c.q_lora_rank:
        out |= {"q_a_proj": (c.q_lora_rank, hidden), "q_a_norm": (c.q_lora_rank,), "q_b_proj": (heads * qk, c.q_lora_rank)}
    else:
        out["q_proj"] = (heads * qk, hidden)
    if layer + "kv_b_proj" in stored:
        out["kv_b_proj"] = (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    else:
        out |= {"k_b": (heads, c.kv_lora_rank, c.qk_nope_head_dim), "v_b": (heads, c.v_head_dim, c.kv_lora_rank)}
    return {layer + name: shape for name, shape in out.items()}
