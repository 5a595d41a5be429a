"""Llama 4 text's config: which layers rotate, attend in chunks and route to experts, read as
transformers' Llama4TextConfig derives them.

RoPE layers (no_rope_layers[i] = 1, else all but every no_rope_layer_interval-th) attend within
attention_chunk_size-aligned chunks and norm q and k without weights (use_qk_norm); the others
(NoPE) attend to the whole context with queries times log(floor((p + 1) / floor_scale) + 1) *
attn_scale + 1 (attn_temperature_tuning). MoE layers (moe_layers, else every
interleave_moe_layer_step-th) route each token to one expert by sigmoid score, which scales the
expert's input, beside a shared expert; dense layers are intermediate_size_mlp wide.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.config import ModelConfig

if TYPE_CHECKING:
    from vkrt.loader.normalize import ConfigFields


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def llama4_config(src: ConfigFields, config: ModelConfig) -> ModelConfig:
    """`config` (normalised as Llama's) with Llama 4's per-layer traits from `src`."""
    n = config.num_layers
    rotated = _flags(src, "no_rope_layers", n)
    if rotated is None:
        interval = _count(src, "no_rope_layer_interval", 4)
        rotated = [(i + 1) % interval != 0 for i in range(n)]
    moe_layers = src.get("moe_layers")
    if moe_layers is None:
        step = _count(src, "interleave_moe_layer_step", 1)
        moe_layers = list(range(step - 1, n, step))
    if not isinstance(moe_layers, list) or any(not is_int(i) or not 0 <= i < n for i in moe_layers):
        raise ModelFormatError(f"{src.source}: moe_layers must list layer indices below {n}, got {moe_layers!r}")
    chunk = src.get("attention_chunk_size")
    if chunk is not None and (not is_int(chunk) or chunk < 1):
        raise ModelFormatError(f"{src.source}: attention_chunk_size must be a positive integer, got {chunk!r}")
    if config.num_experts and config.num_experts_per_tok != 1:
        raise UnsupportedModelError(f"{src.source}: num_experts_per_tok {config.num_experts_per_tok}: Llama 4's "
                                    "input-scaled experts run with one expert per token only")
    layers = tuple(replace(layer, rope=rot, moe=bool(config.num_experts) and i in moe_layers,
                           window=chunk if rot and chunk else 0, chunked=bool(rot and chunk))
                   for i, (layer, rot) in enumerate(zip(config.layers, rotated, strict=True)))
    dense = src.get("intermediate_size_mlp", config.intermediate_size)
    if not is_int(dense) or dense < 1:
        raise ModelFormatError(f"{src.source}: intermediate_size_mlp must be a positive integer, got {dense!r}")
    temperature: dict[str, Any] = {}
    if src.get("attn_temperature_tuning", True):
        scale, floor_scale = src.get("attn_scale", 0.1), _count(src, "floor_scale", 8192)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
            raise ModelFormatError(f"{src.source}: attn_scale must be a number >= 0, got {scale!r}")
        temperature = dict(query_temperature_beta=float(scale), query_temperature_length=floor_scale,
                           query_temperature_shift=1, query_temperature_nope_only=True)
    return replace(config, layers=layers, intermediate_size=dense, qk_l2_norm=bool(src.get("use_qk_norm", True)),
                   shared_expert_intermediate_size=config.moe_intermediate_size if config.num_experts else 0,
                   shared_expert_gated=False, moe_input_scaled=True, **temperature)


def _flags(src: ConfigFields, key: str, n: int) -> list[bool] | None:
    flags = src.get(key)
    if not flags:  # transformers derives the list when it is absent or empty
        return None
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ModelFormatError(f"{src.source}: {key} must list 0 or 1 for each of the {n} layers")
    return [bool(f) for f in flags]


def _count(src: ConfigFields, key: str, default: int) -> int:
    value = src.get(key, default)
    if not is_int(value) or value < 1:
        raise ModelFormatError(f"{src.source}: {key} must be a positive integer, got {value!r}")
    return value


def gguf_llama4(meta: dict[str, Any], arch: str, values: dict[str, Any]) -> None:
    """A llama4 GGUF's traits under config.json's names, as llama.cpp runs the file: the widths of
    the dense MLPs (feed_forward_length) and of the experts; the layers with a router sparse; chunks
    of 8192 on 3 of every 4 layers, the temperature's floor 8192 and scale 0.1 (the converter writes
    none of them), or, with attention.sliding_window 0, RoPE everywhere and no chunks; the QK-norm
    on all but the 128-expert model."""
    values["intermediate_size_mlp"] = values.get("intermediate_size")
    values["intermediate_size"] = values.get("moe_intermediate_size", values.get("intermediate_size"))
    values["interleave_moe_layer_step"] = meta.get(f"{arch}.interleave_moe_layer_step", 1)
    if values.get("num_experts"):
        dense = values.get("mlp_only_layers") or []
        values["moe_layers"] = [i for i in range(values["num_hidden_layers"]) if i not in dense]
    if values.pop("sliding_window", None) == 0:
        values |= {"attention_chunk_size": None, "no_rope_layers": [1] * values["num_hidden_layers"],
                   "attn_temperature_tuning": False}
    else:
        values |= {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "floor_scale": 8192, "attn_scale": 0.1}
    values["use_qk_norm"] = values.get("num_experts") != 128
