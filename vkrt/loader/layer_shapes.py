"""Per-layer attention and MLP shapes, K/V shared across layers and per-layer embeddings (Gemma 4),
from config.json.

Gemma 4's full-attention layers have heads of `global_head_dim` (and with `attention_k_eq_v`
their own `num_global_key_value_heads`), spelled by transformers 5.24 as `per_layer_config`
({layer: {"head_dim": ..., "num_key_value_heads": ...}}); its last `num_kv_shared_layers`
layers attend over the K/V of the last earlier layer of their own type and compute none
(transformers' `kv_sharing_modes`), and with `use_double_wide_mlp` their MLPs are twice as wide.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vkrt.errors import ModelFormatError
from vkrt.loader.config import LayerConfig

if TYPE_CHECKING:
    from vkrt.loader.normalize import ConfigFields


def _count(src: ConfigFields, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"{src.source}: {src.name(key)} must be a positive integer, got {value!r}")
    return value


def _optional(src: ConfigFields, key: str, value: Any) -> int:
    return 0 if value is None else _count(src, key, value)


def _overrides(src: ConfigFields, layers: tuple[LayerConfig, ...]) -> dict[int, tuple[int, int]]:
    """{layer: (head_dim, KV heads)} (0: the model's) from per_layer_config, or from
    global_head_dim / num_global_key_value_heads (with attention_k_eq_v) on the full-attention layers."""
    per_layer = src.get("per_layer_config")
    if isinstance(per_layer, dict):
        out: dict[int, tuple[int, int]] = {}
        for key, value in per_layer.items():
            if not str(key).isdigit() or int(key) >= len(layers) or not isinstance(value, dict):
                raise ModelFormatError(f"{src.source}: per_layer_config must map layer indices below "
                                       f"{len(layers)} to objects, got {key!r}: {value!r}")
            out[int(key)] = (_optional(src, f"per_layer_config.{key}.head_dim", value.get("head_dim")),
                              _optional(src, f"per_layer_config.{key}.num_key_value_heads",
                                        value.get("num_key_value_heads")))
        return out
    kv_heads = src.get("num_global_key_value_heads") if src.get("attention_k_eq_v") else None
    shape = (_optional(src, "global_head_dim", src.get("global_head_dim")),
             _optional(src, "num_global_key_value_heads", kv_heads))
    return {i: shape for i, layer in enumerate(layers) if layer.attends and not layer.window} if any(shape) else {}


def layer_shapes(src: ConfigFields, layers: tuple[LayerConfig, ...], num_heads: int) -> tuple[LayerConfig, ...]:
    """`layers` with their own head dims, KV heads, MLP widths, K = V and KV sources where the file says."""
    out = list(layers)
    for i, (head_dim, kv_heads) in _overrides(src, layers).items():
        if kv_heads and num_heads % kv_heads:
            raise ModelFormatError(f"{src.source}: layer {i}'s {kv_heads} KV heads do not divide its {num_heads} heads")
        out[i] = replace(out[i], head_dim=head_dim, num_kv_heads=kv_heads)
    if src.get("attention_k_eq_v"):
        out = [replace(layer, k_eq_v=layer.attends and not layer.window) for layer in out]
    shared = src.get("num_kv_shared_layers") or 0
    if shared:
        first = len(out) - _count(src, "num_kv_shared_layers", shared)
        width = 2 * _count(src, "intermediate_size", src.get("intermediate_size")) if src.get("use_double_wide_mlp") else 0
        for i in range(max(first, 0), len(out)):
            source = next((j for j in range(first - 1, -1, -1) if out[j].attends and out[j].window == out[i].window), -1)
            if source < 0:
                raise ModelFormatError(f"{src.source}: layer {i} shares the K/V of an earlier layer of its type "
                                       f"(num_kv_shared_layers {shared}), but none of the first {first} layers is one")
            out[i] = replace(out[i], kv_layer=source, intermediate_size=width)
    return tuple(out)


def per_layer_inputs(src: ConfigFields) -> dict[str, Any]:
    """The per-layer embeddings' width per layer and their table's vocabulary (ModelConfig's
    per_layer_input_size, per_layer_vocab_size), checked; {} without them."""
    width = src.get("hidden_size_per_layer_input")
    if not width:
        return {}
    vocab = src.get("vocab_size_per_layer_input", src.get("vocab_size"))
    for key, value in (("hidden_size_per_layer_input", width), ("vocab_size_per_layer_input", vocab)):
        _count(src, key, value)
    return {"per_layer_input_size": width, "per_layer_vocab_size": vocab}
