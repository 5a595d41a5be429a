"""What the loaders check before they trust a model file.

A model file is untrusted input: every count, offset, type and name in it is checked here
before anything is sized, looped over or opened from it. A failure is one ModelFormatError
(or UnsupportedModelError) that names the file, the field or tensor, and what to do. The
checks are generic over architectures: tensor names are checked through the canonical
names the `arch` tables map them to, hyper-parameters through `ModelConfig`.
"""

from __future__ import annotations

import logging
import math
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from vkrt.errors import ModelFormatError
from vkrt.loader.config import ModelConfig, WeightData

log = logging.getLogger(__name__)

GGML_MAX_DIMS = 4
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit


def _show(value: Any, limit: int = 60) -> str:
    """A file-supplied value for an error message: repr'd and cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- files and paths -------------------------------------------------------------------


def regular_file(path: Path) -> Path:
    """`path` if it is a regular file (a FIFO or device would block or never end)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ModelFormatError(
            f"{path}: not a regular file (a directory, pipe, socket or device); pass a .gguf file or a Hugging "
            "Face model directory"
        )
    return path


def confined_path(model_dir: Path, name: Any, source: Path) -> Path:
    """The file `name` (as written in `source`) inside `model_dir`; never a path outside it."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelFormatError(f"{source}: names the file {_show(name)}, which is not a file name; "
                               "re-download the model")
    rel = PurePosixPath(name.replace("\\", "/"))
    if not rel.parts or rel.is_absolute() or ".." in rel.parts or ":" in rel.parts[0]:
        raise ModelFormatError(
            f"{source}: names {_show(name)}, which is outside the model directory; model files "
            "may only name files next to them"
        )
    return model_dir.joinpath(*rel.parts)


# ---- GGUF file structure ---------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One GGUF tensor-info record as read, before anything trusts it."""

    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    type_id: int
    offset: int  # from the start of the data region


def gguf_alignment(source: str, value: Any) -> int:
    """`general.alignment`: a power of two (GGUF requires it; the data start depends on it)."""
    if not _is_int(value) or value < 1 or value & (value - 1) or value > 1 << 30:
        raise ModelFormatError(f"{source}: general.alignment is {_show(value)}, not a power of two; "
                               "the file is corrupt")
    return int(value)


def gguf_tensor_type(source: str, info: TensorInfo) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(info.type_id)
    except ValueError:
        raise ModelFormatError(f"{source}: tensor {_show(info.name)} has type id {info.type_id}, which "
                               "no GGUF version defines; the file is corrupt") from None


def gguf_tensor_nbytes(source: str, info: TensorInfo) -> int:
    """Bytes the tensor's type and shape need; its rows must be whole blocks."""
    kind = gguf_tensor_type(source, info)
    block_elems, block_bytes = GGML_QUANT_SIZES[kind]
    if not 1 <= len(info.dims) <= GGML_MAX_DIMS or any(d < 1 for d in info.dims):
        raise ModelFormatError(f"{source}: tensor {_show(info.name)} has shape {list(info.dims)}; "
                               f"a GGUF tensor has 1 to {GGML_MAX_DIMS} dimensions of at least 1")
    if info.dims[0] % block_elems:
        raise ModelFormatError(f"{source}: tensor {_show(info.name)} has rows of {info.dims[0]} values, "
                               f"not whole {kind.name} blocks of {block_elems}; the file is corrupt")
    return math.prod(info.dims) // block_elems * block_bytes


