"""GGUF files -> LoadedModel: canonical names, logical shapes, storage-format bytes."""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, LlamaFileType

from vkrt.core.formats import FORMATS, by_gguf_type
from vkrt.errors import ModelFormatError, UnsupportedModelError, VkrtError
from vkrt.loader import gguf_checks, validate
from vkrt.loader.arch import arch_for_gguf, supported_gguf_archs
from vkrt.loader.arch_spec import MTP_LAYER_GGUF, ArchSpec, canonical_name, mtp_tensor_name
from vkrt.loader.config import LoadedModel, WeightData
from vkrt.loader.gguf_fields import gguf_fields, gguf_mtp_layers
from vkrt.loader.gguf_file import GGUFField, GGUFFile, GGUFTensor
from vkrt.loader.normalize import model_config
from vkrt.loader.pooling import GGUF_CLASSIFIER, gguf_pooling
from vkrt.loader.weight_shapes import check_weights

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


def unpermuted_qk_order(rows: int, n_heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k row permutation (HF's rotate-half order):
    HF row j is GGUF row order[j].

    The converter views each head's rows as [2, head_dim/2] (the two RoPE halves) and
    transposes them to [head_dim/2, 2], interleaving the halves pairwise. Only whole rows
    move, so this works unchanged on block-quantized rows.
    """
    head_dim = rows // n_heads
    if n_heads * head_dim != rows or head_dim % 2:
        raise ModelFormatError(f"q/k weight with {rows} rows does not split into {n_heads} heads of even size")
    # gguf_row[j] == hf_row[to_gguf[j]]  =>  hf_row == gguf_row[argsort(to_gguf)]
    to_gguf = np.arange(rows).reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    return np.argsort(to_gguf)


def _canonical_name(spec: ArchSpec, gguf_name: str) -> str | None:
    return canonical_name(gguf_name, spec.gguf_global, _LAYER_NAME, spec.gguf_layer)


def _mtp_name(path: Path, spec: ArchSpec, block: int, rest: str, mtp: range) -> str | None:
    """The canonical name a tensor of an MTP block (llama.cpp's nextn layers) takes in the head's
    own model (vkrt/models/mtp.py)."""
    return mtp_tensor_name(path, spec, f"blk.{block}.{rest}", rest, MTP_LAYER_GGUF,
                           _canonical_name(spec, f"blk.{block - mtp.start}.{rest}"), len(mtp))


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


def _vocab_size(path: Path, reader: GGUFFile, weights: dict[str, WeightData]) -> int:
    """The vocabulary: the token list's length, or the embedding's rows where they disagree."""
    embed_rows = weights["embed_tokens"].shape[0] if "embed_tokens" in weights else 0
    vocab = _token_count(str(path), reader) or embed_rows
    if embed_rows and vocab != embed_rows:
        log.warning("%s: %d tokens but %d embedding rows; using the embedding size", path, vocab, embed_rows)
        vocab = embed_rows
    return vocab


def load_gguf(path: str | Path, *, check_tensors: bool = False) -> LoadedModel:
    """Load a GGUF file: weights memory-mapped in their storage format, q/k rows in HF order.

    `check_tensors` also scans every weight for NaN / Inf (float values, block scales)."""
    path = Path(path)
    reader = open_gguf(path)
    meta = scalar_metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    experts = meta.get(f"{arch}.expert_count")
    spec = arch_for_gguf(arch, experts=isinstance(experts, int) and experts > 0)
    if spec is None:
        raise UnsupportedModelError(
            f"{path}: architecture {arch or '(none)'!r} is not supported "
            f"(supported: {supported_gguf_archs()}); use a model of a supported family"
        )
    validate.gguf_metadata(str(path), arch, meta, _token_count(str(path), reader))
    gguf_checks.metadata_types(str(path), reader.fields, arch)  # values first: their messages are plainer

    weights: dict[str, WeightData] = {}
    file_names: dict[str, str] = {}
    mtp = gguf_mtp_layers(path, spec, arch, meta)
    mtp_weights: dict[str, WeightData] = {}
    for tensor in reader.tensors:
        layer = _LAYER_NAME.match(tensor.name)
        if layer and int(layer.group(1)) in mtp:
            name = _mtp_name(path, spec, int(layer.group(1)), layer.group(2), mtp)
            if name is not None:
                mtp_weights[name] = _weight(path, name, tensor)
            continue
        name = GGUF_CLASSIFIER if tensor.name == GGUF_CLASSIFIER else _canonical_name(spec, tensor.name)
        if name is None:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name!r} is not part of the {spec.name} architecture vkrt "
                "implements; this variant of the model is not supported"
            )
        try:
            weights[name] = _weight(path, name, tensor)
            file_names[name] = tensor.name
        except ValueError as exc:
            raise ModelFormatError(f"{path}: tensor {tensor.name!r} is malformed ({exc}); the file is corrupt") from exc

    if mtp_weights:
        log.info("%s: the multi-token-prediction layer%s (%d tensors) kept for {\"method\": \"mtp\"} speculation",
                 path, "" if len(mtp) == 1 else "s", len(mtp_weights))
    if f"{arch}.block_count" in meta:  # checked before anything loops over the layers
        validate.layer_count(str(path), mtp.start if mtp else meta[f"{arch}.block_count"], weights)
    labels = reader.fields.get(f"{arch}.classifier.output_labels")
    pooling = gguf_pooling(path, meta.get(f"{arch}.pooling_type"), None if labels is None else field_value(labels),
                           weights)
    fields = gguf_fields(path, spec, arch, meta, reader, weights, _vocab_size(path, reader, weights))
    config = replace(model_config(fields, spec, name=str(meta.get("general.name", path.stem))), **pooling)
    validate.model_config(str(path), config, weights)
    if spec.gguf_qk_permuted:
        for i in range(config.num_layers):
            for proj, n_heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                w = weights.get(f"layers.{i}.{proj}")
                if w is not None:  # read in HF order when uploaded; the file's rows are not copied
                    w.row_order = unpermuted_qk_order(w.shape[0], n_heads)
    check_weights(str(path), config, weights)
    if check_tensors:
        gguf_checks.tensor_values(str(path), weights, file_names)
    return LoadedModel(
        path=str(path),
        config=config,
        weights=weights,
        file_type=_file_type(meta, reader),
        metadata=meta,
        mtp_weights=mtp_weights,
    )
