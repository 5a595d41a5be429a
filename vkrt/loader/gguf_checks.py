"""Checks of GGUF files that parse but are wrong: metadata keys with the wrong GGUF type,
and (opt-in, like llama.cpp's `--check-tensors`) NaN / Inf in weights.

The value checks in `validate.py` look at decoded Python values, so a `rope.freq_base`
stored as UINT32 (an int, a finite number) or a `token_type` array of FLOAT32 passed them.
llama.cpp refuses those files (`key ... has wrong type`); here every key vkrt reads is
compared with the GGUF type llama.cpp's converter writes (gguf-py's `GGUFWriter.add_*`),
accepting any integer width where only the value matters (counts, token ids), as
llama.cpp's array readers accept INT32 and UINT32 alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGUFValueType as T

from vkrt.core.formats import FORMATS
from vkrt.errors import ModelFormatError
from vkrt.loader.config import WeightData

INTS = frozenset({T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64})
FLOATS = frozenset({T.FLOAT32, T.FLOAT64})


class Kind:
    """What a key's GGUF type may be: scalars of `scalar`, or arrays of `element`."""

    def __init__(self, text: str, scalar: frozenset[T] = frozenset(), element: frozenset[T] = frozenset()) -> None:
        self.text, self.scalar, self.element = text, scalar, element

    def accepts(self, types: list[T]) -> bool:
        if types and types[0] == T.ARRAY:
            return len(types) > 1 and types[1] in self.element
        return bool(types) and types[0] in self.scalar


COUNT = Kind("an integer, or an array of integers per layer", INTS, INTS)
INT = Kind("an integer", INTS)
FLOAT = Kind("a FLOAT32", FLOATS)
BOOL = Kind("a BOOL", frozenset({T.BOOL}))
STRING = Kind("a STRING", frozenset({T.STRING}))
STRINGS = Kind("an array of STRING", element=frozenset({T.STRING}))
INT_ARRAY = Kind("an array of INT32", element=INTS)
FLOAT_ARRAY = Kind("an array of FLOAT32", element=FLOATS)
BOOL_ARRAY = Kind("an array of BOOL", element=frozenset({T.BOOL}))

# `<arch>.<suffix>` keys vkrt reads.
ARCH_KEYS: dict[str, Kind] = {
    **{s: COUNT for s in (
        "context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.sliding_window",
        "rope.dimension_count", "rope.scaling.original_context_length", "expert_count", "expert_used_count",
        "expert_feed_forward_length", "expert_shared_feed_forward_length", "expert_shared_count",
        "expert_group_count", "expert_group_used_count", "expert_gating_func", "leading_dense_block_count",
        "nextn_predict_layers",
        "full_attention_interval", "shortconv.l_cache", "ssm.conv_kernel", "ssm.group_count", "ssm.inner_size",
        "ssm.state_size", "ssm.time_step_rank", "vocab_size")},
    **{s: FLOAT for s in (
        "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base", "rope.freq_base_swa",
        "rope.scaling.factor", "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow", "rope.scale_linear", "attn_logit_softcapping", "final_logit_softcapping",
        "expert_weights_scale", "attention.scale", "embedding_scale", "residual_scale", "logit_scale")},
    "expert_weights_norm": BOOL, "rope.scaling.finetuned": BOOL, "rope.scaling.type": STRING,
    "attention.recurrent_layers": BOOL_ARRAY, "rope.dimension_sections": INT_ARRAY,
}
KEYS: dict[str, Kind] = {
    "general.architecture": STRING, "general.name": STRING, "general.alignment": INT, "general.file_type": INT,
    "tokenizer.ggml.model": STRING, "tokenizer.ggml.pre": STRING, "tokenizer.chat_template": STRING,
    "tokenizer.ggml.tokens": STRINGS, "tokenizer.ggml.merges": STRINGS, "tokenizer.ggml.token_type": INT_ARRAY,
    "tokenizer.ggml.scores": FLOAT_ARRAY, "tokenizer.ggml.add_bos_token": BOOL, "tokenizer.ggml.add_eos_token": BOOL,
    "tokenizer.ggml.add_space_prefix": BOOL,
    **{f"tokenizer.ggml.{name}_token_id": INT
       for name in ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "mask")},
}


def _type_name(types: list[T]) -> str:
    if types and types[0] == T.ARRAY and len(types) > 1:
        return f"an array of {types[1].name}"
    return types[0].name if types else "(no type)"


def metadata_types(source: str, fields: Mapping[str, Any], arch: str) -> None:
    """Raise unless every key vkrt reads has a GGUF type llama.cpp would accept for it.

    `fields` maps key -> GGUFField (its `types` as GGUFReader gives them)."""
    for key, field in fields.items():
        suffix = key[len(arch) + 1:] if arch and key.startswith(f"{arch}.") else None
        kind = ARCH_KEYS.get(suffix) if suffix is not None else KEYS.get(key)
        if kind is not None and not kind.accepts(field.types):
            raise ModelFormatError(f"{source}: metadata {key} is stored as {_type_name(field.types)}, but it must "
                                   f"be {kind.text}; the file is corrupt or was written by a broken converter")


def bpe_merges(source: str, merges: Any) -> None:
    """A byte-level BPE (`gpt2`) vocabulary needs its merges: without them every word falls
    apart into single bytes, which the model never saw (llama.cpp refuses such a file too)."""
    if not merges:
        raise ModelFormatError(f"{source}: the BPE (gpt2) tokenizer has no tokenizer.ggml.merges; the file is "
                               "incomplete, convert the model again")


# ---- --check-tensors ------------------------------------------------------------------

_CHUNK_BYTES = 64 << 20  # bounded temporaries whatever the tensor's size


def _nonfinite_count(values: np.ndarray) -> int:
    """Non-finite entries of float32/float16 values, or of bf16 bit patterns (uint16)."""
    flat = values.reshape(-1)
    step = max(1, _CHUNK_BYTES // max(1, flat.itemsize))
    bad = 0
    for at in range(0, flat.size, step):
        chunk = flat[at:at + step]
        if chunk.dtype == np.uint16:  # bf16: all exponent bits set is Inf or NaN
            bad += int(np.count_nonzero((chunk & 0x7F80) == 0x7F80))
        else:
            bad += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
    return bad


def _scales(weight: WeightData) -> list[tuple[str, np.ndarray]]:
    """A block format's f16 scale fields (d, dmin, m) as float16 arrays; a float weight itself."""
    fmt = FORMATS[weight.fmt]
    if not fmt.is_block:
        return [("values", weight.data)]
    blocks = weight.data.reshape(-1, fmt.block_bytes)
    return [(f.name, np.ascontiguousarray(fmt.field(blocks, f.name)).view(np.float16))
            for f in fmt.fields if f.kind == "f16"]


def tensor_values(source: str, weights: Mapping[str, WeightData], file_names: Mapping[str, str] | None = None) -> None:
    """Raise on the first weight holding NaN or Inf: in its values (float formats) or in its
    blocks' f16 scales (block formats; a NaN scale makes the whole block NaN).

    Opt-in: it reads every float weight and every block's scales once (see RELIABILITY.md).
    `file_names` maps canonical names to the file's tensor names, which the message uses."""
    for name, weight in weights.items():
        for field, values in _scales(weight):
            bad = _nonfinite_count(values)
            if bad:
                where = "values" if field == "values" else f"{weight.fmt.upper()} block scales ({field})"
                shown = (file_names or {}).get(name, name)
                raise ModelFormatError(f"{source}: tensor {shown} has {bad} NaN or Inf {where}; the file is "
                                       "corrupt, download or convert it again")
