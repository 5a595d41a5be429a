"""Hugging Face model directories (config.json + *.safetensors) -> LoadedModel."""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from vkrt.core.formats import mxfp4_from_hf
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import validate
from vkrt.loader.arch import arch_for_hf, supported_hf_archs
from vkrt.loader.arch_spec import (
    MTP_HEAD_HF,
    MTP_LAYER_HF,
    ArchSpec,
    canonical_name,
    mtp_tensor_name,
)
from vkrt.loader.config import LoadedModel, WeightData
from vkrt.loader.normalize import hf_fields, model_config
from vkrt.loader.pooling import SEQUENCE_CLASSIFICATION, hf_pooling, num_labels
from vkrt.loader.weight_shapes import check_weights

log = logging.getLogger(__name__)

# safetensors dtype -> (vkrt storage format, numpy dtype of WeightData.data)
_DTYPES: dict[str, tuple[str, type[np.generic]]] = {
    "F32": ("f32", np.float32),
    "F16": ("f16", np.float16),
    "BF16": ("bf16", np.uint16),  # numpy has no bf16: keep the raw bits
    "U8": ("u8", np.uint8),  # only as the halves of an MXFP4 weight (`_join_mxfp4`)
}
# gpt-oss's MXFP4 expert weights: `<name>_blocks` (codes) beside `<name>_scales` (exponents)
_MXFP4_HALVES = ("_blocks", "_scales")

_LAYER_NAMES: dict[str, re.Pattern[str]] = {}  # ArchSpec.hf_prefix -> "<prefix>.layers.{i}.<suffix>"


_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_float(obj: dict[str, Any]) -> Any:
    """transformers 5 writes floats JSON cannot hold as {"__float__": "Infinity"} (time_step_limit)."""
    if len(obj) == 1 and obj.get("__float__") in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def _read_json(path: Path) -> dict[str, Any]:
    validate.regular_file(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"), object_hook=_special_float)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc}); fix or re-download the file") from exc
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: expected a JSON object at the top level")
    return value


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{index}: no 'weight_map' object; re-download the model")
        names = {validate.confined_path(model_dir, name, index): name for name in weight_map.values()}
        for f, name in names.items():
            if not f.exists():
                raise ModelFormatError(f"{index}: lists shard {name!r}, which is missing; download all shards")
            validate.regular_file(f)
        return sorted(names)
    files = [validate.regular_file(f) for f in sorted(model_dir.glob("*.safetensors"))]
    if not files:
        raise ModelFormatError(
            f"{model_dir}: no *.safetensors files; vkrt reads safetensors checkpoints "
            "(convert .bin/.pth weights to safetensors first)"
        )
    return files


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """Memory-map one .safetensors file: {tensor name: (format, shape, array view)}."""
    size = validate.regular_file(path).stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: too short to be a safetensors file; re-download it")
        (header_len,) = struct.unpack("<Q", head)
        # The length is not echoed: a path that is not a safetensors file must not leak its bytes.
        if header_len > min(size - 8, validate.MAX_SAFETENSORS_HEADER):
            raise ModelFormatError(f"{path}: the header length field exceeds the file; the file is "
                                   "truncated or not a safetensors file")
        try:
            header = json.loads(f.read(header_len), object_pairs_hook=validate.unique_keys(path))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise ModelFormatError(f"{path}: the safetensors header is not valid JSON; re-download it") from None
    data_start = 8 + header_len
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for entry in validate.safetensors_header(path, header, size - data_start):
        name = entry.name
        if entry.dtype not in _DTYPES:
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} has dtype {entry.dtype[:20]}, which vkrt does not support "
                f"(supported: {', '.join(_DTYPES)}); save the model in one of those"
            )
        fmt, np_dtype = _DTYPES[entry.dtype]
        nbytes = math.prod(entry.shape) * np.dtype(np_dtype).itemsize
        if entry.end - entry.begin != nbytes:
            raise ModelFormatError(f"{path}: tensor {name!r} has {entry.end - entry.begin} bytes, but its dtype "
                                   f"and shape need {nbytes}; re-download the file")
        view = mapped[data_start + entry.begin : data_start + entry.end].view(np_dtype).reshape(entry.shape)
        tensors[name] = (fmt, entry.shape, view)
    return tensors


