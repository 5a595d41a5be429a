"""config.json and GGUF metadata -> one ModelConfig, with per-layer attention and rope.

One normalisation serves both formats. A GGUF file's metadata is first read into config.json's
field names (`gguf_fields` in vkrt/loader/gguf_fields.py, as transformers' GGUF loader maps them,
with the layer pattern, query scale and sparse layers llama.cpp derives spelled as config.json
would), then
`model_config` builds the ModelConfig from those fields once, taking each family trait from the
ArchSpec row once. Errors name a field as its file spells it (`ConfigFields.name`).

Both spellings of config.json's rope settings are read: the top-level `rope_theta` /
`rope_scaling` (and Gemma 3's `rope_local_base_freq`) of transformers < 5, and
transformers 5's `rope_parameters`, either one dict or one per layer type
(`{"full_attention": {...}, "sliding_attention": {...}}`). Whatever the source, a model
sees `ModelConfig.layers`: each layer's window, rope base and rope scaling.

Adding a family: its ArchSpec row (vkrt/loader/arch.py: names, traits); a trait the file
spells goes into `model_config` here (and, if GGUF spells it differently, into `gguf_fields`);
the model reads the ModelConfig field where it computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.arch_spec import ArchSpec
from vkrt.loader.config import LayerConfig, ModelConfig, Multipliers
from vkrt.loader.layer_shapes import layer_shapes, per_layer_inputs
from vkrt.loader.llama4 import llama4_config
from vkrt.loader.mla import latent_attention_config
from vkrt.ops.moe import MAX_ROUTER_GROUPS
from vkrt.ops.recurrent import MAX_CONV_KERNEL

log = logging.getLogger(__name__)

# The rope scaling types vkrt computes (vkrt/models/rope.py), checked here once for both formats.
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")
# Numbers each type needs, and numbers that must be positive where given (transformers' names).
_ROPE_NEEDS: dict[str, tuple[str, ...]] = {"default": (), "linear": ("factor",),
                                           "llama3": ("factor", "original_max_position_embeddings"),
                                           "longrope": ("short_factor", "long_factor"),
                                           "yarn": ("factor", "original_max_position_embeddings"),
                                           "proportional": ()}
_ROPE_POSITIVE = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                  "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# config.json's MLP activation -> ModelConfig.hidden_act (relu2: ungated, max(x, 0)^2 of up alone)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "relu2": "relu2"}
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # attention: whether it slides
MAX_POSITIONS = 2**31 - 1  # positions are int32 on every backend
MAX_EXPERTS = 4096  # bounds the per-expert loops before any runs (real models: <= 512)


@dataclass(frozen=True)
class ConfigFields:
    """A model's hyper-parameters under config.json's names: a config.json as it is, or GGUF
    metadata read into those names. `spelled` maps a name to how the file spells it (GGUF
    metadata keys), for messages; `norm_offset_stored`: the file's norm weights already hold
    the family's (1 + w) offset (llama.cpp folds it; HF Gemma does not)."""

    source: str
    values: dict[str, Any]
    spelled: dict[str, str] = field(default_factory=dict)
    norm_offset_stored: bool = False

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def name(self, key: str) -> str:
        return self.spelled.get(key, key)


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _rope_scaling(src: ConfigFields, fieldname: str, params: dict[str, Any] | None, max_positions: int,
                  ) -> dict[str, Any] | None:
    """transformers' rope parameters (one layer type) -> vkrt's scaling dict, or None for plain
    RoPE; every check of a scaling is here."""
    if not params:
        return None
    scaling = {k: v for k, v in params.items()
               if k not in ("rope_theta", "type", "partial_rotary_factor", "llama_4_scaling_beta")}
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    type_name = src.name(f"{fieldname}.rope_type")
    if not isinstance(kind, str):
        raise ModelFormatError(f"{src.source}: {type_name} is {kind!r}, but it must be a string; the model's "
                               "config is corrupt")
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{src.source}: {type_name} {kind!r} is not supported "
                                    f"(supported: {', '.join(ROPE_TYPES)})")
    for key in _ROPE_POSITIVE:
        value = scaling.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value <= 0):
            raise ModelFormatError(f"{src.source}: {src.name(f'{fieldname}.{key}')} is {value!r}, but it must be "
                                   "a positive number; the model's config is corrupt")
    if kind == "default":
        return None
    scaling["rope_type"] = kind
    if kind == "proportional":  # Gemma 4: the fraction of each head's frequency pairs that rotate
        fraction = params.get("partial_rotary_factor", 1.0)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ModelFormatError(f"{src.source}: {src.name(f'{fieldname}.partial_rotary_factor')} is "
                                   f"{fraction!r}, but it must be a number in (0, 1]")
        scaling["partial_rotary_factor"] = float(fraction)
    if kind in ("longrope", "yarn"):
        _context_extension(src, fieldname, kind, scaling, max_positions)
    for key in _ROPE_NEEDS[kind]:
        if scaling.get(key) is None:
            raise ModelFormatError(f"{src.source}: {fieldname} of rope_type {kind!r} has no {key!r}")
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
        raise ModelFormatError(f"{src.source}: {fieldname}.high_freq_factor must differ from low_freq_factor; "
                               "the model's config is corrupt")
    return scaling


