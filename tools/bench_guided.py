"""Structured-output benchmark: constrained vs unconstrained decode on the engine (a script, not a test).

Runs the same chat prompts through `vkrt.engine.LLM` in-process (no HTTP), with 1 and 8
concurrent streams, once unconstrained and once constrained to a JSON schema of a nested
object, and reports decode tok/s for both, their ratio, the host time spent computing the
token masks per step (p50/p99; on a replayed step the device runs the forward meanwhile),
and the device counters of a constrained decode step (submits, drains, and host_overlaps:
1 when its masks were computed after the submit).

Decode tok/s counts only steps in which every stream is decoding (one token each), so a
constrained stream that finishes its JSON early does not shrink the batch being compared;
a step's time runs from the end of the previous step to the end of this one, so the mask
computation, sampling and output handling are all inside it.

  python tools/bench_guided.py                         # default model, streams 1 and 8
  python tools/bench_guided.py --streams 1,4,8 --max-tokens 64 --repeats 3 --json

Absolute numbers from shared CPU machines are noise; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkrt.engine import LLM, GuidedDecoding, SamplingParams
from vkrt.engine.engine import IterationStats

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "address", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["friend", "colleague", "family"]}},
    },
}
PEOPLE = ["a baker", "a pilot", "a teacher", "a gardener", "a painter", "a nurse", "a sailor", "a chemist"]


@dataclass
class Steps:
    """What the engine's stats listener saw, one entry per step."""

    ends: list[float] = field(default_factory=list)
    stats: list[IterationStats] = field(default_factory=list)

    def __call__(self, stats: IterationStats) -> None:
        self.ends.append(time.perf_counter())
        self.stats.append(stats)


def run(llm: LLM, prompts: list[str], constrained: bool, max_tokens: int, seed: int, steps: Steps) -> dict[str, Any]:
    guided = GuidedDecoding("json", SCHEMA) if constrained else None
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed + i, guided_decoding=guided,
                             ignore_eos=not constrained) for i in range(len(prompts))]
    steps.ends.clear()
    steps.stats.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    n = len(prompts)
    decode_s, decode_tokens, mask_s, counters = 0.0, 0, [], []
    previous = start
    for end, stats in zip(steps.ends, steps.stats, strict=True):
        if stats.step.num_seqs == n and stats.step.num_tokens == n:  # every stream decoding
            decode_s += end - previous
            decode_tokens += stats.num_generation_tokens
            counters.append(stats.step.counters)
        if stats.mask_seconds is not None:
            mask_s.append(stats.mask_seconds)
        previous = end
    for output in outputs if constrained else []:
        if output.outputs[0].finish_reason == "stop":  # complete JSON: the constraint held
            json.loads(output.outputs[0].text)
    return {"decode_tokens": decode_tokens, "decode_s": decode_s,
            "tok_per_s": decode_tokens / decode_s if decode_s else float("nan"),
            "generated": sum(len(o.outputs[0].token_ids) for o in outputs), "mask_s": mask_s,
            "submits": float(np.mean([c.get("submits", 0) for c in counters])) if counters else float("nan"),
            "drains": float(np.mean([c.get("drains", 0) for c in counters])) if counters else float("nan"),
            "overlaps": float(np.mean([c.get("host_overlaps", 0) for c in counters])) if counters else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--device", default="auto", help="auto | vulkan | reference")
    parser.add_argument("--streams", default="1,8", help="comma-separated concurrent stream counts")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (constrained: at most)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per mode; the best tok/s is kept")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.streams.split(",")]

    llm = LLM(args.model, device=args.device, max_model_len=512, max_num_seqs=max(counts))
    assert llm.tokenizer is not None
    steps = Steps()
    llm.engine.stats_listeners.append(steps)
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} (person {i}) as a JSON object."}],
        add_generation_prompt=True) for i in range(max(counts))]
    run(llm, prompts[:max(counts)], True, 8, 0, steps)  # warm-up: graphs recorded, grammar compiled
    run(llm, prompts[:max(counts)], False, 8, 0, steps)

    rows = []
    for n in counts:
        best: dict[bool, dict[str, Any]] = {}
        masks: list[float] = []
        for repeat in range(args.repeats):
            for constrained in (False, True):
                result = run(llm, prompts[:n], constrained, args.max_tokens, 100 * repeat, steps)
                masks += result["mask_s"]
                if constrained not in best or result["tok_per_s"] > best[constrained]["tok_per_s"]:
                    best[constrained] = result
        free, guided = best[False], best[True]
        rows.append({"streams": n, "unconstrained_tok_s": free["tok_per_s"], "constrained_tok_s": guided["tok_per_s"],
                     "ratio": guided["tok_per_s"] / free["tok_per_s"],
                     "mask_ms_p50": 1e3 * float(np.percentile(masks, 50)),
                     "mask_ms_p99": 1e3 * float(np.percentile(masks, 99)), "mask_steps": len(masks),
                     "constrained_submits_per_step": guided["submits"],
                     "constrained_drains_per_step": guided["drains"],
                     "constrained_overlaps_per_step": guided["overlaps"],
                     "constrained_decode_tokens": guided["decode_tokens"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"model {args.model or 'default'}: max_tokens {args.max_tokens}, repeats {args.repeats} "
          "(best tok/s of each mode)")
    print("| streams | unconstrained tok/s | constrained tok/s | ratio | mask ms/step p50 | p99 | "
          "submits / drains / overlaps per constrained decode step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['unconstrained_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | "
              f"**{r['ratio']:.2f}x** | {r['mask_ms_p50']:.3f} | {r['mask_ms_p99']:.3f} | "
              f"{r['constrained_submits_per_step']:.0f} / {r['constrained_drains_per_step']:.0f} / "
              f"{r['constrained_overlaps_per_step']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
