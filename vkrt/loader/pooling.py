"""What a checkpoint says about pooling (embeddings) and a classification head.

Sentence-transformers directories declare their pipeline in modules.json: the Transformer,
then a Pooling module (`1_Pooling/config.json`: one `pooling_mode_*` set) and optionally
Normalize. GGUF writes llama.cpp's `<arch>.pooling_type`. A `*ForSequenceClassification`
checkpoint has a `score` linear [num_labels, hidden] where the LM head would be: vkrt loads it as
the head, so the model's "logits" are the labels'. So does a GGUF of pooling type rank: its
`cls.output` head (llama.cpp's converter writes Qwen3-Reranker's yes and no rows of the LM head
there, labelled by `<arch>.classifier.output_labels`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.config import WeightData

# sentence-transformers' Pooling modes vkrt runs -> vkrt.engine.pooling's method names.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# llama.cpp's enum llama_pooling_type (0 none; 4 rank: the last token through the `cls.output` head).
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "last"}
GGUF_RANK = 4
GGUF_CLASSIFIER = "cls.output.weight"
SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc}); fix or re-download the file") from exc


def hf_pooling(model_dir: Path, cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ModelConfig fields (pooling, pooling_normalize, matryoshka) from a HF directory's
    sentence-transformers files and config.json; {} when it declares none."""
    fields: dict[str, Any] = {}
    modules_path = model_dir / "modules.json"
    if modules_path.is_file():
        modules = _json(modules_path)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ModelFormatError(f"{modules_path}: expected a list of module objects")
        for module in modules:
            kind = module.get("type")
            if kind == _ST_POOLING:
                fields["pooling"] = _st_pooling(model_dir / str(module.get("path", "")) / "config.json")
            elif kind == _ST_NORMALIZE:
                fields["pooling_normalize"] = True
            elif kind != _ST_TRANSFORMER:
                raise UnsupportedModelError(f"{modules_path}: sentence-transformers module {str(kind)[:80]!r} is not "
                                            "supported (vkrt runs Transformer, Pooling and Normalize)")
        fields.setdefault("pooling_normalize", False)
    # Qwen3-Embedding (Qwen3 with last-token pooling) is trained for truncated (Matryoshka) embeddings;
    # other checkpoints say so in config.json as vLLM reads it.
    qwen3_embedding = architecture == "qwen3" and fields.get("pooling") == "last"
    if cfg.get("is_matryoshka") is True or cfg.get("matryoshka_dimensions") or qwen3_embedding:
        fields["matryoshka"] = True
    return fields


def _st_pooling(path: Path) -> str:
    if not path.is_file():
        raise ModelFormatError(f"{path}: modules.json names a Pooling module but its config.json is missing")
    config = _json(path)
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True] \
        if isinstance(config, dict) else []
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise UnsupportedModelError(f"{path}: pooling modes {modes} are not supported; vkrt pools with exactly one "
                                    f"of {', '.join(_ST_MODES)}")
    return _ST_MODES[modes[0]]


def gguf_pooling(path: Path, value: Any, labels: Any, weights: dict[str, WeightData]) -> dict[str, Any]:
    """ModelConfig fields from GGUF's `<arch>.pooling_type` (None: absent) and, for rank, its head
    (moved into `weights` as the LM head) and `labels`. llama.cpp normalises its embeddings by
    default, so a GGUF that declares pooling is normalised too."""
    head = weights.pop(GGUF_CLASSIFIER, None)
    if value is None or value == 0:
        if head is not None:
            raise ModelFormatError(f"{path}: has a {GGUF_CLASSIFIER} head but no pooling_type rank (4); the file is "
                                   "not one llama.cpp's converter wrote")
        return {}
    if value not in _GGUF_POOLING:
        raise UnsupportedModelError(f"{path}: pooling_type {value!r} is not supported (vkrt pools 1 mean, 2 cls, "
                                    "3 last, 4 rank)")
    fields: dict[str, Any] = {"pooling": _GGUF_POOLING[value], "pooling_normalize": True}
    if value == GGUF_RANK:
        if head is None or len(head.shape) != 2:
            raise ModelFormatError(f"{path}: pooling_type rank (4) needs a [labels, hidden] {GGUF_CLASSIFIER} tensor")
        weights["lm_head"] = WeightData("lm_head", head.fmt, head.shape, head.data, head.row_order, head.row_scale)
        names = tuple(str(label) for label in labels) if isinstance(labels, list) else ()
        fields |= {"num_labels": head.shape[0], "tie_word_embeddings": False,
                   "classifier_labels": names if len(names) == head.shape[0] else ()}
    return fields


def num_labels(config_path: Path, cfg: dict[str, Any], archs: list[Any]) -> int:
    """The labels of a sequence-classification checkpoint's head (0: it is a causal LM)."""
    if not any(isinstance(a, str) and a.endswith(SEQUENCE_CLASSIFICATION) for a in archs):
        return 0
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    if isinstance(labels, bool) or not isinstance(labels, int) or labels < 1:
        raise ModelFormatError(f"{config_path}: num_labels must be a positive count, got {labels!r}")
    return labels
