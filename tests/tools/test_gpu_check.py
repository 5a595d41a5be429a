"""tools/gpu_check.sh's dry run, flags and refusal of CPU devices, and the matvec bandwidth
mode of tools/bench_ops.py it calls (CI has no GPU: this keeps the script from rotting)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import missing
from tests.tools.conftest import load_tool
from vkrt.core.formats import FORMATS
from vkrt.core.tensor import storage_nbytes

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"
STAGES = ("setup", "peer-setup", "devices", "fetch", "ops", "models", "models-alt",
          "peers-smollm2", "peers-gemma3", "matvec", "attention", "speculative")


def _run(*args: str, script: Path = SCRIPT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "VKRT_DEVICE")}
    return subprocess.run(["bash", str(script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _bench_ops() -> ModuleType:
    return load_tool("bench_ops")


def test_dry_run_prints_every_stage_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu" / "report.json"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for stage in STAGES:
        assert f"  {stage} " in proc.stdout, stage
    assert "tools/bench_peers.py --prompt-tokens 512 --gen-tokens 128" in proc.stdout
    assert "tools/bench_ops.py --bandwidth" in proc.stdout
    assert "tools/bench_attention.py --depth 512,4096 --prompt 2048" in proc.stdout
    assert "vkrt bench --prompt-file tools/bench_prompts/copy_prose.txt --gen-tokens 128" in proc.stdout
    assert "prerequisites: bash" in proc.stdout and "dry run: nothing was run" in proc.stdout
    assert not (tmp_path / "gpu").exists(), "a dry run must not create the report's directory"


def test_dry_run_plan_follows_the_flags() -> None:
    proc = _run("--dry-run", "--quick", "--stages", "ops,matvec", "--peak-gbps", "960", "--wheels", str(REPO))
    assert proc.returncode == 0, proc.stderr
    assert "budget 240 s, quick" in proc.stdout
    assert f"offline from {REPO} (no index)" in proc.stdout
    assert "setup (no apt)" not in proc.stdout and "not selected (--stages)" in proc.stdout
    assert "--peak-gbps 960" in proc.stdout
    assert "peers-gemma3   not in this mode" in proc.stdout


def test_dry_run_plans_synthetic_twins_and_an_offline_install() -> None:
    proc = _run("--dry-run", "--synthetic-models", "--system-site-packages", "--wheels", str(REPO))
    assert proc.returncode == 0, proc.stderr
    assert "synthetic twins (--synthetic-models): smollm2 gemma3" in proc.stdout
    plain = _run("--dry-run")
    assert "find or pull (else a synthetic twin): smollm2 gemma3" in plain.stdout


def test_dry_run_fails_when_its_tools_are_missing(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    lonely = tmp_path / "tools" / "gpu_check.sh"
    shutil.copy(SCRIPT, lonely)
    proc = _run("--dry-run", script=lonely)
    assert proc.returncode == 2
    assert "missing tools/bench_peers.py" in proc.stderr and "missing tests/ops" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument: --bogus"),
    (["--stages", "ops,nope"], "unknown stage 'nope'"),
    (["--budget", "soon"], "--budget must be a whole number"),
    (["--peak-gbps", "fast"], "--peak-gbps must be a number"),
    (["--out"], "--out needs a value"),
    (["--wheels", "/nonexistent/wheels"], "is not a directory"),
])
def test_bad_flags_exit_2_with_a_reason(args: list[str], message: str) -> None:
    proc = _run("--dry-run", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_help_says_how_to_install_offline() -> None:
    proc = _run("--help")
    assert proc.returncode == 0
    for needle in ("--wheels DIR", "PIP_FIND_LINKS", "--no-index", "--allow-cpu", "Exit status",
                   "tools/make_wheelhouse.py", "--system-site-packages", "--synthetic-models"):
        assert needle in proc.stdout, needle


def test_refuses_a_cpu_device_and_still_writes_the_report(tmp_path: Path) -> None:
    from vkrt.backend import vulkan_unavailable_reason

    reason = vulkan_unavailable_reason()
    if reason is not None:
        missing("Vulkan", reason)
    out = tmp_path / "report.json"
    proc = _run("--skip-setup", "--no-peer", "--stages", "devices", "--device", "llvmpipe", "--out", str(out),
                timeout=300)
    if "matches no device" in proc.stderr + proc.stdout:
        missing("Vulkan", "no llvmpipe device to refuse")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "refused: only a CPU Vulkan device" in proc.stderr and "--allow-cpu" in proc.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "refused"
    assert report["device"]["device_type"] == "cpu"
    assert report["stages"]["devices"]["status"] == "refused"
    assert "ops" not in report["stages"], "nothing runs after a refusal"


def test_peak_table_picks_the_longest_whole_word_match() -> None:
    peak_gbps = _bench_ops().peak_gbps
    assert peak_gbps("NVIDIA H200") == (4800.0, "H200")
    assert peak_gbps("NVIDIA H100 PCIe") == (2000.0, "H100 PCIe")
    assert peak_gbps("NVIDIA H100 80GB HBM3") == (3350.0, "H100")
    assert peak_gbps("NVIDIA A10") == (600.0, "A10")  # not A100's
    assert peak_gbps("NVIDIA L40S") == (864.0, "L40S")
    assert peak_gbps("AMD Radeon RX 7900 XTX (RADV NAVI31)") == (960.0, "RX 7900 XTX")
    assert peak_gbps("llvmpipe (LLVM 15.0.6, 256 bits)") == (None, None)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_timing_weights_have_the_formats_size_and_finite_values(fmt: str) -> None:
    bench = _bench_ops()
    spec = FORMATS[fmt]
    n, k = 3, 2 * 256
    raw = bench.random_storage(np.random.default_rng(0), fmt, n, k)
    assert raw.nbytes == storage_nbytes((n, k), fmt)
    if spec.is_block:
        values = spec.decode(raw.reshape(-1, spec.block_bytes))
        assert np.isfinite(values).all()


def test_bandwidth_rows_time_real_dispatches(vk_default) -> None:
    """Each native format's row comes from dispatches that ran (a dropped deferred matmul
    would time nothing) and reports a ratio once a peak is given."""
    rows = _bench_ops().bandwidth(vk_default, ["f32", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"],
                                  [vk_default.caps.access_path], 128, 512, 1.0, 1, 1.0, 100.0)
    assert [r["format"] for r in rows] == ["f32", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]
    for r in rows:
        assert "error" not in r, r
        assert r["copies"] >= 2 and r["calls"] >= r["copies"]
        assert r["dispatches_per_call"] >= 1 and r["drains"] == 0, r
        assert r["gb_s"] > 0 and r["of_peak"] == pytest.approx(r["gb_s"] / 100.0, abs=1e-3)


def test_attention_rows_time_each_kernel_and_restore_the_policy(vk_default, monkeypatch) -> None:
    """tools/bench_attention.py's rows (the gpu_check attention stage): each named kernel is
    the one dispatched (the GQA shader for `gqa`, the one-head shader for `paged`) and ran
    (device time spent); both give the same bits, as their shared fold order promises; and
    the tile policy is the kernels' own again afterwards."""
    from tests.ops.test_paged_attention_split import decode_case
    from vkrt.backend.vulkan.kernels import attention

    shaders: list[str] = []
    module = attention.module
    monkeypatch.setattr(attention, "module", lambda backend, name, *v: shaders.append(name) or module(backend, name, *v))
    bench = load_tool("bench_attention")
    policy = (attention.gqa_heads, attention.gqa_tokens, attention.paged_chunk)
    case = decode_case(np.random.default_rng(1), [40], 9, 3, 64, "f16", width=8)
    rows = bench.time_case(vk_default, case, "f16", 9, 3, 64, ["gqa", "paged"], 1)
    assert shaders == ["paged_attention_gqa", "paged_attention"] * 2  # the untimed round, then the timed one
    assert [r["kernel"] for r in rows] == ["gqa", "paged"]
    assert all(r["median_ms"] > 0 for r in rows), rows
    assert all(r["same_bits_as_first"] for r in rows), rows
    assert (attention.gqa_heads, attention.gqa_tokens, attention.paged_chunk) == policy
