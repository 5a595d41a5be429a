"""Every kernel configuration a device could select, run on this device against the numpy
reference (tests/backend/device_configs.py derives them from the selection functions).

Each matmul case imposes a synthetic device's capability fields (the ones its selection
reads) on the test device and its default access path, runs the op through the normal
kernel selection and checks that the dispatch used the case's specialisation constants.
So a GPU's split-K with 16 or 32 lanes, its 4-row token tiles, and a CPU's 32-row tiles
all run here, at K >= 1024 and >= 4096 (odd block counts) where the selection allows.
The residual and bias epilogues (matmul_add, rms_norm_matmul_add) are also run unfused in
the same configuration and must equal that bit for bit.
The row kernels (norm.comp) and sample_top_k get every lane count likewise;
paged_attention's subgroup split needs a subgroup of its lane count, which llvmpipe
provides up to 16 lanes when its vector width is set (LP_NATIVE_VECTOR_WIDTH = 32 x lanes),
in a child process since one process holds one device.

Bounds (NMSE vs the float64 reference), each ~10x the worst measured over every case here
on llvmpipe: matmul family 1e-11 (measured 9.2e-13, rms_gated at K = 4192; plain matmul
2.1e-13); f16 KV-cache rows 1e-7 (measured 1.1e-8: one f16 rounding of values whose f32
inputs differ in the last bits); norms 3e-12 (measured 2.6e-13, rms_norm);
paged attention 5e-13 (measured 5.4e-14); sample_top_k ids exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.backend import device_configs as dc
from tests.conftest import nmse
from tests.ops.test_matmul import make_weight
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.device import default_access_path
from vkrt.backend.vulkan.kernels import attention as attention_kernels
from vkrt.backend.vulkan.kernels import matmul as native

REPO = Path(__file__).resolve().parents[2]
MATMUL_NMSE = 1e-11
F16_CACHE_NMSE = 1e-7
ROW_NMSE = 3e-12
ATTENTION_NMSE = 5e-13
EPS = 1e-5
MATMUL_CASES = dc.matmul_cases()
ADD_MODES = ("add", "bias", "rms_add", "rms_bias")  # also run unfused: the fused result must be its bits


class Dispatches:
    """Records (module, spec constants) of every shader the backend runs."""

    def __init__(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, dict[int, int]]] = []
        original = backend.run_shader  # type: ignore[attr-defined]

        def spy(name: str, bindings: Any, groups: Any, push: Any, spec: dict[int, int]) -> Any:
            self.seen.append((name, dict(spec)))
            return original(name, bindings, groups, push, spec)

        monkeypatch.setattr(backend, "run_shader", spy)

    def of(self, family: str) -> list[dict[int, int]]:
        return [spec for name, spec in self.seen if name.split(".")[0] == family]


@pytest.fixture
def device_as(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A function imposing capability fields (and their default access path) on the device."""
    caps: Any = vk_default.caps  # type: ignore[attr-defined]
    previous = caps.access_path

    def impose(values: dict[str, Any], access: str | None = None) -> Backend:
        for name, value in values.items():
            monkeypatch.setattr(caps, name, value)
        vk_default.set_access_path(access or default_access_path(caps))  # type: ignore[attr-defined]
        return vk_default

    yield impose
    monkeypatch.undo()
    vk_default.set_access_path(previous)  # type: ignore[attr-defined]


