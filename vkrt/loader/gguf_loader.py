"""GGUF files -> LoadedModel: canonical names, logical shapes, storage-format bytes."""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, LlamaFileType

from vkrt.core.formats import FORMATS, by_gguf_type
from vkrt.errors import ModelFormatError, UnsupportedModelError, VkrtError
from vkrt.loader import validate
from vkrt.loader.arch import (
    ArchSpec,
    arch_for_gguf,
    canonical_name,
    check_weights,
    supported_gguf_archs,
)
from vkrt.loader.config import LoadedModel, ModelConfig, WeightData
from vkrt.loader.gguf_file import GGUFField, GGUFFile, GGUFTensor
from vkrt.loader.normalize import gguf_family_config

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, _mtime_ns: int, _size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """Open (memory-map) a GGUF file; the model loader and tokenizer share one parse of it.

    Parsing the token arrays of a real vocabulary takes seconds, hence the small cache.
    """
    p = Path(path)
    try:
        stat = p.stat()
        return _open_cached(str(p.resolve()), stat.st_mtime_ns, stat.st_size)
    except FileNotFoundError:
        raise ModelFormatError(f"{p}: no such file; pass a .gguf file or a Hugging Face model directory") from None
    except VkrtError:
        raise
    except Exception as exc:  # the reader raises bare ValueError/IndexError on bad bytes
        raise ModelFormatError(
            f"{p}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "the file is truncated or corrupt, download or convert it again"
        ) from exc


def field_value(field: GGUFField) -> Any:
    """A GGUF key/value as a Python scalar, string or list."""
    return field.value


def scalar_metadata(reader: GGUFFile) -> dict[str, Any]:
    """The file's key/values that are scalars or strings (token arrays are left out)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.types or field.types[0] == GGUFValueType.ARRAY:
            continue
        meta[key] = field_value(field)
    return meta


def _logical_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first (ne0 = in_features); PyTorch lists them slowest-first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _weight(path: Path, name: str, tensor: GGUFTensor) -> WeightData:
    fmt = by_gguf_type(int(tensor.tensor_type))
    if fmt is None:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which vkrt does not "
            f"support (supported: {', '.join(name.upper() for name in FORMATS)}); use a GGUF quantized "
            "to one of those"
        )
    shape = _logical_shape(tensor)
    if fmt.name == "bf16":
        data = tensor.data.view(np.uint16).reshape(shape)
    elif not fmt.is_block:
        data = tensor.data.reshape(shape)
    else:
        if shape[-1] % fmt.block_values:
            raise ValueError(f"{fmt.name} rows of {shape[-1]} values are not whole {fmt.block_values}-value blocks")
        data = tensor.data.reshape(-1, shape[-1] // fmt.block_values * fmt.block_bytes)
    return WeightData(name=name, fmt=fmt.name, shape=shape, data=data)


def unpermute_qk_rows(data: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, giving back HF (rotate-half) row order.

    The converter views each head's rows as [2, head_dim/2] (the two RoPE halves) and
    transposes them to [head_dim/2, 2], interleaving the halves pairwise. Only whole rows
    move, so this works unchanged on block-quantized rows.
    """
    rows = data.shape[0]
    head_dim = rows // n_heads
    if n_heads * head_dim != rows or head_dim % 2:
        raise ModelFormatError(f"q/k weight with {rows} rows does not split into {n_heads} heads of even size")
    # gguf_row[j] == hf_row[to_gguf[j]]  =>  hf_row == gguf_row[argsort(to_gguf)]
    to_gguf = np.arange(rows).reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    return np.ascontiguousarray(data[np.argsort(to_gguf)])


def _canonical_name(spec: ArchSpec, gguf_name: str) -> str | None:
    return canonical_name(gguf_name, spec.gguf_global, _LAYER_NAME, spec.gguf_layer)


def _file_type(meta: dict[str, Any], reader: GGUFFile) -> str:
    value = meta.get("general.file_type")
    if isinstance(value, int):
        try:
            name = LlamaFileType(value).name
        except ValueError:
            name = ""
        if name and name != "GUESSED":
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else ""


def _token_count(source: str, reader: GGUFFile) -> int | None:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return validate.gguf_token_list(source, tokens.value) if tokens is not None else None


