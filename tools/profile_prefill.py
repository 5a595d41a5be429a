"""Where a short prompt's prefill (the engine's share of TTFT) spends its time: cProfile over a few
one-token generations after warm-up (a script, not a test).

  python tools/profile_prefill.py                  # default model on the Vulkan device
  python tools/profile_prefill.py --runs 10 --words 64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from vkrt.engine.config import SamplingParams
from vkrt.engine.llm import LLM

WORDS = ("the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat near the old "
         "stone bridge by the river").split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default model)")
    parser.add_argument("--device", default="vulkan")
    parser.add_argument("--runs", type=int, default=5, help="profiled prefills (after 3 warm-up ones)")
    parser.add_argument("--words", type=int, default=24, help="words per prompt (distinct per run)")
    parser.add_argument("--top", type=int, default=25, help="rows of the cumulative-time table")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_model_len=512)

    def prefill(run: int) -> None:
        prompt = " ".join(WORDS[(run + k) % len(WORDS)] for k in range(args.words))
        for _ in llm.generate_stream(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
            pass

    for run in range(3):
        prefill(run)
    profile = cProfile.Profile()
    profile.enable()
    for run in range(3, 3 + args.runs):
        prefill(run)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
