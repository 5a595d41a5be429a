"""Model loading: a GGUF file or a Hugging Face directory -> LoadedModel (canonical names)."""

from __future__ import annotations

from pathlib import Path

from vkrt import config as env
from vkrt.errors import ModelFormatError
from vkrt.loader import gguf_checks, validate
from vkrt.loader.config import LoadedModel, ModelConfig, WeightData
from vkrt.loader.gguf_loader import GGUF_MAGIC, load_gguf
from vkrt.loader.hf_loader import load_hf_dir

__all__ = ["LoadedModel", "ModelConfig", "WeightData", "load_model"]


def load_model(path: str | Path, *, check_tensors: bool | None = None) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face model directory (config.json + safetensors).

    `check_tensors` (None: VKRT_CHECK_TENSORS) scans every weight for NaN / Inf, as
    llama.cpp's --check-tensors does; off by default because it reads the whole file."""
    if check_tensors is None:
        check_tensors = env.check_tensors()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFormatError(
            f"{p}: no such file or directory; pass a .gguf file or a Hugging Face model "
            "directory (or run `vkrt pull` for the default model)"
        )
    if p.is_dir():
        loaded = load_hf_dir(p)
        if check_tensors:
            gguf_checks.tensor_values(str(p), loaded.weights)
        return loaded
    with validate.regular_file(p).open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(
            f"{p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); pass a .gguf "
            "file or a Hugging Face model directory"
        )
    return load_gguf(p, check_tensors=check_tensors)
