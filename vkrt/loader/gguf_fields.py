"""GGUF metadata read into config.json's field names, so that one normalisation
(vkrt/loader/normalize.py's `model_config`) serves both formats: the names as transformers' GGUF
loader maps them, and what llama.cpp derives from a file (layer pattern, query scale, sparse
layers, tied head, longrope factors, a hybrid's layer kinds) spelled as config.json spells it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.arch_spec import ArchSpec
from vkrt.loader.config import WeightData
from vkrt.loader.gguf_file import GGUFFile
from vkrt.loader.llama4 import gguf_llama4
from vkrt.loader.mla import gguf_latent_attention
from vkrt.loader.normalize import ConfigFields, is_int

# GGUF key (after "<arch>.") -> config.json field, for the values that only change their name.
_GGUF_NAMES = {
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "rope.freq_base_swa": "rope_local_base_freq",
    "context_length": "max_position_embeddings",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "expert_weights_norm": "norm_topk_prob",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    # Granite's multipliers
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func
_GGUF_REQUIRED = ("embedding_length", "attention.head_count", "feed_forward_length", "block_count")
# rope.scaling.* -> rope_scaling's keys
_GGUF_ROPE_SCALING = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
                      "attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast",
                      "yarn_beta_slow": "beta_slow", "yarn_log_multiplier": "mscale_all_dim"}


def gguf_mtp_layers(path: Path, spec: ArchSpec, arch: str, meta: dict[str, Any]) -> range:
    """The blocks after the main ones that hold multi-token-prediction layers (ArchSpec.mtp_layers:
    `<arch>.nextn_predict_layers` of block_count, as llama.cpp's converter counts them)."""
    count, blocks = meta.get(f"{arch}.nextn_predict_layers"), meta.get(f"{arch}.block_count")
    if not spec.mtp_layers or not count or not is_int(blocks):
        return range(0)
    if not is_int(count) or not 0 < count < blocks:
        raise ModelFormatError(f"{path}: metadata {arch}.nextn_predict_layers is {count!r}, but it must count "
                               f"some of the {blocks} blocks; the file is corrupt")
    return range(blocks - count, blocks)


def gguf_fields(path: Path, spec: ArchSpec, arch: str, meta: dict[str, Any], reader: GGUFFile,
                weights: dict[str, WeightData], vocab: int) -> ConfigFields:
    """A GGUF file's metadata under config.json's names, with what llama.cpp derives from the
    file (layer pattern, query scale, sparse layers, tied head, longrope factors) spelled as
    config.json spells it. Pops the longrope factor tensors from `weights`."""
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for suffix in (*_GGUF_REQUIRED, *spec.gguf_required):
        if meta.get(f"{arch}.{suffix}") is None and f"{arch}.{suffix}" not in reader.fields:  # (or per layer)
            raise ModelFormatError(f"{path}: metadata key '{arch}.{suffix}' is missing; the GGUF is incomplete")
    kv_heads_per_layer = None
    ffn_per_layer = None
    for suffix in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        f = reader.fields.get(f"{arch}.{suffix}")
        if f is not None and f.types[0] == GGUFValueType.ARRAY:
            # llama.cpp marks a hybrid's recurrent layers by 0 KV heads, and (Nemotron-H) its layers
            # without an MLP by a 0 FFN width; other per-layer counts are not read
            readable = {"attention.head_count_kv": bool(spec.mixer_types) or spec.gguf_per_layer_shapes,
                        "feed_forward_length": spec.one_sublayer or spec.gguf_per_layer_shapes}
            if not readable.get(suffix) or not isinstance(f.value, list):
                raise UnsupportedModelError(f"{path}: per-layer '{arch}.{suffix}' is not supported")
            if suffix == "feed_forward_length":
                ffn_per_layer = f.value
            else:
                kv_heads_per_layer = f.value
    for suffix, key in _GGUF_NAMES.items():
        spelled[key] = f"{arch}.{suffix}"
        if meta.get(f"{arch}.{suffix}") is not None:
            values[key] = meta[f"{arch}.{suffix}"]
    mtp = gguf_mtp_layers(path, spec, arch, meta)
    if mtp:  # the main layers only
        values["num_hidden_layers"] = mtp.start
    if meta.get(f"{arch}.attention.layer_norm_epsilon") is not None:  # Nemotron-H writes its RMSNorm's so
        values.setdefault("rms_norm_eps", meta[f"{arch}.attention.layer_norm_epsilon"])
    values.setdefault("rms_norm_eps", 1e-5)  # llama.cpp's default, where transformers' is 1e-6
    if kv_heads_per_layer is not None and spec.mixer_types:
        _gguf_recurrent_layers(path, arch, spec, meta, weights, values, spelled, kv_heads_per_layer)
    if ffn_per_layer is not None and spec.one_sublayer:
        _gguf_one_sublayer_blocks(path, arch, spec, values, ffn_per_layer)
    if spec.default_mixer == "attention_mamba2":  # Falcon-H1: Mamba2 beside attention in every layer
        _gguf_ssm(arch, meta, values, spelled, ("mamba_d_conv", "mamba_d_state", "mamba_n_groups", "mamba_n_heads",
                                                "mamba_d_head"))
        values["mamba_conv_bias"] = any(name.endswith(".mamba.conv.bias") for name in weights)
        # llama.cpp gates Mamba2's output before its norm, and runs no norm where the file has none
        values["mamba_rms_norm"] = any(name.endswith(".mamba.norm") for name in weights)
    recurrent = reader.fields.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None and "gated_delta_net" in spec.mixer_types.values():
        _gguf_delta_nets(path, arch, spec, meta, values, spelled, recurrent.value)
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if is_int(rope_dim) and head_dim > 0 and rope_dim != head_dim:  # head_dim 0 is refused by the checks
        values["partial_rotary_factor"] = rope_dim / head_dim
        spelled["partial_rotary_factor"] = f"{arch}.rope.dimension_count"
    values["vocab_size"] = vocab
    values["tie_word_embeddings"] = "lm_head" not in weights
    if spec.qk_norm_optional:
        values["use_qk_norm"] = any(name.endswith(".q_norm") for name in weights)
    if spec.gguf_nope_every:  # as SmolLM3's config.json spells llama.cpp's rule: 0 = a NoPE layer
        values["no_rope_layers"] = [int((i + 1) % spec.gguf_nope_every != 0) for i in range(values["num_hidden_layers"])]
    scaling = _gguf_rope_scaling(path, arch, meta, weights)
    if scaling is not None:
        values["rope_scaling"] = {**spec.gguf_rope_scaling, **scaling}
    spelled["rope_scaling.rope_type"] = f"{arch}.rope.scaling.type"
    spelled |= {f"rope_scaling.{key}": f"{arch}.rope.scaling.{suffix}" for suffix, key in _GGUF_ROPE_SCALING.items()}
    pattern = _gguf_sliding_pattern(reader, arch, values["num_hidden_layers"])
    if pattern is not None:
        values["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    if spec.gguf_per_layer_shapes:
        gguf_layer_shapes(path, arch, meta, weights, values, kv_heads_per_layer, ffn_per_layer)
    if spec.gguf_wide_query_layers:  # llama.cpp's query scale for Gemma (GGUF has no query_pre_attn_scalar)
        wide = values["num_hidden_layers"] == spec.gguf_wide_query_layers
        values["query_pre_attn_scalar"] = values["hidden_size"] / values["num_attention_heads"] if wide else head_dim
    if values.get("num_experts") and not any(name.endswith(".router") for name in weights):
        values["num_experts"] = 0  # an expert count written for a model without experts (Nemotron-H's)
    if values.get("num_experts"):  # llama.cpp: a layer with a router is sparse
        values["mlp_only_layers"] = [i for i in range(values["num_hidden_layers"])
                                     if f"layers.{i}.router" not in weights]
        values["use_expert_bias"] = any(name.endswith(".expert_bias") for name in weights)
        if spec.one_sublayer:  # Nemotron-H: the blocks with a router are its MoE blocks
            values["layer_types"] = ["moe" if f"layers.{i}.router" in weights else kind
                                     for i, kind in enumerate(values.get("layer_types") or [])]
        gating = meta.get(f"{arch}.expert_gating_func")
        if gating is not None and _GGUF_GATING.get(gating) != spec.moe_router:
            raise UnsupportedModelError(f"{path}: '{arch}.expert_gating_func' {gating!r} is not this family's "
                                        f"{spec.moe_router} routing; vkrt does not run it")
    if spec.chunked_attention:
        gguf_llama4(meta, arch, values)
    if spec.default_mixer == "mla":
        gguf_latent_attention(arch, meta, values, spelled)
    eos: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if is_int(meta.get(k)) and meta[k] not in eos:
            eos.append(meta[k])
    values["eos_token_id"] = eos
    values["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    return ConfigFields(str(path), values, spelled, norm_offset_stored=True)


def gguf_layer_shapes(path: Path, arch: str, meta: dict[str, Any], weights: dict[str, WeightData],
                      values: dict[str, Any], kv_heads: list[int] | None, ffn: list[int] | None) -> None:
    """Gemma 4's per-layer shapes as config.json spells them (vkrt/loader/layer_shapes.py reads
    them): key_length is the full layers' head dim and key_length_swa the sliding ones'; per-layer
    KV heads (a full layer without attn_v: K = V) and FFN widths (twice as wide in the sharing
    layers: use_double_wide_mlp); shared_kv_layers; the per-layer embeddings' width; and rope_freqs
    (1 for each full-layer pair that rotates, 1e30 for the others) as proportional RoPE; experts
    (enable_moe_block) where it has an expert count. Pops rope_freqs from `weights`; queries are
    unscaled, as llama.cpp and transformers run Gemma 4."""
    types = values.get("layer_types") or []
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    swa_dim = meta.get(f"{arch}.attention.key_length_swa")
    if is_int(swa_dim):
        values["global_head_dim"], values["head_dim"] = values.get("head_dim"), swa_dim
    shared = meta.get(f"{arch}.attention.shared_kv_layers") or 0
    values["num_kv_shared_layers"] = shared
    first_shared = values["num_hidden_layers"] - shared if is_int(shared) else 0
    if kv_heads is not None and full and sliding:
        values["num_key_value_heads"], values["num_global_key_value_heads"] = kv_heads[sliding[0]], kv_heads[full[0]]
    values["attention_k_eq_v"] = any(f"layers.{i}.v_proj" not in weights for i in full if i < first_shared)
    if ffn is not None:
        values["intermediate_size"] = ffn[0]
        values["use_double_wide_mlp"] = any(width == 2 * ffn[0] for width in ffn[first_shared:])
    per_layer = meta.get(f"{arch}.embedding_length_per_layer_input")
    if per_layer and "per_layer.embed" in weights:
        values["hidden_size_per_layer_input"] = per_layer
        values["vocab_size_per_layer_input"] = weights["per_layer.embed"].shape[0]
    values.pop("partial_rotary_factor", None)  # rope.dimension_count is the full layers' whole head
    values["query_pre_attn_scalar"] = 1
    values["enable_moe_block"] = bool(values.get("num_experts"))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": values.pop("rope_local_base_freq", 10000.0)},
            "full_attention": {"rope_type": "default", "rope_theta": values.pop("rope_theta", 1e6)}}
    if "rope_freqs" in weights:
        factors = _factors(path, weights, "rope_freqs")
        rotating = sum(1 for f in factors if f == 1.0)
        if any(f != 1.0 for f in factors[:rotating]) or any(f < 1e29 for f in factors[rotating:]):
            raise UnsupportedModelError(f"{path}: rope_freqs of a {arch} file must be 1 for the pairs that rotate, "
                                        "then 1e30; other frequency factors are not supported")
        rope["full_attention"] |= {"rope_type": "proportional", "partial_rotary_factor": rotating / len(factors)}
    values["rope_parameters"] = rope


def _gguf_recurrent_layers(path: Path, arch: str, spec: ArchSpec, meta: dict[str, Any], weights: dict[str, WeightData],
                           values: dict[str, Any], spelled: dict[str, str], kv_heads: list[Any]) -> None:
    """A hybrid's layer kinds from its per-layer KV head counts (0: a recurrent layer, as
    llama.cpp writes them), with the recurrent mixer's settings."""
    layers = values["num_hidden_layers"]
    if len(kv_heads) != layers or any(not is_int(n) or n < 0 for n in kv_heads) or not any(kv_heads):
        raise ModelFormatError(f"{path}: '{arch}.attention.head_count_kv' must list {layers} counts, some "
                               "positive (attention layers) and 0 for recurrent ones; the file is corrupt")
    if len({n for n in kv_heads if n}) != 1:
        raise UnsupportedModelError(f"{path}: attention layers with different KV head counts are not supported")
    mixer = next(iter(spec.mixer_types))  # the family's recurrent layer type
    values["layer_types"] = ["full_attention" if n else mixer for n in kv_heads]
    values["num_key_value_heads"] = max(kv_heads)
    values["conv_bias"] = any(name.endswith(".conv.bias") for name in weights)
    if spec.mixer_types[mixer] == "mamba2":
        _gguf_mamba(path, arch, meta, values, spelled)
        return
    values["conv_L_cache"] = meta.get(f"{arch}.shortconv.l_cache")
    spelled["conv_L_cache"] = f"{arch}.shortconv.l_cache"


def _gguf_one_sublayer_blocks(path: Path, arch: str, spec: ArchSpec, values: dict[str, Any], ffn: list[Any]) -> None:
    """Nemotron-H's blocks from its per-layer FFN widths (an MLP block where > 0) beside the KV
    head counts that marked the attention blocks; the rest are Mamba2."""
    layers, kinds = values["num_hidden_layers"], values.get("layer_types")
    widths = {n for n in ffn if n}
    if len(ffn) != layers or any(not is_int(n) or n < 0 for n in ffn) or len(widths) != 1 or kinds is None:
        raise ModelFormatError(f"{path}: '{arch}.feed_forward_length' must list {layers} widths, one positive "
                               "width for the MLP blocks and 0 for the others; the file is corrupt")
    mlp = next(t for t, m in spec.mixer_types.items() if m == "none")
    values["layer_types"] = [mlp if n else kind for n, kind in zip(ffn, kinds, strict=True)]
    values["intermediate_size"] = widths.pop()


def _gguf_mamba(path: Path, arch: str, meta: dict[str, Any], values: dict[str, Any], spelled: dict[str, str]) -> None:
    """Mamba2's settings from the `ssm.*` keys llama.cpp writes (granitehybrid), in Granite 4's
    config.json names; its hybrids do not rotate positions (llama.cpp's converter marks that by
    rope.scaling.finetuned false), and a model without experts runs its shared MLP."""
    _gguf_ssm(arch, meta, values, spelled, ("mamba_d_conv", "mamba_d_state", "mamba_n_groups", "mamba_n_heads",
                                            "mamba_d_head"))
    values["mamba_conv_bias"] = values.pop("conv_bias")
    if meta.get(f"{arch}.rope.scaling.finetuned") is False:
        values["position_embedding_type"] = "nope"
    if not values.get("num_experts") and is_int(values.get("shared_expert_intermediate_size")):
        values["intermediate_size"] = values.pop("shared_expert_intermediate_size")
        spelled["intermediate_size"] = f"{arch}.expert_shared_feed_forward_length"


def _gguf_delta_nets(path: Path, arch: str, spec: ArchSpec, meta: dict[str, Any], values: dict[str, Any],
                     spelled: dict[str, str], recurrent: Any) -> None:
    """A delta-net hybrid's layer kinds (`attention.recurrent_layers`) and its heads, from the
    `ssm.*` keys llama.cpp writes for them."""
    layers = values["num_hidden_layers"]
    if isinstance(recurrent, list) and len(recurrent) == meta.get(f"{arch}.block_count"):
        recurrent = recurrent[:layers]  # the flags of the multi-token-prediction blocks after the main ones
    if not isinstance(recurrent, list) or len(recurrent) != layers:
        raise ModelFormatError(f"{path}: '{arch}.attention.recurrent_layers' must list {layers} flags; the file is corrupt")
    mixer = next(t for t, m in spec.mixer_types.items() if m == "gated_delta_net")
    values["layer_types"] = [mixer if flag else "full_attention" for flag in recurrent]
    _gguf_ssm(arch, meta, values, spelled, ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
                                            "linear_num_value_heads", "linear_value_head_dim"))
    values["linear_v_heads_tiled"] = spec.gguf_v_heads_tiled


_SSM_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank")


def _gguf_ssm(arch: str, meta: dict[str, Any], values: dict[str, Any], spelled: dict[str, str],
              names: tuple[str, str, str, str, str]) -> None:
    """llama.cpp's `ssm.*` keys (conv taps, state size, groups, heads; inner size / heads is the
    head dim), which it writes for Mamba2 and delta nets alike, under the family's config names;
    A = -exp(A_log) is stored (ssm_a)."""
    for key, suffix in zip(names, _SSM_KEYS, strict=False):
        values[key] = meta.get(f"{arch}.{suffix}")
        spelled[key] = f"{arch}.{suffix}"
    inner, heads = meta.get(f"{arch}.ssm.inner_size"), values[names[3]]
    values[names[4]] = inner // heads if is_int(inner) and is_int(heads) and heads else None
    spelled[names[4]] = f"{arch}.ssm.inner_size"
    values["linear_decay_stored"] = True


def _gguf_rope_scaling(path: Path, arch: str, meta: dict[str, Any],
                       weights: dict[str, WeightData]) -> dict[str, Any] | None:
    """rope_scaling from `rope.scaling.*` (or the pre-2024 `rope.scale_linear`), or Phi-3's
    longrope, whose factors llama.cpp stores as tensors."""
    if "rope_factors_long" in weights and "rope_factors_short" in weights:
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if not is_int(orig) or orig <= 0:
            raise ModelFormatError(f"{path}: rope_factors tensors need '{arch}.rope.scaling.original_context_length'")
        params: dict[str, Any] = {"rope_type": "longrope", "long_factor": _factors(path, weights, "rope_factors_long"),
                                  "short_factor": _factors(path, weights, "rope_factors_short"),
                                  "original_max_position_embeddings": orig}
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        if isinstance(attn, (int, float)):
            params["attention_factor"] = float(attn)
        return params
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:  # pre-2024 key
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scale_linear"])}
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind}
    for suffix, key in _GGUF_ROPE_SCALING.items():
        if meta.get(f"{arch}.rope.scaling.{suffix}") is not None:
            scaling[key] = meta[f"{arch}.rope.scaling.{suffix}"]
    if scaling.get("mscale_all_dim"):  # llama.cpp takes YaRN's mscale to be 1 beside its log multiplier
        scaling["mscale"] = 1.0
    if meta.get(f"{arch}.attention.temperature_scale"):  # Ministral 3's, over the original context
        scaling["llama_4_scaling_beta"] = meta[f"{arch}.attention.temperature_scale"]
    return scaling


def _factors(path: Path, weights: dict[str, WeightData], name: str) -> list[float]:
    w = weights.pop(name)
    if w.fmt not in ("f32", "f16"):
        raise ModelFormatError(f"{path}: tensor {name!r} must be F32 or F16, not {w.fmt}")
    return [float(v) for v in np.asarray(w.data, dtype=np.float64).reshape(-1)]


def _gguf_sliding_pattern(reader: GGUFFile, arch: str, num_layers: int) -> list[bool] | None:
    """Per-layer sliding flags from `attention.sliding_window_pattern` (a period n, every n-th
    layer global, as llama.cpp reads it; or one bool per layer); None: the file has none (the
    family's rule applies)."""
    f = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if f is None:
        return None
    value = f.value
    if f.types and f.types[0] == GGUFValueType.ARRAY and isinstance(value, list) and len(value) == num_layers:
        return [bool(v) for v in value]
    if is_int(value) and value >= 0:
        return [value == 0 or i % value < value - 1 for i in range(num_layers)]
    raise ModelFormatError(f"{arch}.attention.sliding_window_pattern: expected a period or {num_layers} flags")
