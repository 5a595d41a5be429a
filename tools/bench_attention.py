"""Time paged_attention's kernels on one attention shape, alternating in one process.

    python tools/bench_attention.py [--depth N | --prompt N] [--shape H,KV,D] [--kernels gqa,paged] [--repeats R]

One decode token at context depth N (--depth, the default: 2048, a 4096-position block table as a
recorded decode step has) or one prompt of N tokens (--prompt); --shape is heads, KV heads and
head_dim (default SmolLM2-135M's 9,3,64; Gemma-3-270M's is 4,1,256), f16 cache. Each kernel (`gqa`:
shaders/paged_attention_gqa.comp with the heads and tokens per tile `gqa_heads` and `gqa_tokens`
pick, `gqaN`: N heads per tile, `gqaNxT`: and T tokens per tile, `paged`:
shaders/paged_attention.comp; append `-split` to force chunks of PAGED_CHUNK positions, split over
workgroups in a decode step) runs once untimed (pipeline JIT), then the kernels alternate; prints
each one's median and fastest device time per call (timestamp queries) and whether it gave the
first kernel's bits (kernels with the same chunking do). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ops.test_gqa_attention import prefill_case  # noqa: E402
from tests.ops.test_paged_attention_split import decode_case, upload  # noqa: E402
from vkrt import ops  # noqa: E402
from vkrt.backend import get_backend  # noqa: E402
from vkrt.backend.vulkan.kernels import attention  # noqa: E402


def fixed(value: int, *args: int) -> int:
    """gqa_heads or gqa_tokens forced to `value` (heads 1: the paged kernel)."""
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=0, help="time a prefill of this many tokens instead")
    parser.add_argument("--shape", default="9,3,64", help="heads,kv_heads,head_dim (default SmolLM2-135M's)")
    parser.add_argument("--kernels", default="gqa,paged")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    heads, kv_heads, head_dim = (int(v) for v in args.shape.split(","))
    vk = get_backend("vulkan")
    rng = np.random.default_rng(0)
    case = (prefill_case(rng, [(0, args.prompt)], heads, kv_heads, head_dim, "f16") if args.prompt
            else decode_case(rng, [args.depth], heads, kv_heads, head_dim, "f16", width=4096 // 16))
    t = upload(vk, case, "f16")
    gqa_heads, gqa_tokens, paged_chunk = attention.gqa_heads, attention.gqa_tokens, attention.paged_chunk
    names = args.kernels.split(",")
    times: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, np.ndarray] = {}
    for repeat in range(args.repeats + 1):
        for name in names:
            kernel = name.removesuffix("-split")
            tile, _, tokens = ("1" if kernel == "paged" else kernel[3:]).partition("x")
            attention.gqa_heads = functools.partial(fixed, int(tile)) if tile else gqa_heads
            attention.gqa_tokens = functools.partial(fixed, int(tokens)) if tokens else gqa_tokens
            attention.paged_chunk = (lambda caps: attention.PAGED_CHUNK) if name.endswith("-split") else paged_chunk
            before = vk.counters.gpu_us
            outputs[name] = ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"],
                                                t["positions"], heads, kv_heads, head_dim ** -0.5).numpy()
            if repeat:  # the first round compiles the pipelines
                times[name].append((vk.counters.gpu_us - before) / 1e3)
    shape = f"{args.shape} prompt {args.prompt}" if args.prompt else f"{args.shape} depth {args.depth}"
    for name in names:
        same = np.array_equal(outputs[name].view(np.uint32), outputs[names[0]].view(np.uint32))
        print(f"{shape}: {name} {statistics.median(times[name]):.3f} ms per call (median of {args.repeats}), "
              f"fastest {min(times[name]):.3f}, same bits as {names[0]}: {same}")


if __name__ == "__main__":
    main()
