"""Time paged_attention's tiled prefill kernel against the paged kernel on one prefill step.

`python tools/bench_prefill_attention.py [--tokens N] [--repeats R]`: one prompt of N tokens
with SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64, f16 cache), the two
kernels alternating in one process after an untimed warm-up each (pipeline JIT); prints the
median seconds per call of each and their ratio. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ops.test_prefill_attention import prefill_case, run  # noqa: E402
from vkrt.backend import get_backend  # noqa: E402
from vkrt.backend.vulkan.kernels import attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    vk = get_backend("vulkan")
    case = prefill_case(np.random.default_rng(0), [(0, args.tokens)], 9, 3, 64, "f16")
    kernels = {"paged": 1 << 30, "tiled": 0}  # PREFILL_MIN_TOKENS forcing each kernel
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for repeat in range(args.repeats + 1):
        for name, min_tokens in kernels.items():
            attention.PREFILL_MIN_TOKENS = min_tokens
            start = time.perf_counter()
            run(vk, case, "f16", 9, 3, 0.125)
            if repeat:  # the first round compiles the pipelines
                times[name].append(time.perf_counter() - start)
    paged, tiled = (statistics.median(times[name]) for name in kernels)
    print(f"{args.tokens} tokens: paged {paged:.3f} s, tiled {tiled:.3f} s, paged / tiled {paged / tiled:.2f}x")


if __name__ == "__main__":
    main()
