"""Which models a multi-model server may run: names from `--model` (repeated) and `--models-dir`.

A request's `model` is only ever looked up here, by exact name: it never becomes a path, a pull or
anything else the server reads, so `../`, absolute paths and URLs name nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vkrt.errors import VkrtError
from vkrt.loader.pull import resolve_model
from vkrt.server.config import ServerConfig

GGUF_SUFFIX = ".gguf"


def model_paths(specs: list[str], models_dir: str | Path | None) -> dict[str, Path]:
    """name -> model path: each `--model` spec (a path or a pulled model's name) and each model in
    `models_dir` (a `.gguf` file by its stem, an HF directory holding config.json by its name)."""
    found: list[tuple[str, Path, str]] = []
    for spec in specs:
        path, pulled = resolve_model(spec)
        found.append((pulled or _name_of(path), path, f"--model {spec}"))
    if models_dir is not None:
        folder = Path(models_dir).expanduser()
        if not folder.is_dir():
            raise VkrtError(f"--models-dir {folder}: not a directory")
        entries = [p for p in sorted(folder.iterdir()) if _is_model(p)]
        if not entries:
            raise VkrtError(f"--models-dir {folder}: holds no model (a .gguf file, or a directory with config.json)")
        found += [(_name_of(p), p, f"--models-dir {folder}") for p in entries]
    models: dict[str, Path] = {}
    origin: dict[str, str] = {}
    for name, path, where in found:
        if name in models:
            raise VkrtError(f"two models are named {name!r} ({origin[name]} and {where}); a request names a model "
                            "by its file stem or directory name, so rename one")
        models[name], origin[name] = path, where
    return models


def child_configs(base: ServerConfig, models: dict[str, Path]) -> dict[str, ServerConfig]:
    """One `vkrt serve` config per model: the engine flags of `base`, on loopback, without the page
    (the multi-model server answers / itself) or an access log (it logs the requests once), named
    as the catalog names it."""
    return {name: dataclasses.replace(base, model=path, served_model_name=name, host="127.0.0.1", port=0,
                                      disable_ui=True, allowed_origins=(), uvicorn_log_level="warning")
            for name, path in models.items()}


def _name_of(path: Path) -> str:
    return path.stem if path.suffix == GGUF_SUFFIX else path.name


def _is_model(path: Path) -> bool:
    if path.is_file():
        return path.suffix == GGUF_SUFFIX
    return path.is_dir() and (path / "config.json").is_file()