def _canonical_name(spec: ArchSpec, hf_name: str) -> str | None:
    pattern = _LAYER_NAMES.get(spec.hf_prefix)
    if pattern is None:
        pattern = _LAYER_NAMES[spec.hf_prefix] = re.compile(rf"^{re.escape(spec.hf_prefix)}\.layers\.(\d+)\.(.+)$")
    return canonical_name(hf_name, spec.hf_global, pattern, spec.hf_layer)


# A multimodal checkpoint's language model, as transformers 5 names it or (Mistral3's) as the
# checkpoints before it did -> the names of the language model saved on its own.
_LANGUAGE_MODEL = {"model.language_model.": "model.", "language_model.model.": "model.",
                   "language_model.lm_head.": "lm_head."}


def _language_model_config(config_path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's text_config as the language model's own config (its
    architectures, token ids and tie_word_embeddings from the top level where it has them)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"{config_path}: a {cfg['architectures'][0]} config needs a text_config object")
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config") and k not in text}
    return {**top, **text, **{k: cfg[k] for k in ("architectures", "tie_word_embeddings") if k in cfg}}


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _mtp_layers(config_path: Path, spec: ArchSpec, cfg: dict[str, Any]) -> range:
    """The indices of the multi-token-prediction layers saved after the main ones (ArchSpec.mtp_layers)."""
    count = cfg.get(spec.mtp_layers, 0) if spec.mtp_layers else 0
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or not count:
        return range(0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ModelFormatError(f"{config_path}: {spec.mtp_layers} must be a count, got {count!r}")
    return range(layers, layers + count)


def _mtp_name(file: Path, spec: ArchSpec, hf_name: str, mtp: range) -> str | None:
    """The canonical name a tensor of the MTP head takes in the head's own model
    (vkrt/models/mtp.py): Qwen3.5's / Qwen3-Next's under `mtp.`, DeepSeek-V3's / GLM-4.5's in
    the `mtp` layers after the main ones."""
    if spec.hf_mtp_prefix and hf_name.startswith(spec.hf_mtp_prefix):
        rest = hf_name[len(spec.hf_mtp_prefix):]
        layer = _canonical_name(spec, f"{spec.hf_prefix}.{rest}") if rest.startswith("layers.") else None
        return mtp_tensor_name(file, spec, hf_name, rest, MTP_HEAD_HF, layer, len(mtp))
    index, rest = hf_name[len(spec.hf_prefix) + len(".layers."):].split(".", 1)
    layer = _canonical_name(spec, f"{spec.hf_prefix}.layers.{int(index) - mtp.start}.{rest}")
    return mtp_tensor_name(file, spec, hf_name, rest, MTP_LAYER_HF, layer, len(mtp))


def _join_mxfp4(file: Path, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]],
                pending: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> None:
    """Replace each `<name>_blocks` / `<name>_scales` pair in `tensors` by `<name>`, an MXFP4
    weight in llama.cpp's layout (formats.mxfp4_from_hf, a copy made once at load) of logical
    shape [..., out, in]: gpt-oss's released checkpoints store their experts so. A half whose
    partner is in another shard waits in `pending`; a u8 tensor that is neither half is refused."""
    for hf_name in [n for n in tensors if tensors[n][0] == "u8"]:
        half = next((h for h in _MXFP4_HALVES if hf_name.endswith(h)), None)
        if half is None:
            raise UnsupportedModelError(f"{file}: tensor {hf_name!r} has dtype U8, which vkrt reads only as "
                                        "the _blocks / _scales halves of an MXFP4 weight; save the model in "
                                        "F32, F16 or BF16")
        pending[hf_name] = tensors.pop(hf_name)
        base = hf_name[: -len(half)]
        blocks, scales = pending.get(base + "_blocks"), pending.get(base + "_scales")
        if blocks is None or scales is None:
            continue
        del pending[base + "_blocks"], pending[base + "_scales"]
        if len(blocks[1]) < 2 or blocks[1][-1] != 16 or blocks[1][:-1] != scales[1]:
            raise ModelFormatError(f"{file}: {base}_blocks {list(blocks[1])} and {base}_scales {list(scales[1])} "
                                   "are not an MXFP4 pair ([..., G, 16] codes beside [..., G] exponents); "
                                   "re-download the model")
        rows = mxfp4_from_hf(np.asarray(blocks[2]), np.asarray(scales[2]))
        tensors[base] = ("mxfp4", (*blocks[1][:-2], blocks[1][-2] * 32), rows)


