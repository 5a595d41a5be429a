#!/usr/bin/env python3
"""How much faster can n-gram speculation make this prompt on this device? A benchmark script,
never a test.

A verify step of r rows costs more than a plain step; on a compute-bound device such as
llvmpipe each row adds most of a step's multiply-adds, on a GPU rows are nearly free. So the
speed-up of speculative decoding is bounded by the device's cost per row as much as by the
proposals. This script measures both and says where a run stands:

1. It decodes the prompt greedily with n-gram speculation, recording each decode step's wall time
   by its rows (one sequence: a step's rows are its tokens), and once without speculation (the
   per-request opt-out, same engine). The greedy ids are the same either way (tests assert it).
2. It replays those ids through the n-gram proposer offline and counts the steps each policy
   would run, each step priced at the measured median cost of its row count (a count the run
   never made: the next larger one it made; past the largest, extrapolated linearly):
   - "engine": the engine's own rules (`speculative.proposal_length`, `backoff_after`); its
     prediction should be close to the measured ratio, which checks the cost model.
   - "oracle": every proposal exactly as long as the run the target accepts (at most k), from
     the same n-gram candidates: no proposal-length rule can beat it.
   - "every row accepted": each step k proposals, all accepted: the device's bound for this k.

    python tools/spec_ceiling.py --prompt-file tools/bench_prompts/copy_prose.txt -g 256 -k 7
    python tools/spec_ceiling.py --prompt-file F -k 15 --json

The numbers are wall times on a shared machine: run it a few times.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vkrt.engine.speculative import backoff_after, ngram_proposal, proposal_length  # noqa: E402


def simulate(prompt: Sequence[int], output: Sequence[int], k: int, lookup_max: int, lookup_min: int,
             oracle: bool = False) -> list[int]:
    """The rows of each decode step n-gram speculation would run to emit `output` after `prompt`
    (greedy, one sequence): with the engine's proposal-length and back-off rules, or (`oracle`)
    with each proposal cut to the run the target accepts. As in the engine, the first output token
    comes from the prefill and no proposal reaches past the last output token (max_tokens)."""
    tokens = [*prompt, output[0]]
    i, length, wait, backoff, rows = 1, 0, 0, 0, []
    while i < len(output):
        room = len(output) - i - 1  # max_tokens leaves no room for a proposal past the last token
        proposal: list[int] = []
        if wait:
            wait -= 1
        elif room > 0:
            proposal = ngram_proposal(tokens, min(k if oracle else (length or k), room), lookup_max, lookup_min)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == output[i + accepted]:
            accepted += 1
        if oracle:
            proposal = proposal[:accepted]
        rows.append(1 + len(proposal))
        tokens += output[i:i + accepted + 1]
        i += accepted + 1
        if proposal and not oracle:
            length = proposal_length(len(proposal), accepted, k)
            backoff = wait = backoff_after(backoff, accepted)
    return rows


def step_cost(costs: dict[int, float], rows: int) -> float:
    """A step of `rows` rows: its measured cost, else the next larger measured count's, else a line
    through the two largest measured counts."""
    counts = sorted(costs)
    at = bisect.bisect_left(counts, rows)
    if at < len(counts):
        return costs[counts[at]]
    if len(counts) == 1:
        return costs[counts[0]] * rows / counts[0]
    a, b = counts[-2], counts[-1]
    return costs[b] + (rows - b) * (costs[b] - costs[a]) / (b - a)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from vkrt.cli_generate import host_load
    from vkrt.engine import LLM, SamplingParams
    from vkrt.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": args.k,
                                    "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min})
    assert spec is not None
    text = Path(args.prompt_file).read_text(encoding="utf-8")  # before the load a bad path would waste
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=1, enable_prefix_caching=False,
              speculative=spec)
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    prompt = list(tokenizer.encode(text))
    by_rows: dict[int, list[float]] = collections.defaultdict(list)
    recording = [False]
    decode_seconds = [0.0]  # this run's decode steps (the prefill is the same for both and not compared)

    def record(stats: Any) -> None:
        if recording[0] and stats.num_prompt_tokens == 0:
            by_rows[stats.step.num_tokens].append(stats.step.seconds)
            decode_seconds[0] += stats.step.seconds

    llm.engine.stats_listeners.append(record)
    load_before = host_load()
    speculative = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    plain = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True, speculative=False)
    llm.generate(prompt, speculative)  # untimed: pipelines and recorded steps for every row count
    llm.generate(prompt, plain)
    seconds: dict[str, list[float]] = {"plain": [], "speculative": []}
    ids: dict[str, list[int]] = {}
    for round_ in range(args.repeat):
        for name in ("plain", "speculative") if round_ % 2 == 0 else ("speculative", "plain"):
            recording[0], decode_seconds[0] = True, 0.0
            [out] = llm.generate(prompt, plain if name == "plain" else speculative)
            seconds[name].append(decode_seconds[0])
            recording[0] = False
            ids[name] = list(out.outputs[0].token_ids)
    if ids["plain"] != ids["speculative"]:
        raise SystemExit("speculative decoding made other ids than plain decoding: a bug, not a benchmark")
    costs = {rows: statistics.median(v) for rows, v in by_rows.items()}
    base = costs[1]
    output = ids["plain"]
    policies = {
        "engine": simulate(prompt, output, args.k, args.lookup_max, args.lookup_min),
        "oracle": simulate(prompt, output, args.k, args.lookup_max, args.lookup_min, oracle=True),
    }
    report: dict[str, Any] = {
        "prompt_tokens": len(prompt), "gen_tokens": len(output), "k": args.k,
        "step_ms_by_rows": {rows: 1e3 * costs[rows] for rows in sorted(costs)},
        "step_cost_by_rows": {rows: costs[rows] / base for rows in sorted(costs)},
        "steps_by_rows": {rows: len(by_rows[rows]) for rows in sorted(by_rows)},
        "measured_ratio": statistics.median(p / s for p, s in zip(seconds["plain"], seconds["speculative"],
                                                                  strict=True)),
        "policies": {},
        "host_load": {"before": load_before, "after": host_load()},  # as `vkrt bench` reports it
    }
    decode_tokens = len(output) - 1  # the first token comes from the prefill
    for name, rows in policies.items():
        cost = sum(step_cost(costs, r) for r in rows)
        report["policies"][name] = {"steps": len(rows), "verify_steps": sum(1 for r in rows if r > 1),
                                    "predicted_ratio": decode_tokens * base / cost}
    report["policies"]["every row accepted"] = {"steps": None, "verify_steps": None,
                                                "predicted_ratio": (args.k + 1) * base / step_cost(costs, args.k + 1)}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    parser.add_argument("--prompt-file", required=True)
    parser.add_argument("-g", "--gen-tokens", type=int, default=256)
    parser.add_argument("-k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds of plain and speculative decoding")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.gen_tokens < 2 or args.repeat < 1:
        parser.error("--gen-tokens must be >= 2 (decode steps to time) and --repeat >= 1")
    from vkrt.errors import VkrtError

    try:
        report = measure(args)
    except (VkrtError, OSError) as exc:
        print(f"spec_ceiling: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    load = report["host_load"]
    print(f"{report['prompt_tokens']}-token prompt, {report['gen_tokens']} tokens, k = {args.k}"
          + ("" if load["before"] is None else f"; host load {load['before']:.2f} before, {load['after']:.2f} after"))
    print("step cost by rows (x a 1-row step; steps timed): " + ", ".join(
        f"{r}: {c:.2f} ({report['steps_by_rows'][r]})" for r, c in report["step_cost_by_rows"].items()))
    print(f"measured speculative / plain decode (median of {args.repeat} rounds, the steps' wall time): "
          f"{report['measured_ratio']:.2f}x")
    for name, p in report["policies"].items():
        steps = "" if p["steps"] is None else f" ({p['steps']} steps, {p['verify_steps']} verify)"
        print(f"  {name:<20} predicted {p['predicted_ratio']:.2f}x{steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
