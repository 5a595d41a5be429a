"""What a KV-cache format costs in accuracy, on the real models' golden prompts.

    python tools/kv_accuracy.py [--model smollm2-135m-instruct gemma-3-270m] [--device vulkan]

For each model (a pulled name with a golden file in tests/fixtures) and each --kv-cache-dtype:
the logits of every position of prompt + transformers' greedy continuation in one forward
(teacher forcing; every position attends through the cache, so each K/V is read back in the
format), compared with the same forward over an f32 cache and over an f16 cache (NMSE over all
positions, mean per prompt; how often the top token agrees with the f32 cache's); and free
greedy decoding compared with the
golden ids (prompts whose continuation equals transformers' to its end, and the tokens before
each prompt's first difference, of all golden tokens). A measurement, not a test; accuracy, not speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vkrt.backend import get_backend  # noqa: E402
from vkrt.core.kv_format import KV_DTYPES, bytes_per_value  # noqa: E402
from vkrt.engine import LLM, SamplingParams  # noqa: E402
from vkrt.loader import load_model  # noqa: E402
from vkrt.loader.pull import find_model  # noqa: E402
from vkrt.models import ForwardBatch, StepTensors, build_model  # noqa: E402

GOLDENS = {"smollm2-135m-instruct": "smollm2_golden.json", "gemma-3-270m": "gemma3_270m_golden.json"}


def golden_cases(name: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy ids) of every case in the model's golden file."""
    golden = json.loads((REPO / "tests" / "fixtures" / GOLDENS[name]).read_text())
    cases = golden.get("cases", []) + golden.get("text_prompts", []) + golden.get("chats", [])
    return [(c["prompt_ids"], c["greedy_ids"]) for c in cases]


def teacher_forced(model, kv_dtype: str, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """Logits [len(prompt) + len(continuation) - 1, vocab] of one forward over a fresh cache in
    `kv_dtype`, one sequence in blocks 0, 1, ... of 16 positions."""
    ids = np.array(prompt + continuation[:-1], np.int32)
    n = ids.size
    kv = model.allocate_kv_cache(-(-n // 16), 16, kv_dtype)
    positions = np.arange(n, dtype=np.int32)
    batch = ForwardBatch(ids, positions, np.zeros(n, np.int32), positions, np.arange(-(-n // 16), dtype=np.int32)[None],
                         positions)
    return model.forward(StepTensors.upload(model.backend, batch), kv).numpy()


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got.astype(np.float64) - want) ** 2).sum() / (want.astype(np.float64) ** 2).sum())


def leading(got: list[int], want: list[int]) -> int:
    n = 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=list(GOLDENS), choices=list(GOLDENS))
    ap.add_argument("--device", default="vulkan", choices=["vulkan", "reference"])
    args = ap.parse_args(argv)
    print("| model | KV cache | bytes / value | logits NMSE vs f32 cache | vs f16 cache | top-1 = f32 cache's "
          "| greedy = transformers' (prompts) | greedy tokens = transformers' |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.model:
        path = find_model(name)
        if path is None:
            print(f"{name}: not pulled (vkrt pull {name})", file=sys.stderr)
            continue
        cases = golden_cases(name)
        model = build_model(load_model(path), get_backend(args.device))
        forced_by = {d: [teacher_forced(model, d, p, c) for p, c in cases] for d in ("f32", "f16")}
        exact = forced_by["f32"]
        for kv_dtype in ("f32", *[d for d in KV_DTYPES if d != "f32"]):
            forced = forced_by.get(kv_dtype) or [teacher_forced(model, kv_dtype, p, c) for p, c in cases]
            errors = [nmse(f, e) for f, e in zip(forced, exact, strict=True)]
            errors16 = [nmse(f, e) for f, e in zip(forced, forced_by["f16"], strict=True)]
            top1 = np.mean(np.concatenate([f.argmax(-1) == e.argmax(-1) for f, e in zip(forced, exact, strict=True)]))
            width = max(len(p) + len(c) for p, c in cases)
            llm = LLM(path, device=args.device, max_model_len=width + 16, max_num_seqs=len(cases), kv_dtype=kv_dtype)
            outputs = llm.generate([p for p, _ in cases],
                                   SamplingParams(max_tokens=max(len(c) for _, c in cases), temperature=0.0,
                                                  ignore_eos=True))
            lead = [leading(o.token_ids, c) for o, (_, c) in zip(outputs, cases, strict=True)]
            equal = sum(n == len(c) for n, (_, c) in zip(lead, cases, strict=True))
            print(f"| {name} | {kv_dtype} | {bytes_per_value(kv_dtype):.4g} | {np.mean(errors):.2e} "
                  f"| {np.mean(errors16):.2e} | {top1:.4f} | {equal} / {len(cases)} "
                  f"| {sum(lead)} / {sum(len(c) for _, c in cases)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
