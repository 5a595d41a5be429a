"""Architectures, looked up by ModelConfig.architecture."""

from __future__ import annotations

from vkrt.backend.base import Backend
from vkrt.errors import UnsupportedModelError
from vkrt.loader.arch import ARCHS
from vkrt.loader.config import LoadedModel
from vkrt.models.base import (
    CausalLM,
    ForwardBatch,
    KVCache,
    Stage,
    StepTensors,
    split_layers,
    unsplittable,
)
from vkrt.models.decoder import DecoderModel

# Every family the loader reads (an ArchSpec row) is a configuration of the generic decoder.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {spec.name: DecoderModel for spec in ARCHS}


def build_model(loaded: LoadedModel, backend: Backend, stage: Stage | None = None) -> CausalLM:
    """Instantiate the architecture of `loaded` on `backend` (weights uploaded as stored); a
    pipeline `stage` holds only its layers."""
    cls = MODEL_REGISTRY.get(loaded.config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"{loaded.path}: architecture {loaded.config.architecture!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_REGISTRY))})")
    model = cls(loaded, backend, stage)
    model.file_type = loaded.file_type
    return model


__all__ = ["MODEL_REGISTRY", "CausalLM", "ForwardBatch", "KVCache", "Stage", "StepTensors", "build_model",
           "split_layers", "unsplittable"]