def _cos_sin(max_pos: int, rot: int) -> np.ndarray:
    angles = np.outer(np.arange(max_pos), 10000.0 ** (-np.arange(rot // 2) * 2.0 / rot))
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def _run_matmul_mode(vk: Backend, rng: np.random.Generator, mode: str, dtype: str, n: int, k: int,
                     t: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Run `mode` at (n, k, t); (what, got, expected) pairs ("unfused": expected bit for bit)."""
    gated = mode in ("gated", "rms_gated")
    raw, dense = make_weight(rng, dtype, 2 * n if gated else n, k)
    w = vk.upload_weight(raw, dtype, dense.shape)
    x = rng.standard_normal((t, k)).astype(np.float32)
    xt = vk.upload(x)
    if mode == "matmul":
        return [("y", ops.matmul(xt, w).numpy(), ops.OPS["matmul"].reference(x, dense))]
    if mode == "gated":
        return [("y", ops.matmul_silu_and_mul(xt, w).numpy(), ops.OPS["matmul_silu_and_mul"].reference(x, dense))]
    if mode in ("add", "bias"):
        r = rng.standard_normal((t, n) if mode == "add" else n).astype(np.float32)
        got = ops.matmul_add(xt, w, vk.upload(r)).numpy()
        unfused = ops.add(ops.matmul(xt, w), vk.upload(r)).numpy()  # this module runs with fusion off
        return [("y", got, ops.OPS["matmul_add"].reference(x, dense, r)), ("unfused", got, unfused)]
    g = (1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32)
    if mode in ("rms_add", "rms_bias"):
        r = rng.standard_normal((t, n) if mode == "rms_add" else n).astype(np.float32)
        got = ops.rms_norm_matmul_add(xt, vk.upload(g), w, vk.upload(r), EPS).numpy()
        unfused = ops.add(ops.rms_norm_matmul(xt, vk.upload(g), w, EPS), vk.upload(r)).numpy()
        return [("y", got, ops.OPS["rms_norm_matmul_add"].reference(x, g, dense, r, EPS)), ("unfused", got, unfused)]
    if mode in ("rms", "rms_gated"):
        got = ops.rms_norm_matmul(xt, vk.upload(g), w, EPS, gated=gated).numpy()
        return [("y", got, ops.OPS["rms_norm_matmul"].reference(x, g, dense, EPS, gated))]
    heads, kv_heads, head_dim = dc.QKV_HEADS
    kv = "f16" if mode == "qkv16" else "f32"
    np_kv = np.float16 if kv == "f16" else np.float32
    blocks, block, max_pos = 8, 4, 64
    cache_shape = (blocks, block, kv_heads * head_dim)
    k0, v0 = (rng.standard_normal(cache_shape).astype(np_kv) for _ in range(2))
    positions = rng.integers(0, max_pos, t).astype(np.int32)
    slots = rng.permutation(blocks * block)[:t].astype(np.int32)
    cs = _cos_sin(max_pos, head_dim)
    kc, vc = vk.upload(k0, kv), vk.upload(v0, kv)
    q = ops.rms_norm_qkv_rope_kv_write(xt, vk.upload(g), w, vk.upload(positions), vk.upload(cs), kc, vc,
                                       vk.upload(slots), EPS, heads, kv_heads, head_dim).numpy()
    ref_k, ref_v = k0.copy(), v0.copy()
    ref_q = ops.OPS["rms_norm_qkv_rope_kv_write"].reference(x, g, dense, positions, cs, ref_k, ref_v, slots, EPS,
                                                             heads, kv_heads, head_dim)
    rows = lambda a: a.reshape(blocks * block, -1)[slots].astype(np.float32)  # noqa: E731
    # f16 caches: the kernel and numpy each round the same f32 value once; rounding
    # differences of the f32 inputs show as at most one f16 step (relative 2^-11).
    return [("q", q, ref_q), ("k", rows(kc.numpy()), rows(ref_k)), ("v", rows(vc.numpy()), rows(ref_v))]


@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c.id for c in MATMUL_CASES])
def test_matmul_configuration(case: dc.MatmulCase, device_as: Any, rng: np.random.Generator,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    vk = device_as(dict(case.device), _access_path(case))
    dispatches = Dispatches(vk, monkeypatch)
    cfg = case.config
    for n, k, t in case.shapes:
        assert dc.matmul_config(vk.caps, case.mode, case.dtype, n, k, t) == cfg  # type: ignore[attr-defined]
        dispatches.seen.clear()
        drains = vk.counters.drains
        for what, got, want in _run_matmul_mode(vk, rng, case.mode, case.dtype, n, k, t):
            if what == "unfused":
                assert got.tobytes() == want.tobytes(), f"{case.id} N={n} K={k} T={t}: fused != unfused"
                continue
            bound = F16_CACHE_NMSE if case.mode == "qkv16" and what in ("k", "v") else MATMUL_NMSE
            err = nmse(got, want)
            assert err <= bound, f"{case.id} N={n} K={k} T={t} {what}: NMSE {err:.3g}"
        assert vk.counters.drains == drains
        # The fused op's dispatch first, then for ADD_MODES the unfused composition's matmul.
        seen = [(name.split(".")[0], spec) for name, spec in dispatches.seen if name.startswith("matmul_")]
        assert len(seen) == (2 if case.mode in ADD_MODES else 1), f"{case.id}: {len(seen)} matmul dispatches"
        shader, spec = seen[0]
        assert shader == cfg.shader, f"{case.id}: ran {shader}"
        bias_constant = 14 if shader == "matmul_tiled" else 12
        assert spec.get(bias_constant, 0) == int(case.mode in ("bias", "rms_bias")), f"{case.id}: bias constant"
        ran = (spec[0], spec[1], spec[3], spec[8])
        assert ran == (cfg.workgroup, cfg.rows, cfg.tokens, cfg.split), f"{case.id}: dispatched {ran}"
        if shader == "matmul_tiled":
            tile = (spec[5], spec[12], spec[13])
            assert tile == (cfg.lanes, cfg.lane_rows, cfg.lane_tokens), f"{case.id}: dispatched {tile}"


def _access_path(case: dc.MatmulCase) -> str | None:
    """The device's own path (None), but the texel path for a GPU's fused modes on matmul_vec.
    Plain matmul on every format, at every lane split and token tile, and matmul_tiled (which
    runs on storage buffers only) keep the GPUs' storage-buffer path: they are where each format's
    loads meet each configuration. A fused prologue or epilogue (norm, gate, add, bias, qkv) is the
    same GLSL around the same loads on both paths, and llvmpipe compiles the texel one several
    times faster (docs/TESTING.md)."""
    if case.mode == "matmul" or case.config.shader == "matmul_tiled":
        return None
    return "texel"


def test_matmul_cases_cover_every_reachable_configuration() -> None:
    """The parametrised cases cover every coverage key of every configuration on the grid."""
    covered = set().union(*(dc.matmul_coverage(c.mode, c.dtype, c.config) for c in MATMUL_CASES))
    wanted = set().union(*(dc.matmul_coverage(*key) for key in dc.matmul_reachable()))
    assert not wanted - covered, f"configurations no test runs: {sorted(map(str, wanted - covered))[:5]}"
    splits = {c.config.split for c in MATMUL_CASES}
    assert {16, 32} <= splits, "the GPU split-K lane counts must be among the cases"
    assert any(k >= 4096 and c.config.split == 32 for c in MATMUL_CASES for _, k, _ in c.shapes)
    tiled = [c for c in MATMUL_CASES if c.config.shader == "matmul_tiled"]
    assert {c.dtype for c in tiled if c.mode == "matmul"} == set(native.FORMATS), "GPU prefill in every format"
    assert any(k >= 4096 and c.config.split == 32 for c in tiled for _, k, _ in c.shapes)


def test_matmul_grid_misses_no_configuration() -> None:
    """Random shapes beyond the grid select nothing the grid did not (its thresholds are dense
    enough), on every distinct synthetic device."""
    rng = np.random.default_rng(7)
    known = set(dc.matmul_reachable())
    _, devices = dc.representatives(dc._probe_matmul)
    for caps in devices:
        for _ in range(300):
            mode = dc.MODES[rng.integers(len(dc.MODES))]
            dtype = native.FORMATS[rng.integers(len(native.FORMATS))]
            n = dc.QKV_ROWS if mode.startswith("qkv") else int(rng.integers(1, 1 << 17))
            block = 256 if dtype in dc.K_QUANTS else 1 if dtype in dc.FLOATS else 32
            k, t = block * int(rng.integers(1, 9000 // block)), int(rng.integers(1, 300))
            assert (mode, dtype, dc.matmul_config(caps, mode, dtype, n, k, t)) in known, (mode, dtype, n, k, t)


# ------------------------------------------------------------------------------ row kernels

ROW_CASES = sorted(dc.reachable("row"))


@pytest.mark.parametrize("lanes", ROW_CASES)
def test_row_kernels_at_every_lane_count(lanes: int, device_as: Any, rng: np.random.Generator,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms (rms, rms + residual, layer) with the lanes a device would choose."""
    caps = dc.reachable("row")[lanes]
    vk = device_as(dc.device_fields(caps, dc.fields_of("row")))
    dispatches = Dispatches(vk, monkeypatch)
    for rows, dim in ((3, 1), (5, 37), (2, 1031), (3, 4099)):
        x = (rng.standard_normal((rows, dim)) * 3 + 0.5).astype(np.float32)
        r = rng.standard_normal((rows, dim)).astype(np.float32)
        w = (1 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
        b = rng.standard_normal(dim).astype(np.float32)
        xt, rt, wt = vk.upload(x), vk.upload(r), vk.upload(w)
        label = f"lanes={lanes} {rows}x{dim}"
        assert nmse(ops.rms_norm(xt, wt, EPS).numpy(), ops.OPS["rms_norm"].reference(x, w, EPS)) <= ROW_NMSE, label
        got = ops.rms_norm_add(xt, wt, rt, EPS).numpy()
        assert nmse(got, ops.OPS["rms_norm_add"].reference(x, w, r, EPS)) <= ROW_NMSE, label
        got = ops.layer_norm(xt, wt, vk.upload(b), EPS).numpy()
        assert nmse(got, ops.OPS["layer_norm"].reference(x, w, b, EPS)) <= ROW_NMSE, label
    specs = [spec[0] for spec in dispatches.of("norm")]
    assert specs and set(specs) == {lanes}


# Fewer than 8 lanes (a CPU whose subgroup is 1 or 4 lanes) used to be reachable and drew
# other ids than the reference at vocab >= 4096: llvmpipe's 65535-back-edge loop limit cut
# the lanes' scans short. sample_workgroup now takes at least 8 (docs/TESTING.md).
SAMPLE_CASES = sorted(dc.reachable("sample"))


@pytest.mark.parametrize("lanes", SAMPLE_CASES)
def test_sample_top_k_at_every_lane_count(lanes: int, device_as: Any, rng: np.random.Generator,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.ops.test_sample import random_params

    caps = dc.reachable("sample")[lanes]
    vk = device_as(dc.device_fields(caps, dc.fields_of("sample")))
    dispatches = Dispatches(vk, monkeypatch)
    for rows, vocab in ((3, 7), (4, 1001), (8, 8192), (8, 8192), (8, 8192), (2, 49152)):
        x = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
        params, u = random_params(rng, rows), rng.random(rows).astype(np.float32)
        got = ops.sample_top_k(vk.upload(x), vk.upload(params), vk.upload(u)).numpy()
        np.testing.assert_array_equal(got, ops.OPS["sample_top_k"].reference(x, params, u))
    assert {spec[0] for spec in dispatches.of("sample")} == {lanes}


# ------------------------------------------------------------------------- paged attention

def _paged_checks(vk: Backend, rng: np.random.Generator) -> int:
    """paged_attention vs its reference on a few shapes (contexts 1..300, GQA); returns cases.
    The 300-position table spans two PAGED_CHUNKs: where the configuration splits the
    context, that call runs split."""
    from tests.ops.test_attention import _paged_case

    count = 0
    for lengths, heads, kv_heads, head_dim, kv in (([1, 37], 4, 2, 16, "f32"), ([300, 5, 64], 6, 2, 32, "f16"),
                                                  ([129], 2, 1, 64, "f32")):
        c = _paged_case(rng, lengths, heads, kv_heads, head_dim, kv)
        args = [vk.upload(c["q"]), vk.upload(c["k_cache"], kv), vk.upload(c["v_cache"], kv),
                *(vk.upload(c[name]) for name in ("block_table", "seq_index", "positions"))]
        scale = head_dim ** -0.5
        got = ops.paged_attention(*args, num_heads=heads, num_kv_heads=kv_heads, scale=scale).numpy()
        want = ops.OPS["paged_attention"].reference(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                                    c["seq_index"], c["positions"], heads, kv_heads, scale)
        err = nmse(got, want)
        assert err <= ATTENTION_NMSE, f"{lengths} H={heads} D={head_dim} {kv}: NMSE {err:.3g}"
        count += 1
    return count


# llvmpipe reports subgroupSize = vector width / 32 but compiles compute shaders at most 16
# lanes wide (CPU_MAX_LANES), so no llvmpipe has a subgroup for the 32-lane and wider splits
# (NVIDIA's 32): there a 32-invocation workgroup is two subgroups and the merge drops one.


def _paged_config(caps: Any) -> tuple[str, int, int]:
    """paged_attention's (variant, lanes, chunk): the split over lanes and over the context."""
    return (*attention_kernels.paged_split(caps), attention_kernels.paged_chunk(caps))


PAGED_FIELDS, _PAGED_DEVICES = dc.representatives(dc._probe(_paged_config))
PAGED_REACHABLE: dict[tuple[str, int, int], Any] = {}
for _caps in _PAGED_DEVICES:
    PAGED_REACHABLE.setdefault(_paged_config(_caps), _caps)
PAGED_CASES = sorted(PAGED_REACHABLE)


def _paged_spec_chunks(dispatches: Dispatches, chunk: int) -> None:
    """Both the unsplit walk and, where the configuration splits, the chunked one ran."""
    assert {spec[3] for spec in dispatches.of("paged_attention")} == ({0, chunk} if chunk else {0})


def _paged_child(width: int, chunk: int) -> str:
    """test_paged_attention_on_this_device in a child process whose llvmpipe has `width`-bit vectors."""
    env = {**os.environ, "LP_NATIVE_VECTOR_WIDTH": str(width)}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            f"{Path(__file__).relative_to(REPO)}::test_paged_attention_on_this_device[{chunk}]"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    return child.stdout


@pytest.mark.parametrize("config", PAGED_CASES, ids=[f"{v}{n}-chunk{c}" for v, n, c in PAGED_CASES])
def test_paged_attention_configuration(config: tuple[str, int, int], device_as: Any, vk_default: Backend,
                                       rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (variant, lanes, chunk): here when this device has that subgroup size, else in a
    child process whose llvmpipe is set to that vector width."""
    variant, lanes, chunk = config
    monkeypatch.setattr(attention_kernels, "gqa_heads", lambda group, head_dim: 1)  # the paged kernel, GQA too
    here = vk_default.caps  # type: ignore[attr-defined]
    if variant == "sub" and lanes != here.subgroup_size:
        if "llvmpipe" not in here.name or lanes > attention_kernels.CPU_MAX_LANES:
            pytest.skip(f"subgroup size {lanes} needs a device that has it ({here.name} has {here.subgroup_size}"
                        f"; llvmpipe at most {attention_kernels.CPU_MAX_LANES})")
        out = _paged_child(32 * lanes, chunk)
        assert f"paged_attention ran sub{lanes} chunk {chunk} " in out, out[-2000:]
        return
    vk = device_as(dc.device_fields(PAGED_REACHABLE[config], PAGED_FIELDS))
    dispatches = Dispatches(vk, monkeypatch)
    assert _paged_checks(vk, rng) == 3
    names = [name for name, _ in dispatches.seen if name.split(".")[0] == "paged_attention"]
    assert names and all(f".{variant}." in name for name in names)
    assert {spec[0] for spec in dispatches.of("paged_attention")} == {lanes}
    _paged_spec_chunks(dispatches, chunk)


@pytest.mark.parametrize("chunk", sorted({c for _, _, c in PAGED_CASES}))
def test_paged_attention_on_this_device(chunk: int, vk_default: Backend, rng: np.random.Generator,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_attention with the split this device selects and `chunk` (the child process above)."""
    variant, lanes = attention_kernels.paged_split(vk_default.caps)  # type: ignore[attr-defined]
    monkeypatch.setattr(attention_kernels, "paged_chunk", lambda caps: chunk)
    monkeypatch.setattr(attention_kernels, "gqa_heads", lambda group, head_dim: 1)
    dispatches = Dispatches(vk_default, monkeypatch)
    assert _paged_checks(vk_default, rng) == 3
    assert {spec[0] for spec in dispatches.of("paged_attention")} == {lanes}
    _paged_spec_chunks(dispatches, chunk)
    size = vk_default.caps.subgroup_size  # type: ignore[attr-defined]
    print(f"paged_attention ran {variant}{lanes} chunk {chunk} (subgroup size {size})")


def test_paged_attention_on_wide_llvmpipe(vk_default: Backend) -> None:
    """llvmpipe set to 1024-bit vectors reports 32-lane subgroups but runs 16: the selection
    takes 16 lanes there, and the result matches the reference."""
    if "llvmpipe" not in vk_default.caps.name:  # type: ignore[attr-defined]
        pytest.skip("needs llvmpipe")
    out = _paged_child(1024, 0)
    assert f"paged_attention ran sub{attention_kernels.CPU_MAX_LANES} chunk 0 (subgroup size 32)" in out, out[-2000:]


# ------------------------------------------------------------------- MoE expert matmul

MOE_CASES = sorted(dc.moe_reachable(), key=lambda c: (c.workgroup, c.rows, c.tokens, c.by_expert))


@pytest.mark.parametrize("cfg", MOE_CASES, ids=[f"wg{c.workgroup}-r{c.rows}-t{c.tokens}-e{int(c.by_expert)}"
                                                for c in MOE_CASES])
def test_moe_matmul_configuration(cfg: Any, device_as: Any, rng: np.random.Generator,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each expert-matmul split a device selects, plain or gated, in a float and a super-block
    format, against the reference (the matmul family's bound: the same decode and reduction)."""
    caps, (tokens, top_k, experts), gated = dc.moe_reachable()[cfg]
    vk = device_as(dc.device_fields(caps, dc.moe_fields()))
    dispatches = Dispatches(vk, monkeypatch)
    op = "moe_matmul_gated" if gated else "moe_matmul"
    n = 2 * 67 if gated else 67  # weight rows per expert
    for dtype, k in (("f32", 100), ("q4_k", 512)):
        parts = [make_weight(rng, dtype, n, k) for _ in range(experts)]
        raw = np.concatenate([np.asarray(p[0]) for p in parts])
        w = vk.upload_weight(raw, dtype, (experts, n, k))
        ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        drains = vk.counters.drains
        got = ops.dispatch(op, vk.upload(x), w, vk.upload(ids)).numpy()
        assert vk.counters.drains == drains
        err = nmse(got, ops.OPS[op].reference(x, np.stack([p[1] for p in parts]), ids))
        assert err <= MATMUL_NMSE, f"{cfg} {dtype}: NMSE {err:.3g}"
    specs = dispatches.of("matmul_id")
    assert specs and all((s[0], s[1], s[3], s[4], s[5]) == (cfg.workgroup, cfg.rows, cfg.tokens, 2 if gated else 1,
                                                            int(cfg.by_expert)) for s in specs)


def test_moe_grid_misses_no_configuration() -> None:
    """Random (tokens, k, experts) beyond the grid select nothing the grid did not."""
    from vkrt.backend.vulkan.kernels import moe

    rng = np.random.default_rng(11)
    known = set(dc.moe_reachable())
    _, devices = dc.representatives(dc._probe_moe)
    for caps in devices:
        for _ in range(300):
            experts = int(rng.integers(1, 257))
            k, tokens = int(rng.integers(1, experts + 1)), int(rng.integers(1, 600))
            for gated in dc.MOE_MODES:
                assert moe.expert_config(caps, tokens * k, experts, gated) in known, (tokens, k, experts, gated)


# ------------------------------------------------------------------------- GQA attention

def _gqa_checks(vk: Backend, rng: np.random.Generator) -> int:
    """paged_attention on GQA steps (the GQA kernel) vs its reference; returns cases."""
    from tests.ops.test_gqa_attention import prefill_case, run, want

    count = 0
    for seqs, heads, kv_heads, head_dim, kv, window in (([(0, 37), (5, 20)], 4, 2, 16, "f32", 0),
                                                        ([(0, 300)], 6, 2, 32, "f16", 0),
                                                        ([(40, 60), (0, 3)], 3, 1, 64, "f16", 24)):
        # 2 or 3 heads per tile
        c = prefill_case(rng, seqs, heads, kv_heads, head_dim, kv)
        scale = head_dim ** -0.5
        err = nmse(run(vk, c, kv, heads, kv_heads, scale, window), want(c, heads, kv_heads, scale, window))
        assert err <= ATTENTION_NMSE, f"{seqs} H={heads} D={head_dim} {kv} W={window}: NMSE {err:.3g}"
        count += 1
    return count


GQA_CASES = sorted(lanes for lanes in dc.reachable("gqa") if lanes is not None)


@pytest.mark.parametrize("lanes", GQA_CASES, ids=[f"sub{lanes}" for lanes in GQA_CASES])
def test_gqa_attention_configuration(lanes: int, device_as: Any, vk_default: Backend,
                                         rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lane count of the GQA attention kernel: here when this device has that subgroup
    size, else in a child process whose llvmpipe is set to that vector width."""
    here = vk_default.caps  # type: ignore[attr-defined]
    if lanes != here.subgroup_size:
        if "llvmpipe" not in here.name or lanes > attention_kernels.CPU_MAX_LANES:
            pytest.skip(f"subgroup size {lanes} needs a device that has it ({here.name} has {here.subgroup_size}"
                        f"; llvmpipe at most {attention_kernels.CPU_MAX_LANES})")
        env = {**os.environ, "LP_NATIVE_VECTOR_WIDTH": str(32 * lanes)}
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                f"{Path(__file__).relative_to(REPO)}::test_gqa_attention_on_this_device"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
        assert f"paged_attention_gqa ran sub{lanes}" in child.stdout, child.stdout[-2000:]
        return
    caps = dc.reachable("gqa")[lanes]
    vk = device_as(dc.device_fields(caps, dc.fields_of("gqa")))
    dispatches = Dispatches(vk, monkeypatch)
    assert _gqa_checks(vk, rng) == 3
    assert {spec[0] for spec in dispatches.of("paged_attention_gqa")} == {lanes}


def test_gqa_attention_on_this_device(vk_default: Backend, rng: np.random.Generator,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The GQA attention kernel with this device's lanes (the child process above)."""
    lanes = attention_kernels.gqa_lanes(vk_default.caps)  # type: ignore[attr-defined]
    assert lanes is not None, "this device does not run the GQA attention kernel"
    dispatches = Dispatches(vk_default, monkeypatch)
    assert _gqa_checks(vk_default, rng) == 3
    assert {spec[0] for spec in dispatches.of("paged_attention_gqa")} == {lanes}
    print(f"paged_attention_gqa ran sub{lanes}")
