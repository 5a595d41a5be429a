"""spirv_gen: --check on this checkout and on a doctored copy, reflection, manifest vs .spv."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spirv_gen import __main__ as gen
from spirv_gen.reflect import reflect
from vkrt.core.formats import FORMATS

REPO = Path(__file__).resolve().parents[1]
SPIRV = REPO / "vkrt" / "spirv"


@pytest.fixture(scope="module")
def glslang() -> str:
    try:
        return gen.find_glslang()
    except SystemExit as exc:  # find_glslang exits with the install hint
        pytest.skip(f"glslangValidator {gen.GLSLANG_VERSION} is not installed: {exc}")


def run_gen(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spirv_gen", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


# `python -m spirv_gen --check` on this checkout is a step of tools/test.sh (CI), so it is
# not repeated here; these tests prove the check itself can fail and names what is stale.


@pytest.fixture
def small_tree(glslang: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A generated copy of the tree holding one shader family (compiling all of shaders/
    three times would dominate the suite on 2 cores); the code paths are the same. Its
    compile cache is its own (<tmp_path>/cache/spirv), empty at first."""
    monkeypatch.setenv("VKRT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "shaders").mkdir()
    shutil.copy2(REPO / "shaders" / "elementwise.comp", tmp_path / "shaders")
    shutil.copytree(REPO / "shaders" / "include", tmp_path / "shaders" / "include")
    shutil.copytree(REPO / "spirv_gen", tmp_path / "spirv_gen", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "vkrt" / "spirv").mkdir(parents=True)
    # A stale leftover from another shader: generation removes it, so --check can pass.
    shutil.copy2(next(SPIRV.glob("*.spv")), tmp_path / "vkrt" / "spirv" / "leftover.spv")
    generated = run_gen("--root", str(tmp_path), cwd=tmp_path)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert not (tmp_path / "vkrt" / "spirv" / "leftover.spv").exists()
    return tmp_path


def test_check_names_the_shader_whose_code_changed(small_tree: Path) -> None:
    clean = run_gen("--check", "--root", str(small_tree), cwd=small_tree)
    assert clean.returncode == 0, clean.stdout

    source = small_tree / "shaders" / "elementwise.comp"
    text = source.read_text()
    # The bounds check before any variant #if: `>=` -> `> ` is one byte and changes the code
    # of every elementwise module.
    bounds = re.search(r"if \(i >= pc\.n\) return;", text)
    assert bounds, "elementwise.comp lost its bounds check; pick another one-byte code change"
    at = bounds.start() + len("if (i >")
    source.write_text(text[:at] + " " + text[at + 1:])

    stale = run_gen("--check", "--root", str(small_tree), cwd=small_tree)
    assert stale.returncode == 1, stale.stdout
    named = set(re.findall(r"^\s+(\S+) \(from shaders/(\S+)\)$", stale.stdout, re.MULTILINE))
    modules = {v.module for v in gen.variants(small_tree / "shaders")}
    assert len(modules) > 1 and all(m.startswith("elementwise.") for m in modules)
    assert {m for m, _ in named} == modules, stale.stdout
    assert {src for _, src in named} == {"elementwise.comp"}
    assert "manifest.json" in stale.stdout  # its spirv/source hashes changed too

    # A comment-only change: -g0 keeps every module's bytes, only the source hash moves.
    source.write_text(text + "// a trailing comment\n")
    commented = run_gen("--check", "--root", str(small_tree), cwd=small_tree)
    assert commented.returncode == 1
    assert "(from shaders/" not in commented.stdout
    assert "manifest.json" in commented.stdout


def test_reruns_compile_only_what_changed(small_tree: Path) -> None:
    """Each compiled module is kept under the hash of its inputs: a rerun reuses them, an edit
    to one shader compiles that shader's modules again (new entries), --no-cache reuses none,
    and what the cache holds is what the compiler wrote."""
    cache = small_tree / "cache" / "spirv"
    modules = {v.module for v in gen.variants(small_tree / "shaders")}
    first = set(cache.glob("*.spv"))
    assert len(first) == len(modules)
    committed = {(small_tree / "vkrt" / "spirv" / f"{m}.spv").read_bytes() for m in modules}
    assert {p.read_bytes() for p in first} == committed

    source = small_tree / "shaders" / "elementwise.comp"
    source.write_text(source.read_text() + "// a comment: new inputs, the same bytes\n")
    assert run_gen("--root", str(small_tree), cwd=small_tree).returncode == 0
    second = set(cache.glob("*.spv"))
    assert len(second - first) == len(modules)  # every module of the edited shader, again

    for entry in second - first:  # a wrong entry would be trusted: --no-cache does not read it
        entry.write_bytes(b"not spir-v")
    assert run_gen("--check", "--root", str(small_tree), cwd=small_tree).returncode == 1
    clean = run_gen("--check", "--no-cache", "--root", str(small_tree), cwd=small_tree)
    assert clean.returncode == 0, clean.stdout


# -- variant lists ----------------------------------------------------------------------------

def write_shader(tmp_path: Path, header: str) -> Path:
    source = tmp_path / "probe.comp"
    source.write_text(header + "#version 450\nvoid main() {}\n")
    return source


def test_variants_are_the_product_less_the_exclusions(tmp_path: Path) -> None:
    source = write_shader(tmp_path, "//! variants: F=a,b,c E=x,y,z P=t,s\n"
                                    "//! exclude: F=b,c E=z\n//! exclude: F=a E=y P=s\n")
    got = {v.module: v.defines for v in gen.shader_variants(source)}
    every = {(f, e, p) for f in "abc" for e in "xyz" for p in "ts"}
    dropped = {(f, "z", p) for f in "bc" for p in "ts"} | {("a", "y", "s")}
    assert set(got) == {f"probe.{f}.{e}.{p}" for f, e, p in every - dropped}
    assert got["probe.a.z.s"] == ("F_A", "E_Z", "P_S")
    plain = write_shader(tmp_path, "//! variants: F=a,b\n")
    assert [v.module for v in gen.shader_variants(plain)] == ["probe.a", "probe.b"]


@pytest.mark.parametrize(("header", "message"), [
    ("//! variants: F=a,b\n//! exclude: G=a\n", "names no variant axis G"),
    ("//! variants: F=a,b\n//! exclude: F=c\n", "names unknown values c"),
    ("//! variants: F=a,b E=x\n//! exclude: F=a\n//! exclude: F=a E=x\n", "matches no variant"),
    ("//! variants: F=a,b F=c\n", "malformed variant item"),
])
def test_bad_exclusions_are_one_line_errors(tmp_path: Path, header: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        gen.shader_variants(write_shader(tmp_path, header))


# -- reflection on purpose-written shaders -----------------------------------------------

def compile_glsl(glslang: str, tmp_path: Path, source: str) -> bytes:
    path = tmp_path / "probe.comp"
    path.write_text(source)
    out = tmp_path / "probe.spv"
    result = subprocess.run([glslang, *gen.FLAGS, "-o", str(out), str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return out.read_bytes()


BINDINGS_SHADER = """#version 450
#extension GL_EXT_samplerless_texture_functions : require
layout(local_size_x = 8) in;
layout(set = 0, binding = 0, std430) readonly buffer In { float a[]; };
layout(set = 0, binding = 1, std430) writeonly buffer Out { float y[]; };
layout(set = 0, binding = 2, std430) buffer Both { float z[]; };
layout(set = 0, binding = 3) uniform samplerBuffer tex;
layout(set = 0, binding = 4) uniform textureBuffer tex_plain;
layout(set = 0, binding = 5, r32f) uniform readonly imageBuffer img_in;
layout(set = 0, binding = 6, r32f) uniform writeonly imageBuffer img_out;
layout(set = 0, binding = 7) uniform Params { uint n; float s; } params;
layout(set = 1, binding = 0, std430) buffer Partly { readonly uint head; float tail[]; };
void main() {
    uint i = gl_GlobalInvocationID.x;
    float v = a[i] + texelFetch(tex, int(i)).x + texelFetch(tex_plain, int(i)).x
            + imageLoad(img_in, int(i)).x + z[i] + float(head) * params.s;
    y[i] = v;
    z[i] = v * 2.0;
    tail[i] = v;
    imageStore(img_out, int(i), vec4(v));
}
"""


def test_reflect_binding_kinds_and_writes(glslang: str, tmp_path: Path) -> None:
    meta = reflect(compile_glsl(glslang, tmp_path, BINDINGS_SHADER))
    got = {(b["set"], b["binding"]): (b["type"], b["written"]) for b in meta["bindings"]}
    assert got == {
        (0, 0): ("storage_buffer", False),
        (0, 1): ("storage_buffer", True),
        (0, 2): ("storage_buffer", True),
        (0, 3): ("uniform_texel_buffer", False),
        (0, 4): ("uniform_texel_buffer", False),
        (0, 5): ("storage_texel_buffer", False),
        (0, 6): ("storage_texel_buffer", True),
        (0, 7): ("uniform_buffer", False),
        (1, 0): ("storage_buffer", True),  # one writable member makes the binding written
    }
    assert [(b["set"], b["binding"]) for b in meta["bindings"]] == sorted(got)  # ordered
    assert meta["push_constant_size"] == 0
    assert meta["local_size"] == [8, 1, 1]


@pytest.mark.parametrize(("members", "use", "size"), [
    ("uint n;", "float(pc.n)", 4),
    ("uint n; float s; uvec2 r;", "float(pc.n + pc.r.y) * pc.s", 16),
    ("vec3 v; float w;", "pc.v.z + pc.w", 16),  # the float packs into the vec3's tail
    ("uint a; uint b[5];", "float(pc.a + pc.b[4])", 24),
    ("float x; vec4 q;", "pc.x + pc.q.w", 32),  # vec4 aligns to 16
])
def test_reflect_push_constant_size(glslang: str, tmp_path: Path, members: str, use: str,
                                    size: int) -> None:
    source = f"""#version 450
layout(local_size_x = 1) in;
layout(push_constant) uniform Push {{ {members} }} pc;
layout(set = 0, binding = 0, std430) writeonly buffer Out {{ float y[]; }};
void main() {{ y[0] = {use}; }}
"""
    meta = reflect(compile_glsl(glslang, tmp_path, source))
    assert meta["push_constant_size"] == size
    assert [b["binding"] for b in meta["bindings"]] == [0]


def test_reflect_spec_constant_ids_and_defaults(glslang: str, tmp_path: Path) -> None:
    source = """#version 450
layout(local_size_x_id = 0) in;
layout(constant_id = 3) const uint ROWS = 7;
layout(constant_id = 5) const bool FAST = true;
layout(constant_id = 6) const bool SLOW = false;
layout(constant_id = 9) const int TILE = 12;
layout(set = 0, binding = 0, std430) writeonly buffer Out { uint y[]; };
void main() { y[gl_GlobalInvocationID.x] = ROWS + uint(FAST) + uint(SLOW) + uint(TILE); }
"""
    meta = reflect(compile_glsl(glslang, tmp_path, source))
    assert meta["spec_constants"] == {"0": 1, "3": 7, "5": 1, "6": 0, "9": 12}


def test_reflect_rejects_non_spirv() -> None:
    with pytest.raises(ValueError, match="not a SPIR-V module"):
        reflect(b"\0" * 64)


# -- the committed manifest ------------------------------------------------------------------

def test_manifest_matches_committed_spirv() -> None:
    manifest = json.loads((SPIRV / "manifest.json").read_text())
    modules = manifest["modules"]
    on_disk = {p.stem for p in SPIRV.glob("*.spv")}
    assert set(modules) == on_disk
    assert manifest["glslang"] == gen.GLSLANG_VERSION and manifest["flags"] == gen.FLAGS
    for name, meta in modules.items():
        blob = (SPIRV / f"{name}.spv").read_bytes()
        assert hashlib.sha256(blob).hexdigest() == meta["spirv_sha256"], name
        reflected = reflect(blob)
        for key in ("bindings", "push_constant_size", "spec_constants", "local_size"):
            assert meta[key] == reflected[key], (name, key)
        assert (REPO / "shaders" / meta["source"]).is_file(), name


def test_matmul_vec_fuses_by_spec_constant() -> None:
    """matmul_vec's fused norm and residual add are spec constant 6 (FUSE) of one `plain`
    module per format and access path, whose norm-weight and residual bindings (4, 5) are
    always declared; only the qkv epilogue, with bindings and push constants of its own, is a
    variant. So the modules are formats x {plain, qkv} x access paths, and the manifest's
    layouts are the ones dispatch_matmul binds."""
    modules = json.loads((SPIRV / "manifest.json").read_text())["modules"]
    vec = {name: meta for name, meta in modules.items() if meta["source"] == "matmul_vec.comp"}
    assert {name.split(".")[1] for name in vec} == set(FORMATS)  # every registered format
    assert len(vec) == len(FORMATS) * 2 * 2, sorted(vec)
    for name, meta in vec.items():
        _, _, epilogue, access = name.split(".")
        assert epilogue in ("plain", "qkv") and access in ("texel", "ssbo"), name
        numbers = [b["binding"] for b in meta["bindings"]]
        written = [b["binding"] for b in meta["bindings"] if b["written"]]
        if epilogue == "plain":
            assert {"6", "12"} <= set(meta["spec_constants"]), name  # FUSE, BIAS
            assert numbers[-2:] == [4, 5] and written == [2], name  # norm weight, residual
            assert meta["push_constant_size"] == 28, name
        else:
            assert not {"6", "12"} & set(meta["spec_constants"]) and "9" in meta["spec_constants"], name
            assert numbers[-6:] == [4, 5, 6, 7, 8, 9] and written == [2, 7, 8], name  # y, k and v caches
            assert meta["push_constant_size"] == 52, name