def _config(path: Path, spec: ArchSpec, arch: str, meta: dict[str, Any], reader: GGUFFile,
            weights: dict[str, WeightData]) -> ModelConfig:
    def key(suffix: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{suffix}", default)
        if required and value is None:
            raise ModelFormatError(f"{path}: metadata key '{arch}.{suffix}' is missing; the GGUF is incomplete")
        return value

    hidden = int(key("embedding_length", required=True))
    for k in ("attention.head_count", "attention.head_count_kv"):
        field = reader.fields.get(f"{arch}.{k}")
        if field is not None and field.types[0] == GGUFValueType.ARRAY:
            raise UnsupportedModelError(f"{path}: per-layer '{arch}.{k}' is not supported")
    heads = key("attention.head_count", required=True)
    kv_heads = key("attention.head_count_kv", heads)
    heads, kv_heads = int(heads), int(kv_heads)
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"{path}: partial rotary embedding (rope.dimension_count {rope_dim} < head_dim {head_dim}) "
            "is not supported"
        )

    embed_rows = weights["embed_tokens"].shape[0] if "embed_tokens" in weights else 0
    vocab = _token_count(str(path), reader) or embed_rows
    if embed_rows and vocab != embed_rows:
        log.warning("%s: %d tokens but %d embedding rows; using the embedding size", path, vocab, embed_rows)
        vocab = embed_rows

    rope_scaling: dict[str, Any] | None = None
    scaling_type = key("rope.scaling.type")
    if scaling_type is None and key("rope.scale_linear") is not None:  # pre-2024 key
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scale_linear"))}
    elif scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type}
        for gguf_key, hf_key in (
            ("rope.scaling.factor", "factor"),
            ("rope.scaling.original_context_length", "original_max_position_embeddings"),
            ("rope.scaling.attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            if key(gguf_key) is not None:
                rope_scaling[hf_key] = key(gguf_key)

    eos_ids: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if isinstance(meta.get(k), int) and meta[k] not in eos_ids:
            eos_ids.append(meta[k])
    bos = meta.get("tokenizer.ggml.bos_token_id")

    return ModelConfig(
        architecture=spec.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=int(key("block_count", required=True)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="lm_head" not in weights,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=tuple(eos_ids),
        name=str(meta.get("general.name", path.stem)),
    )


def load_gguf(path: str | Path) -> LoadedModel:
    """Load a GGUF file: weights memory-mapped in their storage format, q/k rows in HF order."""
    path = Path(path)
    reader = open_gguf(path)
    meta = scalar_metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    spec = arch_for_gguf(arch)
    if spec is None:
        raise UnsupportedModelError(
            f"{path}: architecture {arch or '(none)'!r} is not supported "
            f"(supported: {supported_gguf_archs()}); use a model of a supported family"
        )
    validate.gguf_metadata(str(path), arch, meta, _token_count(str(path), reader))

    weights: dict[str, WeightData] = {}
    for tensor in reader.tensors:
        name = _canonical_name(spec, tensor.name)
        if name is None:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name!r} is not part of the {spec.name} architecture vkrt "
                "implements; this variant of the model is not supported"
            )
        try:
            weights[name] = _weight(path, name, tensor)
        except ValueError as exc:
            raise ModelFormatError(f"{path}: tensor {tensor.name!r} is malformed ({exc}); the file is corrupt") from exc

    if f"{arch}.block_count" in meta:  # checked before anything loops over the layers
        validate.layer_count(str(path), meta[f"{arch}.block_count"], weights)
    config = _config(path, spec, arch, meta, reader, weights)
    config = gguf_family_config(path, spec, arch, meta, reader, weights, config)
    config = validate.model_config(str(path), config, weights)
    if spec.gguf_qk_permuted:
        for i in range(config.num_layers):
            for proj, n_heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                w = weights.get(f"layers.{i}.{proj}")
                if w is not None:
                    w.data = unpermute_qk_rows(w.data, n_heads)
    check_weights(str(path), config, weights)
    return LoadedModel(
        path=str(path),
        config=config,
        weights=weights,
        file_type=_file_type(meta, reader),
        metadata=meta,
    )
