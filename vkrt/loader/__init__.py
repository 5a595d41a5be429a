"""Model loading: a GGUF file or a Hugging Face directory -> LoadedModel (canonical names)."""

from __future__ import annotations

from pathlib import Path

from vkrt.errors import ModelFormatError
from vkrt.loader import validate
from vkrt.loader.config import LoadedModel, ModelConfig, WeightData
from vkrt.loader.gguf_loader import GGUF_MAGIC, load_gguf
from vkrt.loader.hf_loader import load_hf_dir

__all__ = ["LoadedModel", "ModelConfig", "WeightData", "load_model"]


def load_model(path: str | Path) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face model directory (config.json + safetensors)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFormatError(
            f"{p}: no such file or directory; pass a .gguf file or a Hugging Face model "
            "directory (or run `vkrt pull` for the default model)"
        )
    if p.is_dir():
        return load_hf_dir(p)
    with validate.regular_file(p).open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(
            f"{p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); pass a .gguf "
            "file or a Hugging Face model directory"
        )
    return load_gguf(p)
