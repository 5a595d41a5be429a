"""Time paged_attention's kernels on attention shapes, alternating in one process.

    python tools/bench_attention.py [--depth N[,N...]] [--prompt N[,N...]] [--shape H,KV,D[;H,KV,D...]]
                                    [--kernels gqa,paged] [--kv-dtype f16] [--repeats R] [--json]

Cases: one decode token at each context depth N (--depth; 2048 when neither option is given;
the block table is max(4096, N) positions wide, as a recorded decode step's bucket is) and
one prompt of each length N (--prompt), for each shape (--shape: heads, KV heads, head_dim;
default SmolLM2-135M's 9,3,64; Gemma-3-270M's is 4,1,256; a Llama-3-8B-like one 32,8,128),
with the cache in --kv-dtype (f16, f32, q8_0). Each kernel (`gqa`: shaders/
paged_attention_gqa.comp with the heads and tokens per tile `gqa_heads` and `gqa_tokens` pick,
`gqaN`: N heads per tile, `gqaNxT`: and T tokens per tile, `paged`: shaders/paged_attention.comp;
append `-split` to force chunks of PAGED_CHUNK positions, split over workgroups in a decode
step) runs once untimed (pipeline JIT), then the kernels alternate; prints each one's median
and fastest device time per call (timestamp queries) and whether it gave the first kernel's
bits (kernels with the same chunking do), or with --json one object with a row per (case,
kernel). `tools/gpu_check.sh` runs it on a GPU. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_cases import BLOCK, decode_case, prefill_case, upload  # noqa: E402

from vkrt import ops  # noqa: E402
from vkrt.backend import get_backend  # noqa: E402
from vkrt.backend.vulkan.kernels import attention  # noqa: E402

if TYPE_CHECKING:  # the binding is imported when get_backend("vulkan") first runs
    from vkrt.backend.vulkan import VulkanBackend

TABLE_POSITIONS = 4096  # the decode case's block table width at least, in positions
KERNEL = re.compile(r"(gqa([1-9][0-9]*(x[1-9][0-9]*)?)?|paged)(-split)?")


def fixed(value: int, *args: int) -> int:
    """gqa_heads or gqa_tokens forced to `value` (heads 1: the paged kernel)."""
    return value


def lengths(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"bench_attention: {option} takes positive whole numbers, comma-separated: {text!r}")
    return values


def shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(";"):
        try:
            heads, kv_heads, head_dim = (int(v) for v in part.split(","))
        except ValueError:
            raise SystemExit(f"bench_attention: --shape takes heads,kv_heads,head_dim[;...]: {part!r}") from None
        if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or head_dim % 4:
            raise SystemExit(f"bench_attention: bad shape {part!r}: heads a multiple of kv_heads, head_dim of 4")
        out.append((heads, kv_heads, head_dim))
    return out


def time_case(vk: VulkanBackend, case: dict[str, np.ndarray], kv_dtype: str, heads: int, kv_heads: int, head_dim: int,
              names: list[str], repeats: int) -> list[dict[str, Any]]:
    """Each kernel's device milliseconds per call on one case, alternating; a row per kernel."""
    t = upload(vk, case, kv_dtype)
    gqa_heads, gqa_tokens, paged_chunk = attention.gqa_heads, attention.gqa_tokens, attention.paged_chunk
    times: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, np.ndarray] = {}
    try:
        for repeat in range(repeats + 1):
            for name in names:
                kernel = name.removesuffix("-split")
                tile, _, tokens = ("1" if kernel == "paged" else kernel[3:]).partition("x")
                attention.gqa_heads = functools.partial(fixed, int(tile)) if tile else gqa_heads
                attention.gqa_tokens = functools.partial(fixed, int(tokens)) if tokens else gqa_tokens
                attention.paged_chunk = ((lambda caps: attention.PAGED_CHUNK) if name.endswith("-split")
                                         else paged_chunk)
                before = vk.counters.gpu_us
                outputs[name] = ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"],
                                                    t["seq_index"], t["positions"], heads, kv_heads,
                                                    head_dim ** -0.5).numpy()
                if repeat:  # the first round compiles the pipelines
                    times[name].append((vk.counters.gpu_us - before) / 1e3)
    finally:
        attention.gqa_heads, attention.gqa_tokens, attention.paged_chunk = gqa_heads, gqa_tokens, paged_chunk
    first = outputs[names[0]].view(np.uint32)
    return [{"kernel": name, "median_ms": statistics.median(times[name]), "fastest_ms": min(times[name]),
             "same_bits_as_first": bool(np.array_equal(outputs[name].view(np.uint32), first))} for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", help="decode cases: context depths, comma-separated (default 2048)")
    parser.add_argument("--prompt", help="prefill cases: prompt lengths, comma-separated")
    parser.add_argument("--shape", default="9,3,64", help="heads,kv_heads,head_dim[;...] (default SmolLM2-135M's)")
    parser.add_argument("--kernels", default="gqa,paged")
    parser.add_argument("--kv-dtype", default="f16", choices=["f16", "f32", "q8_0"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of lines")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("bench_attention: --repeats must be at least 1")
    names = list(dict.fromkeys(n for n in args.kernels.split(",") if n))  # each kernel once
    bad = [n for n in names if not KERNEL.fullmatch(n)]
    if bad or not names:
        raise SystemExit(f"bench_attention: unknown kernel {', '.join(bad) or '(none)'}: gqa, gqaN, gqaNxT or paged, "
                         "each optionally with -split")
    depths = lengths(args.depth, "--depth") if args.depth else ([] if args.prompt else [2048])
    prompts = lengths(args.prompt, "--prompt") if args.prompt else []
    vk = cast("VulkanBackend", get_backend("vulkan"))
    rows = []
    for heads, kv_heads, head_dim in shapes(args.shape):
        if args.kv_dtype == "q8_0" and head_dim % 32:
            print(f"bench_attention: q8_0 needs head_dim a multiple of 32; {head_dim} skipped", file=sys.stderr)
            continue
        shape = f"{heads},{kv_heads},{head_dim}"
        for kind, n in [("decode", d) for d in depths] + [("prefill", p) for p in prompts]:
            rng = np.random.default_rng(0)
            case = (prefill_case(rng, [(0, n)], heads, kv_heads, head_dim, args.kv_dtype) if kind == "prefill"
                    else decode_case(rng, [n], heads, kv_heads, head_dim, args.kv_dtype,
                                     width=-(-max(TABLE_POSITIONS, n) // BLOCK)))
            for row in time_case(vk, case, args.kv_dtype, heads, kv_heads, head_dim, names, args.repeats):
                rows.append({"shape": shape, "case": kind, "tokens" if kind == "prefill" else "depth": n, **row})
                if not args.json:
                    what = f"prompt {n}" if kind == "prefill" else f"depth {n}"
                    print(f"{shape} {what}: {row['kernel']} {row['median_ms']:.3f} ms per call (median of "
                          f"{args.repeats}), fastest {row['fastest_ms']:.3f}, same bits as {names[0]}: "
                          f"{row['same_bits_as_first']}", flush=True)
    if args.json:
        caps = vk.caps
        print(json.dumps({"device": caps.name, "device_type": caps.device_type, "access_path": caps.access_path,
                          "kv_dtype": args.kv_dtype, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
