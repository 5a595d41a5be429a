"""Time the native matmul at SmolLM2-135M shapes against numpy (a script, not a test).

    .venv/bin/python tools/bench_ops.py [--formats q4_1,f32] [--paths texel] [--decode] [--json]

For each weight format and access path: the matvec (T=1, the vec kernel) at N x K =
576x576, 1536x576, 576x1536, 49152x576, and the tiled kernel at T=128 for 1536x576 and
576x1536. K-quants (q4_k, q6_k) need K % 256 == 0, so their rows use K = 512 / 1536
instead of 576. `--decode` times the batched-decode buckets instead: T = 1, 2, 4, 8, 16 at
576x576, 192x576 (k/v), 3072x576 (gate+up), 576x1536 and 49152x576 (LM head).
Each timing records several op calls into one command batch, then syncs; the reported ms
is the median over repeats of (batch wall time / calls), nothing subtracted (so it
includes the ~0.1 ms per-call recording cost). GB/s is weight bytes in their device
layout per call. numpy runs x @ w.T with the weights dequantized to f32 beforehand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkrt import ops  # noqa: E402
from vkrt.backend import get_backend  # noqa: E402
from vkrt.ops.quant import dequantize, f32_to_bf16, quantize  # noqa: E402

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


def median_ms(step: Callable[[], None], sync: Callable[[], None]) -> float:
    """Median ms per call: batches of `calls` calls, then one sync, over REPEATS batches."""
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    calls = max(1, min(20, int(TARGET_BATCH_S / max(first, 1e-6))))
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--paths", default="texel,ssbo")
    parser.add_argument("--decode", action="store_true", help="batched-decode buckets T=1..16 instead")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    vk = get_backend("vulkan")
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
                ms = median_ms(lambda x=x, w=w: ops.matmul(x, w), vk.sync)
                if (t, n, k) not in numpy_ms:
                    dense = dequantize(raw, fmt)
                    numpy_ms[(t, n, k)] = median_ms(lambda d=dense, xh=x_host: xh @ d.T, lambda: None)
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
