"""KV-cache memory per token and per sequence, as vkrt's engine sizes it, for each family.

    python tools/kv_memory.py [MODEL ...] [--context 2048 8192 32768] [--kv-cache-dtype f16|f32|q8_0]

MODEL is a GGUF file, an HF directory or a pulled model name (default: the two real models,
smollm2-135m-instruct and gemma-3-270m, when pulled). The table also lists the KV shapes of common public
checkpoints of each family (layers, KV heads, head_dim and windows, as their config.json
publishes them), so no weights are needed for those rows. A sequence's memory at a context
uses the engine's own rule (vkrt.engine.kv_groups.blocks_per_sequence): a full-attention
layer holds every block, a sliding-window layer only its window plus one chunk.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vkrt.core.kv_format import KV_DTYPES, bytes_per_value, unsupported  # noqa: E402
from vkrt.engine.config import EngineConfig  # noqa: E402
from vkrt.engine.kv_groups import blocks_per_sequence  # noqa: E402


@dataclass(frozen=True)
class KVShape:
    name: str
    kv_heads: int
    head_dim: int
    windows: tuple[int, ...]  # one per layer; 0 is full attention


def _alternating(layers: int, window: int, local_per_global: int) -> tuple[int, ...]:
    """`local_per_global` sliding layers, then one global, repeated (Gemma 2: 1, Gemma 3: 5)."""
    period = local_per_global + 1
    return tuple(0 if (i + 1) % period == 0 else window for i in range(layers))


# Shapes from each checkpoint's published config.json.
PUBLISHED = [
    KVShape("Llama-3.2-1B (llama)", 8, 64, (0,) * 16),
    KVShape("Qwen2.5-0.5B (qwen2)", 2, 64, (0,) * 24),
    KVShape("Qwen3-0.6B (qwen3)", 8, 128, (0,) * 28),
    KVShape("Mistral-7B-v0.1 (mistral, window 4096)", 8, 128, (4096,) * 32),
    KVShape("Gemma-2-2B (gemma2, 1 local : 1 global, window 4096)", 4, 256, _alternating(26, 4096, 1)),
    KVShape("Phi-3-mini-4k (phi3)", 32, 96, (0,) * 32),
    KVShape("Qwen3-30B-A3B (qwen3_moe)", 4, 128, (0,) * 48),
    KVShape("Mixtral-8x7B-v0.1 (mixtral)", 8, 128, (0,) * 32),
    KVShape("OLMoE-1B-7B (olmoe)", 16, 128, (0,) * 16),
]


def shape_of(spec: str) -> KVShape:
    """The KV shape of a model file, read through vkrt's loader (config only; weights stay mapped)."""
    from vkrt.loader import load_model
    from vkrt.loader.pull import resolve_model

    path, name = resolve_model(spec, progress=False)
    config = load_model(path).config
    windows = tuple(config.layer(i).window for i in range(config.num_layers))
    return KVShape(f"{name or path.name} ({config.architecture}, file)", config.num_kv_heads, config.head_dim, windows)


def sequence_bytes(shape: KVShape, context: int, item: float, engine: EngineConfig) -> int:
    """K and V bytes one sequence of `context` tokens holds, block-rounded as the engine allocates."""
    per_block_layer = round(2 * engine.block_size * shape.kv_heads * shape.head_dim * item)
    blocks = sum(blocks_per_sequence(w, engine.block_size, context, engine.max_num_batched_tokens)
                 for w in shape.windows)
    return blocks * per_block_layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="GGUF files, HF directories or pulled model names")
    ap.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="f16")
    args = ap.parse_args(argv)
    item = bytes_per_value(args.kv_cache_dtype)
    engine = EngineConfig()

    from vkrt.loader.pull import find_model

    specs = args.models or [m for m in ("smollm2-135m-instruct", "gemma-3-270m") if find_model(m) is not None]
    shapes = [shape_of(s) for s in specs] + PUBLISHED
    head = ["model", f"KiB/token ({args.kv_cache_dtype}, all layers)"] + [f"MiB at {c}" for c in args.context]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for shape in shapes:
        why = unsupported(args.kv_cache_dtype, shape.kv_heads, shape.head_dim)
        if why is not None:
            print("| " + " | ".join([shape.name, f"n/a ({why})"] + [""] * len(args.context)) + " |")
            continue
        per_token = 2 * len(shape.windows) * shape.kv_heads * shape.head_dim * item
        cells = [shape.name, f"{per_token / 1024:.1f}"]
        for context in args.context:
            full = sequence_bytes(KVShape(shape.name, shape.kv_heads, shape.head_dim, (0,) * len(shape.windows)),
                                  context, item, engine)
            held = sequence_bytes(shape, context, item, engine)
            cell = f"{held / 2**20:.1f}"
            if held != full:
                cell += f" (full: {full / 2**20:.1f})"
            cells.append(cell)
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