def gguf_tensor_layout(source: str, infos: list[TensorInfo], data_start: int, file_size: int,
                       alignment: int) -> list[int]:
    """Each tensor's byte size; raises unless names are unique and the byte ranges are aligned,
    inside the data region and disjoint."""
    seen: set[str] = set()
    ranges: list[tuple[int, int, str]] = []
    sizes: list[int] = []
    data_size = file_size - data_start
    for info in infos:
        if info.name in seen:
            raise ModelFormatError(f"{source}: tensor {_show(info.name)} appears twice; the file is corrupt")
        seen.add(info.name)
        nbytes = gguf_tensor_nbytes(source, info)
        if info.offset % alignment:
            raise ModelFormatError(f"{source}: tensor {_show(info.name)} starts at offset {info.offset}, "
                                   f"not a multiple of the alignment {alignment}; the file is corrupt")
        if info.offset + nbytes > data_size:
            raise ModelFormatError(f"{source}: tensor {_show(info.name)} extends past the end of the file; "
                                   f"the file is truncated or corrupt (or general.alignment, {alignment}, is "
                                   "wrong), download or convert it again")
        ranges.append((info.offset, info.offset + nbytes, info.name))
        sizes.append(nbytes)
    ranges.sort()
    for (_, end, name), (begin, _, other) in zip(ranges, ranges[1:], strict=False):
        if begin < end:
            raise ModelFormatError(f"{source}: tensors {_show(name)} and {_show(other)} overlap; "
                                   "the file is corrupt")
    gguf_tensors_packed(source, ranges, data_size, alignment)
    return sizes


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def gguf_tensors_packed(source: str, ranges: list[tuple[int, int, str]], data_size: int, alignment: int) -> None:
    """The sorted, disjoint tensor ranges tile the data region: each starts where the one
    before ends, rounded up to the alignment, and the file ends after the last (padding
    allowed). Writers (gguf-py, llama.cpp) pack tensors so; a gap or a tail means a tensor's
    type or shape was changed to a smaller one (Q4_1 -> Q4_0, F32 -> F16) or the alignment
    lies, and the bytes would be read with the wrong meaning. A file without tensors (a
    vocabulary-only GGUF) has no data region to check."""
    if not ranges:
        return
    # A gap follows the tensor whose type or shape shrank, so the message names that one.
    if ranges[0][0] != 0:
        raise ModelFormatError(
            f"{source}: the first tensor, {_show(ranges[0][2])}, starts at data offset {ranges[0][0]}, not 0; "
            "a tensor's offset or general.alignment is wrong: the file is corrupt")
    for (_, end, name), (begin, _, following) in zip(ranges, ranges[1:], strict=False):
        if begin != _align(end, alignment):
            raise ModelFormatError(
                f"{source}: tensor {_show(name)} ends at data offset {end}, but the next, {_show(following)}, "
                f"starts at {begin} (alignment {alignment}); a tensor's type or shape, or general.alignment, "
                "is wrong: the file is corrupt")
    last, name = ranges[-1][1], ranges[-1][2]
    if not last <= data_size <= _align(last, alignment):
        raise ModelFormatError(
            f"{source}: {data_size - last} bytes follow the last tensor, {_show(name)} (alignment {alignment}); "
            "a tensor's type or shape, or general.alignment, is wrong, or data was appended: the file is corrupt")


# ---- GGUF metadata ---------------------------------------------------------------------

# `{arch}.<key>` values the loaders read: integers >= 1, or finite numbers.
GGUF_COUNTS = (
    "context_length", "embedding_length", "feed_forward_length", "block_count",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "rope.dimension_count", "rope.scaling.original_context_length",
)
GGUF_NUMBERS = (
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor",
    "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
)
GGUF_TOKEN_IDS = tuple(
    f"tokenizer.ggml.{name}_token_id"
    for name in ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "mask",
                 "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
)
GGUF_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")


def gguf_metadata(source: str, arch: str, meta: Mapping[str, Any], n_tokens: int | None) -> None:
    """Hyper-parameter types and ranges, and special token ids inside the vocabulary."""
    for suffix in GGUF_COUNTS:
        key = f"{arch}.{suffix}"
        if key in meta and (not _is_int(meta[key]) or meta[key] < 1):
            raise ModelFormatError(f"{source}: metadata {key} is {_show(meta[key])}, but it must be a "
                                   "positive integer; the file is corrupt")
    for suffix in GGUF_NUMBERS:
        key = f"{arch}.{suffix}"
        if key in meta and not _is_number(meta[key]):
            raise ModelFormatError(f"{source}: metadata {key} is {_show(meta[key])}, but it must be a "
                                   "finite number; the file is corrupt")
    gguf_tokenizer(source, meta, n_tokens)