def _split_fused_experts(model_dir: Path, weights: dict[str, WeightData], interleaved: bool) -> None:
    """Expert stacks as llama.cpp's converter writes them: HF's gate_up_proj [E, H, 2F] (gate and
    up columns interleaved, gpt-oss's, or gate's then up's, Llama 4's) and down_proj [E, F, H]
    become gate_proj, up_proj [E, F, H] and down_proj [E, H, F], and the [E, 2F] bias gate_bias
    and up_bias. The transposes are copies, made once at load. An MXFP4 stack (`_join_mxfp4`) is
    stored [E, out, in] already: gate_up's rows are split, nothing is transposed."""
    for name in [n for n in weights if n.endswith(".experts.gate_up_proj")]:
        p = name[: -len("gate_up_proj")]
        fused, down = weights.pop(name), weights.get(p + "down_proj")
        mxfp4 = fused.fmt == "mxfp4"
        if (down is None or len(fused.shape) != 3 or len(down.shape) != 3 or fused.shape[1 if mxfp4 else 2] % 2
                or mxfp4 != (down.fmt == "mxfp4")):
            raise ModelFormatError(f"{model_dir}: {name} must be [experts, hidden, 2 x intermediate] (MXFP4: "
                                   "[experts, 2 x intermediate, hidden]) beside a down_proj of the same format, "
                                   f"got {list(fused.shape)}; the checkpoint is not one transformers wrote")
        # Both as [E, 2F, in] rows (float ones a transposed view), gate and up rows then split.
        experts, out, inputs = fused.shape if mxfp4 else (fused.shape[0], fused.shape[2], fused.shape[1])
        rows = fused.data if mxfp4 else fused.data.transpose(0, 2, 1)
        half = out // 2
        for i, part in enumerate(("gate_proj", "up_proj")):
            taken = slice(i, None, 2) if interleaved else slice(i * half, (i + 1) * half)
            data = np.ascontiguousarray(rows[:, taken])
            weights[p + part] = WeightData(p + part, fused.fmt, (experts, half, inputs), data)
        if not mxfp4:
            data = np.ascontiguousarray(down.data.transpose(0, 2, 1))
            weights[p + "down_proj"] = WeightData(p + "down_proj", down.fmt, data.shape, data)
        bias = weights.pop(p + "gate_up_bias", None)
        if bias is not None and len(bias.shape) == 2:
            for i, part in enumerate(("gate_bias", "up_bias")):
                values = np.ascontiguousarray(bias.data[:, i::2])
                weights[p + part] = WeightData(p + part, bias.fmt, values.shape, values)


