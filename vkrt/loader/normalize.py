"""config.json and GGUF metadata -> one ModelConfig, with per-layer attention and rope.

Both spellings of config.json's rope settings are read: the top-level `rope_theta` /
`rope_scaling` (and Gemma 3's `rope_local_base_freq`) of transformers < 5, and
transformers 5's `rope_parameters`, either one dict or one per layer type
(`{"full_attention": {...}, "sliding_attention": {...}}`). Whatever the source, a model
sees `ModelConfig.layers`: each layer's window, rope base and rope scaling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.arch import ArchSpec
from vkrt.loader.config import LayerConfig, ModelConfig, WeightData
from vkrt.loader.gguf_file import GGUFFile

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def _rope_scaling(source: str, fieldname: str, params: dict[str, Any] | None, max_positions: int,
                  cfg: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' rope parameters (one layer type) -> vkrt's scaling dict, or None for plain RoPE."""
    if not params:
        return None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{source}: {fieldname}.rope_type {kind!r} is not supported "
                                    f"(supported: {', '.join(ROPE_TYPES)})")
    if float(scaling.pop("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: {fieldname}.partial_rotary_factor < 1 is not supported")
    if kind == "default":
        return None
    scaling["rope_type"] = kind
    need: tuple[str, ...] = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
                             "longrope": ("short_factor", "long_factor")}[kind]
    if kind == "longrope":
        orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not isinstance(orig, int) or orig <= 0:
            raise ModelFormatError(f"{source}: {fieldname}: longrope needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = orig
        # transformers: factor defaults to the context extension, the attention factor to
        # sqrt(1 + ln(factor) / ln(original context)) (1 when nothing is extended).
        factor = float(scaling.get("factor") or max_positions / orig)
        scaling["factor"] = factor
        if scaling.get("attention_factor") is None:
            scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    for key in need:
        if scaling.get(key) is None:
            raise ModelFormatError(f"{source}: {fieldname} of rope_type {kind!r} has no {key!r}")
    return scaling


def _rope_by_layer_type(source: str, spec: ArchSpec, cfg: dict[str, Any],
                        max_positions: int) -> dict[bool, tuple[float, dict[str, Any] | None]]:
    """{is_sliding: (rope_theta, scaling)} from either spelling of the rope settings."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        per_type = {sliding: params.get(name) or {} for name, sliding in _LAYER_TYPES.items()}
        field_of = {sliding: f"rope_parameters.{name}" for name, sliding in _LAYER_TYPES.items()}
    else:
        base = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
        base.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        local = dict(base)
        if spec.local_rope_theta:  # Gemma 3: its own local base; the scaling is global only
            local = {"rope_theta": cfg.get("rope_local_base_freq", spec.local_rope_theta)}
        per_type = {False: base, True: local}
        name = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
        field_of = {False: name, True: name}
    out: dict[bool, tuple[float, dict[str, Any] | None]] = {}
    for sliding, p in per_type.items():
        theta = p.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            theta = spec.local_rope_theta if sliding and spec.local_rope_theta else 10000.0
        out[sliding] = (float(theta), _rope_scaling(source, field_of[sliding], p, max_positions, cfg))
    return out


def _sliding_layers(source: str, spec: ArchSpec, cfg: dict[str, Any], num_layers: int) -> list[bool]:
    types = cfg.get("layer_types")
    if types is None:
        rule: Callable[[int, dict[str, Any]], bool] | None = spec.default_sliding
        return [bool(rule and rule(i, cfg)) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelFormatError(f"{source}: layer_types must list one type per layer ({num_layers})")
    for t in types:
        if t not in _LAYER_TYPES:
            raise UnsupportedModelError(f"{source}: layer_types entry {t!r} is not supported "
                                        f"(supported: {', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def _rotated_layers(source: str, cfg: dict[str, Any], num_layers: int) -> list[bool]:
    """SmolLM3's `no_rope_layers`: 1 where the layer uses RoPE, 0 where it does not (NoPE)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        return [True] * num_layers
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ModelFormatError(f"{source}: no_rope_layers must list 0 or 1 for each of the {num_layers} layers")
    return [bool(f) for f in flags]


MAX_EXPERTS = 4096  # bounds the per-expert loops before any runs (real models: <= 512)


def _moe_fields(source: str, experts: Any, per_token: Any, expert_ffn: Any) -> tuple[int, int, int]:
    """ModelConfig's expert count, experts per token and expert FFN width, checked (0s: dense)."""
    if experts in (None, 0):
        return 0, 0, 0
    for key, value, top in (("num_experts", experts, MAX_EXPERTS), ("num_experts_per_tok", per_token, experts),
                            ("moe_intermediate_size", expert_ffn, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (top is not None and value > top):
            bound = f" and at most {top}" if top is not None else ""
            raise ModelFormatError(f"{source}: {key} must be a positive integer{bound}, got {value!r}")
    return experts, per_token, expert_ffn


def _shared_expert_width(source: str, spec: ArchSpec, key: str, value: Any, experts: int) -> int:
    """The shared expert's FFN width of a family that has one (0: none), checked."""
    if not (spec.shared_expert and experts):
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _hf_sparse_layers(source: str, cfg: dict[str, Any], num_layers: int) -> list[bool]:
    """Qwen3-MoE's rule: layer i is sparse unless listed in mlp_only_layers, every
    decoder_sparse_step-th layer (both default to every layer: Mixtral, OLMoE)."""
    step = cfg.get("decoder_sparse_step") or 1
    dense = cfg.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelFormatError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ModelFormatError(f"{source}: mlp_only_layers must be a list of layer indices")
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def _positive(source: str, cfg: dict[str, Any], key: str) -> float:
    """An optional positive multiplier of config.json (0.0 when absent)."""
    value = cfg.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ModelFormatError(f"{source}: {key} must be a positive number, got {value!r}")
    return float(value)


def _softcap(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def hf_model_config(config_path: Path, spec: ArchSpec, cfg: dict[str, Any], generation: dict[str, Any],
                    name: str) -> ModelConfig:
    """config.json (+ generation_config.json) of family `spec` -> ModelConfig."""
    source = str(config_path)

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelFormatError(f"{source}: required field {key!r} is missing")
        return cfg[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    num_layers = int(need("num_hidden_layers"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    act_field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = str(cfg.get(act_field) or spec.activation)
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{source}: {act_field} {act!r} is not supported "
                                    f"(supported: {', '.join(ACTIVATIONS)})")
    rope = _rope_by_layer_type(source, spec, cfg, max_positions)
    window = cfg.get("sliding_window")
    window = int(window) if isinstance(window, int) and window > 0 else 0
    moe = _moe_fields(source, cfg.get("num_experts", cfg.get("num_local_experts")), cfg.get("num_experts_per_tok"),
                      cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
    if moe[0] and cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{source}: clip_qkv is not supported")
    sparse = _hf_sparse_layers(source, cfg, num_layers) if moe[0] else [False] * num_layers
    layers = tuple(LayerConfig(window if sliding else 0, *rope[bool(sliding and window)], rotated, is_moe)
                   for sliding, rotated, is_moe in zip(_sliding_layers(source, spec, cfg, num_layers),
                                                       _rotated_layers(source, cfg, num_layers), sparse, strict=True))
    scalar = cfg.get("query_pre_attn_scalar")
    query_scale = float(scalar) ** -0.5 if isinstance(scalar, (int, float)) and scalar > 0 else 0.0
    embedding_scale = math.sqrt(hidden) if spec.scale_embeddings else 1.0
    # Granite's multipliers (absent elsewhere): the attention one is the score scale itself.
    query_scale = _positive(source, cfg, "attention_multiplier") or query_scale
    embedding_scale = _positive(source, cfg, "embedding_multiplier") or embedding_scale
    logits_scaling = _positive(source, cfg, "logits_scaling")
    eos_ids: list[int] = []
    for value in (cfg.get("eos_token_id"), generation.get("eos_token_id")):
        eos_ids += [i for i in _int_list(value) if i not in eos_ids]
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        architecture=spec.name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope[False][0],
        rope_scaling=rope[False][1],
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=ACTIVATIONS[act],
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=tuple(eos_ids),
        name=name,
        layers=layers,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        sandwich_norms=spec.sandwich_norms,
        norm_offset=spec.hf_norm_offset,
        embedding_scale=embedding_scale,
        query_scale=query_scale,
        attn_softcap=_softcap(cfg.get("attn_logit_softcapping")),
        final_softcap=_softcap(cfg.get("final_logit_softcapping")),
        residual_scale=_positive(source, cfg, "residual_multiplier") or 1.0,
        logit_scale=1.0 / logits_scaling if logits_scaling else 1.0,
        qk_norm_per_head=spec.qk_norm_per_head,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", spec.norm_topk_prob)),
        num_experts=moe[0],
        num_experts_per_tok=moe[1],
        moe_intermediate_size=moe[2],
        shared_expert_intermediate_size=_shared_expert_width(
            source, spec, "shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size"), moe[0]),
    )


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _gguf_sliding_layers(reader: GGUFFile, arch: str, spec: ArchSpec, num_layers: int) -> list[bool]:
    """Per-layer sliding flags: the file's `attention.sliding_window_pattern` (a period n, every
    n-th layer global, as llama.cpp reads it; or one bool per layer), else the family's rule."""
    f = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if f is not None:
        value = f.value
        if f.types and f.types[0] == GGUFValueType.ARRAY and isinstance(value, list) and len(value) == num_layers:
            return [bool(v) for v in value]
        if isinstance(value, int) and value >= 0:
            return [value == 0 or i % value < value - 1 for i in range(num_layers)]
        raise ModelFormatError(f"{arch}.attention.sliding_window_pattern: expected a period or "
                               f"{num_layers} flags")
    rule = spec.default_sliding
    return [bool(rule and rule(i, {})) for i in range(num_layers)]


def _gguf_longrope(path: Path, arch: str, meta: dict[str, Any], weights: dict[str, WeightData],
                   config: ModelConfig) -> dict[str, Any] | None:
    """Phi-3's longrope: llama.cpp stores the factors as tensors, the rest as metadata."""
    if "rope_factors_long" not in weights or "rope_factors_short" not in weights:
        return config.rope_scaling

    def factors(name: str) -> list[float]:
        w = weights.pop(name)
        if w.fmt not in ("f32", "f16"):
            raise ModelFormatError(f"{path}: tensor {name!r} must be F32 or F16, not {w.fmt}")
        return [float(v) for v in np.asarray(w.data, dtype=np.float64).reshape(-1)]

    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if not isinstance(orig, int) or orig <= 0:
        raise ModelFormatError(f"{path}: rope_factors tensors need '{arch}.rope.scaling.original_context_length'")
    params: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors("rope_factors_long"),
                              "short_factor": factors("rope_factors_short"),
                              "original_max_position_embeddings": orig}
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if isinstance(attn, (int, float)):
        params["attention_factor"] = float(attn)
    return _rope_scaling(str(path), f"{arch}.rope.scaling", params, config.max_position_embeddings, {})


def gguf_family_config(path: Path, spec: ArchSpec, arch: str, meta: dict[str, Any], reader: GGUFFile,
                       weights: dict[str, WeightData], config: ModelConfig) -> ModelConfig:
    """Add the family traits and per-layer attention of a GGUF file to its base ModelConfig."""
    def key(suffix: str) -> Any:
        return meta.get(f"{arch}.{suffix}")

    scaling = config.rope_scaling
    if scaling is not None:
        kind = scaling.get("rope_type")
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"{path}: metadata '{arch}.rope.scaling.type' {kind!r} is not "
                                        f"supported (supported: {', '.join(ROPE_TYPES)})")
    scaling = _gguf_longrope(path, arch, meta, weights, config)
    window = key("attention.sliding_window")
    window = int(window) if isinstance(window, int) and window > 0 else 0
    local_theta = key("rope.freq_base_swa") or spec.local_rope_theta or config.rope_theta
    moe = _moe_fields(str(path), key("expert_count"), key("expert_used_count"),
                      key("expert_feed_forward_length") or config.intermediate_size)
    layers = tuple(dataclasses.replace(
        LayerConfig(window, float(local_theta), None if spec.scaling_global_only else scaling)
        if sliding and window else LayerConfig(0, config.rope_theta, scaling),
        moe=bool(moe[0]) and f"layers.{i}.router" in weights)  # llama.cpp: a layer with a router is sparse
        for i, sliding in enumerate(_gguf_sliding_layers(reader, arch, spec, config.num_layers)))
    query_scale = 0.0
    if spec.gguf_wide_query_layers:
        wide = config.num_layers == spec.gguf_wide_query_layers
        query_scale = (config.hidden_size / config.num_heads if wide else config.head_dim) ** -0.5
    return dataclasses.replace(
        config,
        rope_scaling=scaling,
        hidden_act=spec.activation,
        layers=layers,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        sandwich_norms=spec.sandwich_norms,
        embedding_scale=math.sqrt(config.hidden_size) if spec.scale_embeddings else 1.0,
        query_scale=query_scale,
        attn_softcap=_softcap(key("attn_logit_softcapping")),
        final_softcap=_softcap(key("final_logit_softcapping")),
        qk_norm_per_head=spec.qk_norm_per_head,
        norm_topk_prob=bool(key("expert_weights_norm") if key("expert_weights_norm") is not None
                            else spec.norm_topk_prob),
        num_experts=moe[0],
        num_experts_per_tok=moe[1],
        moe_intermediate_size=moe[2],
        shared_expert_intermediate_size=_shared_expert_width(
            str(path), spec, f"{arch}.expert_shared_feed_forward_length", key("expert_shared_feed_forward_length"),
            moe[0]),
    )