def gguf_tokenizer(source: str, meta: Mapping[str, Any], n_tokens: int | None) -> None:
    """The tokenizer's strings are strings and its special token ids name tokens."""
    for key in GGUF_TOKENIZER_STRINGS:
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ModelFormatError(f"{source}: metadata {key} is not a string; the file is corrupt")
    token_ids(source, ((key, meta[key]) for key in GGUF_TOKEN_IDS if meta.get(key) is not None), n_tokens)


def gguf_token_list(source: str, tokens: Any) -> int:
    """The length of `tokenizer.ggml.tokens`, which must be a list of strings."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelFormatError(f"{source}: tokenizer.ggml.tokens is not a list of strings; the file is corrupt")
    return len(tokens)


def token_ids(source: str, ids: Iterable[tuple[str, Any]], vocab_size: int | None) -> None:
    """Each (field, id) names a token of the vocabulary [0, vocab_size)."""
    for field, value in ids:
        if not _is_int(value) or value < 0 or (vocab_size is not None and value >= vocab_size):
            raise ModelFormatError(f"{source}: {field} is {_show(value)}, which is not a token id of the "
                                   f"vocabulary [0, {vocab_size}); the file is corrupt")


# ---- HF config.json --------------------------------------------------------------------

# config.json fields the loader reads, by the JSON type they must have when present.
HF_CONFIG_TYPES: dict[str, str] = {
    "vocab_size": "count", "hidden_size": "count", "intermediate_size": "count",
    "num_hidden_layers": "count", "num_attention_heads": "count", "num_key_value_heads": "count",
    "head_dim": "count", "max_position_embeddings": "count", "sliding_window": "size",
    "rms_norm_eps": "number", "rope_theta": "number", "tie_word_embeddings": "bool",
    "hidden_act": "str", "rope_scaling": "object", "rope_parameters": "object",
    "bos_token_id": "id", "eos_token_id": "ids", "architectures": "strs", "use_qk_norm": "bool",
}
# Fields that have a default when absent but no meaning as null.
_HF_NOT_NULL = ("rms_norm_eps", "max_position_embeddings")
_HF_TYPE_TEXT = {
    "count": "a positive integer", "size": "a non-negative integer", "number": "a finite number", "bool": "true or false",
    "str": "a string", "object": "an object", "id": "a token id", "ids": "a token id or a list of them",
    "strs": "a list of strings",
}


def _hf_type_ok(kind: str, value: Any) -> bool:
    if kind == "count":
        return _is_int(value) and value >= 1
    if kind == "size":
        return _is_int(value) and value >= 0
    if kind == "number":
        return _is_number(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "id":
        return _is_int(value) and value >= 0
    if kind == "ids":
        return _hf_type_ok("id", value) or (isinstance(value, list) and all(_hf_type_ok("id", v) for v in value))
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def hf_config(source: Path, cfg: Mapping[str, Any]) -> None:
    """config.json fields have the JSON types transformers writes (null means 'not set')."""
    for key, kind in HF_CONFIG_TYPES.items():
        value = cfg.get(key)
        if (value is not None or key in _HF_NOT_NULL and key in cfg) and not _hf_type_ok(kind, value):
            raise ModelFormatError(f"{source}: {key} is {_show(value)}, but it must be "
                                   f"{_HF_TYPE_TEXT[kind]}; fix or re-download the file")
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and not _is_number(theta):
        raise ModelFormatError(f"{source}: rope_parameters.rope_theta is {_show(theta)}, but it must be "
                               "a finite number; fix or re-download the file")


# ---- safetensors -----------------------------------------------------------------------


@dataclass(frozen=True)
class SafetensorsEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def unique_keys(source: Path) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A json `object_pairs_hook` refusing a repeated key (json keeps the last one silently)."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            key = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
            raise ModelFormatError(f"{source}: the header names {_show(key)} twice; re-download the file")
        return out
    return hook


def safetensors_header(source: Path, header: Any, data_size: int) -> list[SafetensorsEntry]:
    """The header's tensor entries; raises unless each is well typed, inside the data region
    and disjoint from the others."""
    if not isinstance(header, dict):
        raise ModelFormatError(f"{source}: the safetensors header is not a JSON object; re-download the file")
    entries: list[SafetensorsEntry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ModelFormatError(f"{source}: header entry {_show(name)} is not an object; re-download the file")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if (not isinstance(dtype, str) or not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ModelFormatError(f"{source}: header entry {_show(name)} needs a dtype string, a shape of "
                                   "sizes and data_offsets [begin, end]; re-download the file")
        if offsets[1] > data_size:
            raise ModelFormatError(f"{source}: tensor {_show(name)} runs past the end of the file; the file "
                                   "is truncated")
        entries.append(SafetensorsEntry(name, dtype, tuple(shape), offsets[0], offsets[1]))
    ordered = sorted((e for e in entries if e.end > e.begin), key=lambda e: e.begin)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.begin < a.end:
            raise ModelFormatError(f"{source}: tensors {_show(a.name)} and {_show(b.name)} overlap; "
                                   "re-download the file")
    return entries


# ---- the normalised model --------------------------------------------------------------

def _config(source: str, c: ModelConfig) -> None:
    def bad(field: str, value: Any, need: str) -> ModelFormatError:
        return ModelFormatError(f"{source}: {field} is {_show(value)}, but it must be {need}; "
                                "the model's config is corrupt")

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
        value = getattr(c, field)
        if not _is_int(value) or value < 1:
            raise bad(field, value, "a positive integer")
    if c.num_heads % c.num_kv_heads:
        raise bad("num_kv_heads", c.num_kv_heads, f"a divisor of num_heads ({c.num_heads})")
    if c.head_dim % 2:
        raise bad("head_dim", c.head_dim, "even (RoPE rotates pairs)")
    if not _is_number(c.rms_norm_eps) or not 0 < c.rms_norm_eps < 1:
        raise bad("rms_norm_eps", c.rms_norm_eps, "a number between 0 and 1")
    if not _is_number(c.rope_theta) or c.rope_theta <= 0:
        raise bad("rope_theta", c.rope_theta, "a positive number")
    ids = [("bos_token_id", c.bos_token_id)] if c.bos_token_id is not None else []
    token_ids(source, ids + [("eos_token_id", i) for i in c.eos_token_ids], c.vocab_size)


def layer_count(source: str, num_layers: int, weights: Mapping[str, WeightData]) -> None:
    """Per-layer tensors exist for exactly layers 0..num_layers-1. Checked without looping
    over num_layers, which the file controls: call it before anything else does."""
    present: set[int] = set()
    for name in weights:
        if not name.startswith("layers."):
            continue
        index = name.split(".")[1]
        if str(int(index)) != index:
            raise ModelFormatError(f"{source}: tensor for layer {_show(index)} has a non-canonical layer "
                                   "number; the file is corrupt")
        present.add(int(index))
    extra = sorted(i for i in present if i >= num_layers)
    if extra:
        raise ModelFormatError(
            f"{source}: has tensors for layer {extra[0]}, but the config says {num_layers} layers; "
            "every tensor must belong to a layer the model runs (the file is corrupt)"
        )
    if len(present) < num_layers:
        missing = next(i for i in range(len(present) + 1) if i not in present)
        raise ModelFormatError(
            f"{source}: the config says {num_layers} layers, but there are no tensors for layer "
            f"{missing}; the file is incomplete or its layer count is corrupt"
        )


def model_config(source: str, config: ModelConfig, weights: Mapping[str, WeightData]) -> None:
    """Raise unless `config` is in range and its layer count agrees with the tensors (the
    normalisation, vkrt/loader/normalize.py, has checked the fields it read, rope scaling
    included, and capped a context beyond 32-bit positions).

    Runs before anything loops over layers; per-weight shapes are checked after it
    (`weight_shapes.check_weights`).
    """
    _config(source, config)
    layer_count(source, config.num_layers, weights)
    freqs = weights.get("rope_freqs")
    if freqs is not None and freqs.shape != (config.head_dim // 2,):
        raise ModelFormatError(f"{source}: rope_freqs has shape {freqs.shape}, but head_dim "
                               f"{config.head_dim} needs ({config.head_dim // 2},); the file is corrupt")