def _context_extension(src: ConfigFields, fieldname: str, kind: str, scaling: dict[str, Any],
                       max_positions: int) -> None:
    """longrope's and YaRN's original context and factor (transformers' default: the context
    extension), and the factor cos and sin are scaled by when the file gives none: 1 when nothing
    is extended, else longrope's sqrt(1 + ln(factor) / ln(original context)), YaRN's
    0.1 ln(factor) + 1 or, with mscale and mscale_all_dim,
    (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1)."""
    orig = scaling.get("original_max_position_embeddings") or src.get("original_max_position_embeddings")
    if not is_int(orig) or orig <= 0:
        raise ModelFormatError(f"{src.source}: {fieldname}: {kind} needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = orig
    factor = scaling["factor"] = float(scaling.get("factor") or max_positions / orig)
    if scaling.get("attention_factor") is not None:
        return
    log_factor = math.log(factor) if factor > 1.0 else 0.0
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not log_factor:
        scaling["attention_factor"] = 1.0
    elif kind == "longrope":
        scaling["attention_factor"] = math.sqrt(1 + log_factor / math.log(orig))
    elif mscale and mscale_all_dim:
        scaling["attention_factor"] = (0.1 * mscale * log_factor + 1.0) / (0.1 * mscale_all_dim * log_factor + 1.0)
    else:
        scaling["attention_factor"] = 0.1 * log_factor + 1.0


def _query_temperature(src: ConfigFields) -> dict[str, Any]:
    """Ministral 3's query temperature (rope_parameters' llama_4_scaling_beta; queries times
    1 + beta ln(1 + floor(p / original_max_position_embeddings))), checked; {} without one."""
    params = src.get("rope_parameters")
    params = params if isinstance(params, dict) else src.get("rope_scaling")
    beta = params.get("llama_4_scaling_beta") if isinstance(params, dict) else None
    if not beta:
        return {}
    name = src.name("rope_parameters.llama_4_scaling_beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ModelFormatError(f"{src.source}: {name} is {beta!r}, but it must be a number >= 0")
    length = params.get("original_max_position_embeddings")
    if not is_int(length) or length <= 0:
        raise ModelFormatError(f"{src.source}: {name} needs original_max_position_embeddings beside it")
    return {"query_temperature_beta": float(beta), "query_temperature_length": length}


def _rope_by_layer_type(src: ConfigFields, spec: ArchSpec,
                        max_positions: int) -> dict[bool, tuple[float, dict[str, Any] | None]]:
    """{is_sliding: (rope_theta, scaling)} from either spelling of the rope settings."""
    params = src.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        per_type = {sliding: params.get(name) or {} for name, sliding in _LAYER_TYPES.items()}
        field_of = {sliding: f"rope_parameters.{name}" for name, sliding in _LAYER_TYPES.items()}
    else:
        base = dict(params) if isinstance(params, dict) else dict(src.get("rope_scaling") or {})
        base.setdefault("rope_theta", src.get("rope_theta", 10000.0))
        local = dict(base)
        if spec.local_rope_theta:  # Gemma 3: its own local base; the scaling is global only
            local = {"rope_theta": src.get("rope_local_base_freq", spec.local_rope_theta)}
        elif spec.sliding_rope_unscaled:
            local = {"rope_theta": src.get("rope_local_base_freq", base["rope_theta"])}
        per_type = {False: base, True: local}
        name = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
        field_of = {False: name, True: name}
    out: dict[bool, tuple[float, dict[str, Any] | None]] = {}
    for sliding, p in per_type.items():
        theta = p.get("rope_theta", src.get("rope_theta"))
        if theta is None:
            theta = spec.local_rope_theta if sliding and spec.local_rope_theta else 10000.0
        out[sliding] = (float(theta), _rope_scaling(src, field_of[sliding], p, max_positions))
    return out


def _rotary_dim(src: ConfigFields, head_dim: int) -> int:
    """Dims of each head that RoPE rotates: head_dim times `partial_rotary_factor` (top level
    or in the rope parameters), as transformers computes it, else MiniMax-M2's `rotary_dim`; 0 when
    every dim rotates."""
    params = src.get("rope_parameters")
    key, factor = "partial_rotary_factor", src.get("partial_rotary_factor")
    if factor is None and isinstance(params, dict):
        inner = params.get("full_attention", params)
        # (proportional RoPE spans the whole head: its partial factor zeroes frequencies instead)
        if isinstance(inner, dict) and inner.get("rope_type") != "proportional":
            factor = inner.get("partial_rotary_factor")
    if factor is None and src.get("rotary_dim") is not None:
        key, dims = "rotary_dim", src.get("rotary_dim")
        factor = dims / head_dim if is_int(dims) and head_dim > 0 else dims
    if factor is None or factor == 1.0:
        return 0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        bound = f"a count of dims from 2 to head_dim ({head_dim})" if key == "rotary_dim" else "a number in (0, 1]"
        raise ModelFormatError(f"{src.source}: {src.name(key)} is {src.get(key, factor)!r}, but it must "
                               f"be {bound}; the model's config is corrupt")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise UnsupportedModelError(f"{src.source}: {src.name(key)} {src.get(key, factor)} rotates "
                                    f"{rotary} of {head_dim} dims per head; RoPE needs an even number")
    return 0 if rotary == head_dim else rotary


def _layer_kinds(src: ConfigFields, spec: ArchSpec, num_layers: int) -> list[tuple[str, bool]]:
    """(mixer, sliding) of each layer: from `layer_types`, else the family's sliding rule."""
    types = src.get("layer_types")
    if types is None:
        rule: Callable[[int, dict[str, Any]], bool] | None = spec.default_sliding
        return [(spec.default_mixer, bool(rule and rule(i, src.values))) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelFormatError(f"{src.source}: {src.name('layer_types')} must list one type per layer ({num_layers})")
    known = [*_LAYER_TYPES, *spec.mixer_types]
    attention = [t for t, mixer in spec.mixer_types.items() if mixer == "attention"]  # a family's own name for it
    for t in types:
        if t not in known:
            raise UnsupportedModelError(f"{src.source}: {src.name('layer_types')} entry {t!r} is not supported "
                                        f"(supported: {', '.join(known)})")
    return [(spec.mixer_types.get(t, "attention"), _LAYER_TYPES.get(t, False) and t not in attention) for t in types]


def _rotated_layers(src: ConfigFields, num_layers: int) -> list[bool]:
    """SmolLM3's `no_rope_layers`: 1 where the layer uses RoPE, 0 where it does not (NoPE);
    Granite 4's position_embedding_type "nope": no layer rotates."""
    if src.get("position_embedding_type") not in (None, "rope"):
        if src.get("position_embedding_type") != "nope":
            raise UnsupportedModelError(f"{src.source}: position_embedding_type "
                                        f"{src.get('position_embedding_type')!r} is not supported (rope, nope)")
        return [False] * num_layers
    flags = src.get("no_rope_layers")
    if flags is None:
        return [True] * num_layers
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ModelFormatError(f"{src.source}: no_rope_layers must list 0 or 1 for each of the {num_layers} layers")
    return [bool(f) for f in flags]


def _moe_fields(src: ConfigFields) -> tuple[int, int, int]:
    """ModelConfig's expert count, experts per token and expert FFN width, checked (0s: dense)."""
    experts = src.get("num_experts", src.get("num_local_experts"))
    if experts in (None, 0):
        return 0, 0, 0
    per_token = src.get("num_experts_per_tok")
    expert_ffn = src.get("moe_intermediate_size") or src.get("intermediate_size")
    for key, value, top in (("num_experts", experts, MAX_EXPERTS), ("num_experts_per_tok", per_token, experts),
                            ("moe_intermediate_size", expert_ffn, None)):
        if not is_int(value) or value < 1 or (top is not None and value > top):
            bound = f" and at most {top}" if top is not None else ""
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive integer{bound}, got {value!r}")
    return experts, per_token, expert_ffn


def _shared_expert_width(src: ConfigFields, spec: ArchSpec, experts: int) -> int:
    """The shared expert's FFN width of a family that has one (0: none), checked."""
    if not (spec.shared_expert and experts):
        return 0
    value = src.get("shared_expert_intermediate_size")
    count, width = src.get("n_shared_experts"), src.get("moe_intermediate_size")
    if value is None and is_int(count) and count >= 1 and is_int(width):  # GLM-4.5: that many experts' width
        value = count * width
    if not is_int(value) or value < 1:
        raise ModelFormatError(f"{src.source}: {src.name('shared_expert_intermediate_size')} must be a positive "
                               f"integer, got {value!r}")
    return value


def _sparse_layers(src: ConfigFields, num_layers: int) -> list[bool]:
    """Qwen3-MoE's rule: layer i is sparse unless listed in mlp_only_layers, every
    decoder_sparse_step-th layer (both default to every layer: Mixtral, OLMoE); LFM2-MoE's first
    num_dense_layers are dense."""
    step = src.get("decoder_sparse_step") or 1
    first = src.get("num_dense_layers") or 0
    if not is_int(first) or first < 0:
        raise ModelFormatError(f"{src.source}: {src.name('num_dense_layers')} must be a count, got {first!r}")
    dense = [*(src.get("mlp_only_layers") or []), *range(min(first, num_layers))]
    kinds = src.get("mlp_layer_types")  # GLM-4 MoE Lite's "dense" / "sparse" per layer
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
            raise ModelFormatError(f"{src.source}: mlp_layer_types must list \"dense\" or \"sparse\" for each of the "
                                   f"{num_layers} layers")
        dense += [i for i, kind in enumerate(kinds) if kind == "dense"]
    if not is_int(step) or step < 1:
        raise ModelFormatError(f"{src.source}: decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(dense, list) or any(not is_int(i) for i in dense):
        raise ModelFormatError(f"{src.source}: mlp_only_layers must be a list of layer indices")
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def _positive(src: ConfigFields, key: str) -> float:
    """An optional positive multiplier (0.0 when absent)."""
    value = src.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive number, got {value!r}")
    return float(value)


def _softcap(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def model_config(src: ConfigFields, spec: ArchSpec, name: str, generation: dict[str, Any] | None = None,
                 ) -> ModelConfig:
    """The one normalisation: `src`'s fields (+ generation_config.json) of family `spec` -> ModelConfig."""

    def need(key: str) -> Any:
        if src.get(key) is None:
            raise ModelFormatError(f"{src.source}: required field {key!r} is missing")
        return src.values[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    num_layers = int(need("num_hidden_layers"))
    head_dim = int(src.get("head_dim") or hidden // heads)
    max_positions = int(src.get("max_position_embeddings", 2048))
    if max_positions > MAX_POSITIONS:
        log.warning("%s: context length %d is beyond 32-bit positions; capped at %d (--max-model-len "
                    "decides what is used)", src.source, max_positions, MAX_POSITIONS)
        max_positions = MAX_POSITIONS
    act_field = "hidden_activation" if src.get("hidden_activation") else "hidden_act"
    act = str(src.get(act_field) or spec.activation)
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{src.source}: {act_field} {act!r} is not supported "
                                    f"(supported: {', '.join(ACTIVATIONS)})")
    rope = _rope_by_layer_type(src, spec, max_positions)
    window = src.get("sliding_window")
    window = int(window) if is_int(window) and window > 0 else 0
    moe = _moe_fields(src) if not spec.moe_flag or src.get(spec.moe_flag) else (0, 0, 0)
    if src.get("use_bidirectional_attention") == "all":  # (an encoder: "vision" leaves text causal)
        raise UnsupportedModelError(f"{src.source}: use_bidirectional_attention is 'all': every token attends to "
                                    "every other, which a causal decoder does not run")
    for flag in spec.hf_refused_flags:
        if src.get(flag):
            raise UnsupportedModelError(f"{src.source}: {src.name(flag)} is set; vkrt does not run the weights it "
                                        f"adds to a {spec.name} model")
    if moe[0] and src.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{src.source}: clip_qkv is not supported")
    if spec.one_sublayer:  # Nemotron-H: its "moe" blocks are the sparse ones (and its dense
        sparse = [t == "moe" for t in src.get("layer_types") or []]  # configs carry expert fields too)
        moe = moe if any(sparse) else (0, 0, 0)
        sparse = sparse if moe[0] else [False] * num_layers
    else:
        sparse = _sparse_layers(src, num_layers) if moe[0] else [False] * num_layers
    layers = tuple(LayerConfig(window if sliding else 0, *rope[bool(sliding and window)],
                               rotated and not (spec.global_nope_with_window and window and not sliding), is_moe, mixer,
                               mlp=not spec.one_sublayer or mixer == "none",
                               post_norms=spec.attention_post_norms and mixer == "attention")
                   for (mixer, sliding), rotated, is_moe in zip(_layer_kinds(src, spec, num_layers),
                                                                _rotated_layers(src, num_layers), sparse, strict=True))
    layers = layer_shapes(src, layers, heads)
    conv_kernel = _conv_kernel(src, layers)
    scalar = src.get("query_pre_attn_scalar")
    query_scale = float(scalar) ** -0.5 if isinstance(scalar, (int, float)) and scalar > 0 else 0.0
    embedding_scale = math.sqrt(hidden) if spec.scale_embeddings else 1.0
    # Granite's multipliers (absent elsewhere): the attention one is the score scale itself.
    query_scale = _positive(src, "attention_multiplier") or query_scale
    embedding_scale = _positive(src, "embedding_multiplier") or embedding_scale
    logits_scaling = _positive(src, "logits_scaling")
    lm_head_multiplier = _positive(src, "lm_head_multiplier")  # Falcon-H1's: logits times it
    eos_ids: list[int] = []
    for value in (src.get("eos_token_id"), (generation or {}).get("eos_token_id")):
        eos_ids += [i for i in _int_list(value) if i not in eos_ids]
    bos = src.get("bos_token_id")
    config = ModelConfig(
        architecture=spec.name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=_ffn_width(src, int(need("intermediate_size"))),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(src.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(src.get("rms_norm_eps", src.get("norm_eps", 1e-6))),
        rope_theta=rope[False][0],
        rope_scaling=rope[False][1],
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        hidden_act=ACTIVATIONS[act],
        bos_token_id=bos if is_int(bos) else None,
        eos_token_ids=tuple(eos_ids),
        name=name,
        layers=layers,
        rotary_dim=_rotary_dim(src, head_dim),
        rope_interleaved=spec.rope_interleaved,
        conv_kernel=conv_kernel,
        conv_bias=bool(conv_kernel and src.get("conv_bias", src.get("mamba_conv_bias", False))),
        attn_output_gate=spec.attn_output_gate,
        v_norm=spec.v_norm,
        **per_layer_inputs(src),
        **_delta_net(src, layers),
        **_mamba(src, layers),
        **_multipliers(src, spec),
        **_query_temperature(src),
        linear_v_heads_tiled=bool(src.get("linear_v_heads_tiled", False)),
        linear_decay_stored=bool(src.get("linear_decay_stored", False)),
        linear_beta_scale=2.0 if src.get("linear_allow_neg_eigval") else 1.0,
        linear_norm_eps=spec.linear_norm_eps,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm and (not spec.qk_norm_optional or bool(src.get("use_qk_norm", True))),
        sandwich_norms=spec.sandwich_norms,
        norm_offset=0.0 if src.norm_offset_stored else spec.hf_norm_offset,
        embedding_scale=embedding_scale,
        query_scale=query_scale,
        attn_softcap=_softcap(src.get("attn_logit_softcapping")),
        final_softcap=_softcap(src.get("final_logit_softcapping")),
        residual_scale=_positive(src, "residual_multiplier") or 1.0,
        logit_scale=1.0 / logits_scaling if logits_scaling else lm_head_multiplier or 1.0,
        qk_norm_per_head=spec.qk_norm_per_head,
        norm_topk_prob=bool(src.get("norm_topk_prob", spec.norm_topk_prob)),
        num_experts=moe[0],
        num_experts_per_tok=moe[1],
        moe_intermediate_size=moe[2],
        shared_expert_intermediate_size=_shared_expert_width(src, spec, moe[0]),
        shared_expert_gated=spec.shared_expert_gated,
        moe_beside_mlp=bool(moe[0]) and spec.moe_beside_mlp,
        moe_router=spec.moe_router,
        expert_bias=bool(moe[0] and spec.moe_router == "sigmoid" and src.get("use_expert_bias", False)),
        routed_scaling_factor=(_positive(src, "routed_scaling_factor") or 1.0) if spec.moe_router == "sigmoid" else 1.0,
        router_norm_eps=spec.router_norm_eps,
        **_expert_groups(src, spec, moe),
        **_clamped_swiglu(src, spec),
    )
    if spec.chunked_attention:
        return llama4_config(src, config)
    return latent_attention_config(src, config) if spec.default_mixer == "mla" else config


def _clamped_swiglu(src: ConfigFields, spec: ArchSpec) -> dict[str, Any]:
    """gpt-oss's expert activation: swiglu_limit and swiglu_alpha (transformers' defaults 7, 1.702)."""
    if not spec.clamped_swiglu:
        return {}
    limit, alpha = src.get("swiglu_limit", 7.0), src.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive number, got {value!r}")
    return {"swiglu_limit": float(limit), "swiglu_alpha": float(alpha)}


def _expert_groups(src: ConfigFields, spec: ArchSpec, moe: tuple[int, int, int]) -> dict[str, Any]:
    """The sigmoid router's expert groups (n_group, topk_group), checked; Nemotron-H's latent
    expert projection (moe_latent_size), which vkrt does not run, refused."""
    experts, per_token, _ = moe
    if not experts:
        return {}
    if src.get("moe_latent_size") is not None:
        raise UnsupportedModelError(f"{src.source}: {src.name('moe_latent_size')} {src.get('moe_latent_size')!r}: "
                                    "experts working in a latent projection are not supported yet")
    groups, top = src.get("n_group") or 1, src.get("topk_group") or 1
    if not (is_int(groups) and is_int(top) and 1 <= top <= groups and experts % groups == 0
            and (groups == 1 or experts // groups >= 2) and groups <= MAX_ROUTER_GROUPS):
        raise ModelFormatError(f"{src.source}: {src.name('n_group')} {groups!r} and {src.name('topk_group')} {top!r} "
                               f"must split the {experts} experts into equal groups of at least 2 (at most "
                               f"{MAX_ROUTER_GROUPS} groups) and choose from 1 to all of them")
    if groups > 1 and spec.moe_router != "sigmoid":
        raise UnsupportedModelError(f"{src.source}: expert groups ({src.name('n_group')} {groups}) with "
                                    f"{spec.moe_router} routing are not supported yet")
    if per_token > top * (experts // groups):
        raise ModelFormatError(f"{src.source}: {src.name('num_experts_per_tok')} {per_token} is more than the "
                               f"{top * (experts // groups)} experts of the {top} groups chosen from")
    return {"moe_groups": groups, "moe_top_groups": top}


def _conv_kernel(src: ConfigFields, layers: tuple[LayerConfig, ...]) -> int:
    """The convolution's taps where a layer convolves (LFM2's conv_L_cache, a delta net's
    linear_conv_kernel_dim), checked; else 0."""
    mixers = {layer.recurrent for layer in layers}
    key = next((k for mixer, k in (("short_conv", "conv_L_cache"), ("gated_delta_net", "linear_conv_kernel_dim"),
                                   ("mamba2", "mamba_d_conv")) if mixer in mixers), "")
    if not key:
        return 0
    taps = src.get(key)
    if not is_int(taps) or not 2 <= taps <= MAX_CONV_KERNEL:
        raise UnsupportedModelError(f"{src.source}: {src.name(key)} is {taps!r}; vkrt convolves "
                                    f"2 to {MAX_CONV_KERNEL} taps")
    return taps


_DELTA_NET = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def _delta_net(src: ConfigFields, layers: tuple[LayerConfig, ...]) -> dict[str, Any]:
    """A gated delta net's head counts and dims (ModelConfig's fields of those names), checked."""
    if not any(layer.mixer == "gated_delta_net" for layer in layers):
        return {}
    out: dict[str, int] = {}
    for key in _DELTA_NET:
        value = src.get(key)
        if not is_int(value) or value < 1:
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive integer, got {value!r}")
        out[key] = value
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ModelFormatError(f"{src.source}: linear_num_value_heads ({out['linear_num_value_heads']}) must be "
                               f"a multiple of linear_num_key_heads ({out['linear_num_key_heads']})")
    return out


def _ffn_width(src: ConfigFields, width: int) -> int:
    """The MLP's width: LFM2 derives it from intermediate_size (block_auto_adjust_ff_dim: 2/3 of
    it, times block_ffn_dim_multiplier, rounded up to block_multiple_of), as transformers does;
    a Granite 4 hybrid without experts runs its shared MLP (shared_intermediate_size)."""
    if src.get("num_local_experts") == 0 and is_int(src.get("shared_intermediate_size")):
        return int(src.values["shared_intermediate_size"])
    if not src.get("block_auto_adjust_ff_dim"):
        return width
    width = int(2 * width / 3)
    multiplier = src.get("block_ffn_dim_multiplier")
    if multiplier is not None:
        width = int(multiplier * width)
        multiple = int(src.get("block_multiple_of", 256))
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _mamba(src: ConfigFields, layers: tuple[LayerConfig, ...]) -> dict[str, Any]:
    """Mamba2's heads, groups and state (ModelConfig's mamba_* fields), checked."""
    if not any(layer.recurrent == "mamba2" for layer in layers):
        return {}
    hidden = int(src.values["hidden_size"])
    heads, groups, state = (src.get(k) for k in ("mamba_n_heads", "mamba_n_groups", "mamba_d_state"))
    # Granite 4's inner width is mamba_expand x hidden, Falcon-H1's mamba_d_ssm when it says;
    # Nemotron-H's is simply heads x head_dim.
    d_ssm = src.get("mamba_d_ssm")
    inner = d_ssm if is_int(d_ssm) and d_ssm > 0 else int(src.get("mamba_expand", 2)) * hidden
    head_dim = src.get("mamba_d_head", "auto")
    if head_dim == "auto" and is_int(heads) and heads > 0:
        head_dim = inner // heads
    for key, value in (("mamba_n_heads", heads), ("mamba_n_groups", groups), ("mamba_d_state", state),
                       ("mamba_d_head", head_dim)):
        if not is_int(value) or value < 1:
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive integer, got {value!r}")
    assert is_int(heads) and is_int(groups) and is_int(head_dim)
    if src.get("mamba_expand") is not None and heads * head_dim != inner:
        raise ModelFormatError(f"{src.source}: {src.name('mamba_n_heads')} x {src.name('mamba_d_head')} must be "
                               f"the inner width ({'mamba_d_ssm' if d_ssm else 'mamba_expand x hidden_size'}: {inner})")
    if heads % groups:
        raise ModelFormatError(f"{src.source}: {src.name('mamba_n_heads')} ({heads}) must be a multiple of "
                               f"{src.name('mamba_n_groups')} ({groups})")
    if src.get("mamba_proj_bias"):
        raise UnsupportedModelError(f"{src.source}: {src.name('mamba_proj_bias')} (biases on the Mamba2 "
                                    "projections) is not supported")
    # (transformers' Nemotron-H clamps dt at time_step_min in its chunked prefill form but not in its
    # decode step; vkrt follows time_step_limit everywhere, as that decode step and llama.cpp do.)
    limit = src.get("time_step_limit") or (0.0, math.inf)
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or not all(isinstance(v, (int, float)) for v in limit):
        raise ModelFormatError(f"{src.source}: time_step_limit must be two numbers, got {limit!r}")
    # Falcon-H1 may norm before the gate or not at all (mamba_rms_norm, mamba_norm_before_gate).
    norm = "none" if not src.get("mamba_rms_norm", True) else (
        "before_gate" if src.get("mamba_norm_before_gate", False) else "after_gate")
    return {"mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_n_groups": groups, "mamba_state_size": state,
            "mamba_dt_min": float(limit[0]), "mamba_dt_max": float(limit[1]), "mamba_norm": norm}


def _multipliers(src: ConfigFields, spec: ArchSpec) -> dict[str, Any]:
    """Falcon-H1's muP multipliers (ModelConfig.multipliers), checked; a GGUF has them folded in."""
    if not spec.hf_multipliers:
        return {}
    for key in ("attention_bias", "mlp_bias", "projectors_bias"):
        if src.get(key):
            raise UnsupportedModelError(f"{src.source}: {src.name(key)} (biases on these projections) is not supported")

    def factor(key: str) -> float:
        value = src.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be a finite number, got {value!r}")
        return float(value)

    def factors(key: str, count: int) -> tuple[float, ...]:
        values = src.get(key) or [1.0] * count
        if (not isinstance(values, list) or len(values) != count
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)):
            raise ModelFormatError(f"{src.source}: {src.name(key)} must be {count} finite numbers, got {values!r}")
        return tuple(float(v) for v in values)

    gate, down = factors("mlp_multipliers", 2)
    z, x, b, c, dt = factors("ssm_multipliers", 5)
    return {"multipliers": Multipliers(
        attention_in=factor("attention_in_multiplier"), key=factor("key_multiplier"),
        attention_out=factor("attention_out_multiplier"), ssm_in=factor("ssm_in_multiplier"),
        ssm_out=factor("ssm_out_multiplier"), ssm_zxbcdt=(z, x, b, c, dt), mlp_gate=gate, mlp_down=down)}


def hf_fields(config_path: Path, cfg: dict[str, Any], spec: ArchSpec) -> ConfigFields:
    """A config.json as the normalisation reads it: the family's own field names (ArchSpec.hf_renames)
    and layer-pattern string (hf_pattern) in the names it reads, messages still naming the file's."""
    values, spelled = dict(cfg), {}
    for theirs, ours in spec.hf_renames.items():  # the family's own field is what its model reads
        if theirs in cfg:
            values[ours] = cfg[theirs]
            spelled[ours] = theirs
    pattern = cfg.get("hybrid_override_pattern")
    if spec.hf_pattern and values.get("layer_types") is None and pattern is not None:
        if not isinstance(pattern, str) or not pattern or any(ch not in spec.hf_pattern for ch in pattern):
            raise ModelFormatError(f"{config_path}: hybrid_override_pattern is {pattern!r}; it must be a string of "
                                   f"{', '.join(spec.hf_pattern)}")
        values["layer_types"] = [spec.hf_pattern[ch] for ch in pattern]
        spelled["layer_types"] = "hybrid_override_pattern"
    if spec.hf_pattern and isinstance(values.get("layer_types"), list) and values.get("num_hidden_layers") is None:
        values["num_hidden_layers"] = len(values["layer_types"])  # the pattern is the layer count
    for key, value in spec.hf_defaults.items():
        values.setdefault(key, value)
    if spec.nope_without_rope_parameters and not values.get("rope_parameters") and values.get("rope_theta") is None:
        values.setdefault("position_embedding_type", "nope")
    return ConfigFields(str(config_path), values, spelled)
