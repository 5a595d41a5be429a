"""Time the native matmul at SmolLM2-135M shapes against numpy (a script, not a test).

    .venv/bin/python tools/bench_ops.py [--formats q4_1,f32] [--paths texel] [--decode] [--json]
    .venv/bin/python tools/bench_ops.py --bandwidth [--peak-gbps 4800] [--shape 16384x4096] [--json]

For each weight format and access path: the matvec (T=1, the vec kernel) at N x K =
576x576, 1536x576, 576x1536, 49152x576, and the tiled kernel at T=128 for 1536x576 and
576x1536. K-quants (q4_k, q6_k) need K % 256 == 0, so their rows use K = 512 / 1536
instead of 576. `--decode` times the batched-decode buckets instead: T = 1, 2, 4, 8, 16 at
576x576, 192x576 (k/v), 3072x576 (gate+up), 576x1536 and 49152x576 (LM head).
Each timing records several op calls into one command batch, then syncs; the reported ms
is the median over repeats of (batch wall time / calls), nothing subtracted (so it
includes the ~0.1 ms per-call recording cost). GB/s is weight bytes in their device
layout per call. numpy runs x @ w.T with the weights dequantized to f32 beforehand.

`--bandwidth` measures weight streaming instead: one matvec (T=1) per call at one large
shape for every format in vkrt/core/formats.py's registry, timed by the device's own
timestamps (`Counters.gpu_us`, so host recording is not counted). The calls of a batch
rotate over copies of the matrix until the copies exceed --working-set-mb, so the weights
come from memory, not from a cache. GB/s is device-layout weight bytes per second of GPU
time (median over repeats, and the best), and `of_peak` divides it by the device's memory
bandwidth: --peak-gbps, else PEAK_GBPS below by device name, else unknown. Weight values
are random bits with small fixed f16 scales: speed does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkrt import ops  # noqa: E402
from vkrt.backend import get_backend  # noqa: E402
from vkrt.core.formats import FORMATS as REGISTRY  # noqa: E402
from vkrt.core.quant import dequantize, f32_to_bf16, quantize  # noqa: E402
from vkrt.errors import VkrtError  # noqa: E402

if TYPE_CHECKING:  # the binding is imported when get_backend("vulkan") first runs
    from vkrt.backend.vulkan import VulkanBackend

FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
K_QUANTS = ("q4_k", "q6_k")
# (T, N, K): decode matvecs (attention/FFN/LM head), then prefill with 128 tokens.
SHAPES = [(1, 576, 576), (1, 1536, 576), (1, 576, 1536), (1, 49152, 576), (128, 1536, 576),
          (128, 576, 1536)]
DECODE_SHAPES = [(t, n, k) for n, k in ((576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576))
                 for t in (1, 2, 4, 8, 16)]


def shapes_for(fmt: str, decode: bool) -> list[tuple[int, int, int]]:
    """The shape list, with K rounded to a whole number of 256-value super-blocks for K-quants."""
    shapes = DECODE_SHAPES if decode else SHAPES
    if fmt not in K_QUANTS:
        return shapes
    return [(t, n, 512 if k == 576 else k) for t, n, k in shapes]
REPEATS = 7
TARGET_BATCH_S = 0.05  # calls per batch are chosen so one batch takes about this long


def storage(rng: np.random.Generator, fmt: str, n: int, k: int) -> np.ndarray:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if fmt == "f32":
        return w
    if fmt == "f16":
        return w.astype(np.float16)
    if fmt == "bf16":
        return f32_to_bf16(w)
    if fmt in K_QUANTS:  # random quants and sub-block scales, small f16 super-block scales
        size = 144 if fmt == "q4_k" else 210
        blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
        d = rng.uniform(1e-4, 1e-3, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
        if fmt == "q4_k":
            blocks[..., 0:4] = d.reshape(n, k // 256, 4)
        else:
            blocks[..., 208:210] = d[..., 0:2]
        return blocks.reshape(n, -1)
    return quantize(w, fmt)


def median_ms(step: Callable[[], object], sync: Callable[[], None]) -> float:
    """Median ms per call: batches of `calls` calls, then one sync, over REPEATS batches.

    The results are kept until the sync: a deferred matmul whose result is dropped is
    never computed (vkrt/ops/fusion.py), so a batch of discarded calls would time nothing.
    """
    start = time.perf_counter()
    kept = [step()]
    sync()
    first = time.perf_counter() - start
    calls = max(1, min(20, int(TARGET_BATCH_S / max(first, 1e-6))))
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        kept = [step() for _ in range(calls)]
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e3)
    del kept
    return statistics.median(samples)


# ---- weight streaming (--bandwidth) ---------------------------------------------------------

# Memory bandwidth in GB/s from the vendors' spec sheets, keyed by a word of the Vulkan
# device name; the longest key found in the name wins ("H100 PCIe" before "H100").
PEAK_GBPS: dict[str, float] = {
    "H200": 4800, "H100": 3350, "H100 PCIe": 2000, "H100 NVL": 3900,
    "A100": 1555, "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935,
    "L40S": 864, "L40": 864, "L4": 300, "A10G": 600, "A10": 600, "T4": 320,
    "RTX 4090": 1008, "RTX 4080": 717, "RTX 3090": 936, "RTX 3080": 760,
    "RX 7900 XTX": 960, "MI300X": 5300, "MI250X": 3277, "A770": 560,
}
SCALE_F16 = np.array([1e-3], np.float16).view(np.uint8)  # every block's f16 fields


def peak_gbps(device_name: str, table: dict[str, float] = PEAK_GBPS) -> tuple[float | None, str | None]:
    """(GB/s, the table key that matched) for a device name, or (None, None)."""
    hits = [key for key in table
            if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE)]
    if not hits:
        return None, None
    key = max(hits, key=len)
    return float(table[key]), key


def random_storage(rng: np.random.Generator, fmt: str, n: int, k: int) -> np.ndarray:
    """An [n, k] weight in storage format `fmt` for timing: random values / quant bits,
    every f16 field of a block set to SCALE_F16 and every E8M0 one to 2^-8 (no NaNs or denormals)."""
    spec = REGISTRY[fmt]
    if not spec.is_block:
        w = (rng.standard_normal((n, k), dtype=np.float32) * 0.05)
        return f32_to_bf16(w) if fmt == "bf16" else w.astype(np.float16 if fmt == "f16" else np.float32)
    blocks = rng.integers(0, 256, size=(n, k // spec.block_values, spec.block_bytes), dtype=np.uint8)
    for field in spec.fields:
        if field.kind == "f16":
            start = spec.field_offset(field.name)
            blocks[..., start:start + 2] = SCALE_F16
        elif field.kind == "e8m0":  # mxfp4: scale 2^-8, a normal float
            blocks[..., spec.field_offset(field.name)] = 120
    return blocks.reshape(n, -1)


def stream_gbps(vk: VulkanBackend, x: Any, weights: list[Any], calls: int) -> tuple[float, dict[str, int]]:
    """GB/s of weight bytes over GPU time for `calls` matvecs rotating over `weights`."""
    vk.sync()
    before = vk.counters.snapshot()
    kept = [ops.matmul(x, weights[i % len(weights)]) for i in range(calls)]
    vk.sync()
    spent = vk.counters.since(before)
    del kept
    nbytes = sum(weights[i % len(weights)].handle.size for i in range(calls))
    return nbytes / max(spent["gpu_us"], 1) / 1e3, spent


def bandwidth(vk: VulkanBackend, formats: list[str], paths: list[str], n: int, k: int, working_set_mb: float,
              repeats: int, target_ms: float, peak: float | None) -> list[dict[str, Any]]:
    """One row per (format, access path): matvec weight streaming at [n, k]."""
    rng = np.random.default_rng(0)
    x = vk.upload(rng.standard_normal((1, k), dtype=np.float32))
    rows: list[dict[str, Any]] = []
    for fmt in formats:
        spec = REGISTRY[fmt]
        row: dict[str, Any] = {"format": fmt, "N": n, "K": k,
                               "gguf_bytes": n * k // spec.block_values * spec.block_bytes}
        if k % spec.block_values:
            rows.append({**row, "error": f"K={k} is not a multiple of {fmt}'s {spec.block_values}-value block"})
            continue
        raw = random_storage(rng, fmt, n, k)
        weights: list[Any] = []
        try:
            weights.append(vk.upload_weight(raw, fmt, (n, k)))
            copies = max(1, min(64, math.ceil(working_set_mb * 1e6 / weights[0].handle.size)))
            weights += [vk.upload_weight(raw, fmt, (n, k)) for _ in range(copies - 1)]
        except VkrtError as exc:  # e.g. larger than the device's storage-buffer range
            rows.append({**row, "error": str(exc).splitlines()[0]})
            continue
        row.update(device_bytes=weights[0].handle.size, copies=len(weights))
        for path in paths:
            vk.set_access_path(path)
            kernel = vk.select("matmul", (x, weights[0]), {})
            if kernel is None:  # it would drain to numpy: nothing of the device's to time
                rows.append({**row, "path": path, "kernel": "reference (drain)"})
                continue
            try:
                first, _ = stream_gbps(vk, x, weights, len(weights))  # warm-up: pipelines, first touch
                per_call_ms = weights[0].handle.size / max(first, 1e-3) / 1e6
                calls = max(len(weights), min(2048, math.ceil(target_ms / max(per_call_ms, 1e-6))))
                samples: list[float] = []
                spent: dict[str, int] = {}
                for _ in range(repeats):
                    gbps, spent = stream_gbps(vk, x, weights, calls)
                    samples.append(gbps)
            except VkrtError as exc:  # a kernel that cannot run here is a row, not the end of the table
                rows.append({**row, "path": path, "kernel": kernel.name, "error": str(exc).splitlines()[0]})
                continue
            median = statistics.median(samples)
            rows.append({**row, "path": path, "kernel": kernel.name, "calls": calls,
                         "dispatches_per_call": spent["dispatches"] / calls, "drains": spent["drains"],
                         "gb_s": round(median, 2), "gb_s_best": round(max(samples), 2),
                         "of_peak": round(median / peak, 3) if peak else None})
        del weights
    return rows


def bandwidth_main(args: argparse.Namespace) -> int:
    vk = cast("VulkanBackend", get_backend("vulkan"))
    n, k = (int(v) for v in args.shape.lower().split("x"))
    peak, key = (args.peak_gbps, "--peak-gbps") if args.peak_gbps else peak_gbps(vk.caps.name)
    formats = [f for f in args.formats.split(",") if f] if args.formats else list(REGISTRY)
    unknown = sorted(set(formats) - set(REGISTRY))
    if unknown:
        raise SystemExit(f"bench_ops: unknown formats {unknown} (known: {', '.join(REGISTRY)})")
    paths = args.paths.split(",") if args.paths else [vk.caps.access_path]
    report: dict[str, Any] = {"device": vk.caps.name, "device_type": vk.caps.device_type, "peak_gb_s": peak,
                              "peak_source": key, "shape": [n, k], "rows": []}
    if not vk.supports_gpu_timing:
        report["error"] = "the device has no timestamp queries: GPU time cannot be measured"
        print(json.dumps(report, indent=1) if args.json else f"bench_ops: {report['error']}")
        return 1
    previous = vk.caps.access_path
    try:
        rows = bandwidth(vk, formats, paths, n, k, args.working_set_mb, args.repeats, args.target_ms, peak)
    finally:
        vk.set_access_path(previous)
    report["rows"] = rows
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"device: {vk.caps.name}; peak {f'{peak:g} GB/s ({key})' if peak else 'unknown (pass --peak-gbps)'}\n")
    print("| format | path | kernel | N x K | MB (device) | copies | GB/s (median) | best | of peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['format']} | {r.get('path', '-')} | {r.get('kernel', '-')} | {r['N']}x{r['K']} | - | - | {r['error']} | - | - |")
            continue
        share = f"{r['of_peak']:.0%}" if r.get("of_peak") is not None else "-"
        print(f"| {r['format']} | {r['path']} | {r['kernel']} | {r['N']}x{r['K']} | "
              f"{r['device_bytes'] / 1e6:.1f} | {r['copies']} | {r.get('gb_s', '-')} | "
              f"{r.get('gb_s_best', '-')} | {share} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=None,
                        help=f"comma-separated (default: {','.join(FORMATS)}; with --bandwidth every registry format)")
    parser.add_argument("--paths", default=None,
                        help="texel,ssbo (default: both; with --bandwidth the device's own path)")
    parser.add_argument("--decode", action="store_true", help="batched-decode buckets T=1..16 instead")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    bw = parser.add_argument_group("weight streaming (--bandwidth)")
    bw.add_argument("--bandwidth", action="store_true", help="matvec GB/s per weight format vs the device's peak")
    bw.add_argument("--shape", default="16384x4096", help="N x K of the matvec (default 16384x4096)")
    bw.add_argument("--peak-gbps", type=float, default=None,
                    help="the device's memory bandwidth in GB/s (default: PEAK_GBPS by device name)")
    bw.add_argument("--working-set-mb", type=float, default=512.0,
                    help="copies of the matrix until their bytes exceed this (default 512: past any cache)")
    bw.add_argument("--repeats", type=int, default=5)
    bw.add_argument("--target-ms", type=float, default=50.0, help="GPU time one timed batch aims at")
    args = parser.parse_args(argv)
    if args.bandwidth:
        return bandwidth_main(args)
    args.formats = args.formats or ",".join(FORMATS)
    args.paths = args.paths or "texel,ssbo"
    vk = cast("VulkanBackend", get_backend("vulkan"))
    rng = np.random.default_rng(0)
    rows = []
    numpy_ms: dict[tuple[int, int, int], float] = {}
    for path in args.paths.split(","):
        vk.set_access_path(path)
        for fmt in args.formats.split(","):
            for t, n, k in shapes_for(fmt, args.decode):
                raw = storage(rng, fmt, n, k)
                w = vk.upload_weight(raw, fmt, (n, k))
                x_host = rng.standard_normal((t, k)).astype(np.float32)
                x = vk.upload(x_host)
                kernel = vk.select("matmul", (x, w), {})
                ms = median_ms(partial(ops.matmul, x, w), vk.sync)
                if (t, n, k) not in numpy_ms:
                    dense = dequantize(raw, fmt)
                    numpy_ms[(t, n, k)] = median_ms(partial(np.matmul, x_host, dense.T), lambda: None)
                rows.append({"format": fmt, "path": path, "kernel": kernel.name if kernel else "reference",
                             "T": t, "N": n, "K": k, "ms": round(ms, 3),
                             "weight_gb_s": round(w.handle.size / ms / 1e6, 2),
                             "numpy_ms": round(numpy_ms[(t, n, k)], 3)})
                del w, x
    if args.json:
        print(json.dumps({"device": vk.caps.name, "rows": rows}, indent=1))
        return 0
    print(f"device: {vk.caps.name}\n")
    print("| format | path | kernel | T | N x K | ms | weight GB/s | numpy f32 ms | vs numpy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['path']} | {r['kernel']} | {r['T']} | {r['N']}x{r['K']} | "
              f"{r['ms']:.3f} | {r['weight_gb_s']:.2f} | {r['numpy_ms']:.3f} | "
              f"{r['numpy_ms'] / r['ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