def load_hf_dir(model_dir: str | Path) -> LoadedModel:
    """Load a Hugging Face model directory; safetensors weights stay memory-mapped."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = f" (it holds {ggufs[0]!r}: pass that file instead)" if ggufs else ""
        raise ModelFormatError(
            f"{model_dir}: no config.json; a Hugging Face model directory needs config.json "
            f"next to its *.safetensors{hint}"
        )
    cfg = _read_json(config_path)
    archs = cfg.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    labels = num_labels(config_path, cfg, archs)
    # A sequence classifier is its family's causal LM with the `score` head in the LM head's place.
    spec = arch_for_hf([a.replace(SEQUENCE_CLASSIFICATION, "ForCausalLM") if isinstance(a, str) else a
                        for a in archs])
    if spec is None:
        validate.hf_config(config_path, cfg)
        raise UnsupportedModelError(
            f"{config_path}: architectures {archs!r} are not supported "
            f"(supported: {supported_hf_archs()}); use a model of a supported family"
        )
    multimodal = any(a in spec.hf_multimodal_archs for a in archs)
    if multimodal:
        cfg = _language_model_config(config_path, cfg)
    validate.hf_config(config_path, cfg)
    weights: dict[str, WeightData] = {}
    mtp_weights: dict[str, WeightData] = {}
    skipped: Counter[str] = Counter()
    mtp = _mtp_layers(config_path, spec, cfg)
    mxfp4_halves: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for file in _safetensors_files(model_dir):
        tensors = read_safetensors(file)
        _join_mxfp4(file, tensors, mxfp4_halves)
        for hf_name, (fmt, shape, data) in tensors.items():
            prefix = next((p for p in _LANGUAGE_MODEL if hf_name.startswith(p)), None) if multimodal else None
            if prefix is not None:
                hf_name = _LANGUAGE_MODEL[prefix] + hf_name[len(prefix):]
            if labels and hf_name == "score.weight":
                hf_name = "lm_head.weight"
            elif not hf_name.startswith(spec.hf_prefix) and _canonical_name(spec, f"{spec.hf_prefix}.{hf_name}"):
                hf_name = f"{spec.hf_prefix}.{hf_name}"  # a base model saved alone (Qwen3-Embedding)
            layer = _LAYER_INDEX.match(hf_name[len(spec.hf_prefix) + 1:]) if hf_name.startswith(spec.hf_prefix) else None
            in_mtp_layer = layer is not None and int(layer.group(1)) in mtp
            if in_mtp_layer or (spec.hf_mtp_prefix and hf_name.startswith(spec.hf_mtp_prefix)):
                name = _mtp_name(file, spec, hf_name, mtp)
                if name is not None:
                    if name in mtp_weights:
                        raise ModelFormatError(f"{file}: tensor {hf_name!r} is also in another shard; "
                                               "re-download the model")
                    mtp_weights[name] = WeightData(name=name, fmt=fmt, shape=shape, data=data)
                continue
            name = _canonical_name(spec, hf_name)
            if name is None:
                if spec.hf_ignored.search(hf_name):
                    continue
                prefix = next((p for p in spec.hf_skipped if hf_name.startswith(p)), None)
                if prefix is not None:
                    skipped[spec.hf_skipped[prefix]] += 1
                    continue
                raise UnsupportedModelError(
                    f"{file}: tensor {hf_name!r} is not part of the {spec.name} architecture vkrt "
                    "implements; this variant of the model is not supported"
                )
            if name in weights:
                raise ModelFormatError(f"{file}: tensor {hf_name!r} is also in another shard; "
                                       "re-download the model")
            weights[name] = WeightData(name=name, fmt=fmt, shape=shape, data=data)
    if mxfp4_halves:
        raise ModelFormatError(f"{model_dir}: {sorted(mxfp4_halves)[0]} has no partner (an MXFP4 weight is a "
                               "_blocks and a _scales tensor); download all shards")
    if spec.hf_interleaved_experts or spec.hf_stacked_experts:
        _split_fused_experts(model_dir, weights, spec.hf_interleaved_experts)
        _split_fused_experts(model_dir, mtp_weights, spec.hf_interleaved_experts)
    if mtp_weights:
        log.info("%s: the multi-token-prediction head (%d tensor%s) is kept for {\"method\": \"mtp\"} speculation",
                 model_dir, len(mtp_weights), "" if len(mtp_weights) == 1 else "s")
    for what, count in skipped.items():
        log.info("%s: skipped %s (%d tensor%s): vkrt runs the language model only", model_dir,
                 what, count, "" if count == 1 else "s")
    fields = hf_fields(config_path, cfg, spec)
    if fields.get("num_hidden_layers") is not None:  # checked before anything loops over the layers
        validate.layer_count(str(config_path), fields.values["num_hidden_layers"], weights)
    gen_path = model_dir / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    config = model_config(fields, spec, str(cfg.get("_name_or_path") or model_dir.name), generation)
    head: dict[str, Any] = {"num_labels": labels, "tie_word_embeddings": False} if labels else {}
    config = replace(config, **hf_pooling(model_dir, cfg, spec.name), **head)
    if config.tie_word_embeddings:
        weights.pop("lm_head", None)  # some exports save the tied copy too; the embedding is the source of truth
    if not config.tie_word_embeddings and "lm_head" not in weights:
        raise ModelFormatError(
            f"{model_dir}: config.json says tie_word_embeddings is false but there is no "
            "lm_head.weight; the checkpoint is incomplete"
        )
    validate.model_config(str(model_dir), config, weights)
    check_weights(str(model_dir), config, weights)
    dtype_counts = Counter(w.fmt.upper() for w in weights.values() if len(w.shape) > 1)
    file_type = dtype_counts.most_common(1)[0][0] if dtype_counts else ""
    return LoadedModel(path=str(model_dir), config=config, weights=weights, file_type=file_type, metadata=cfg,
                       mtp_weights=mtp_weights)
