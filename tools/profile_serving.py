"""Where one stream's time goes between the engine step and the SSE chunk (a script, not a test).

One process holds the model, the server (a background thread) and the client. Rounds alternate,
so every ratio compares runs made on the machine as it was then:
  engine  the AsyncLLM facade alone (no HTTP): its decode step (the engine's own timing, as
          `vkrt bench` reports it) and the inter-token gap its asyncio consumer sees;
  http    one streaming completion over HTTP: the client's TTFT and ITL, the engine's step and
          prefill time during it, when each output left the engine thread and when its chunk
          reached the client, and each thread's CPU time per token (from /proc, Linux only).
It prints the median over rounds of each figure.

  python tools/profile_serving.py                       # default model, Vulkan device
  python tools/profile_serving.py --rounds 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import httpx
import numpy as np

from vkrt.engine import async_llm
from vkrt.engine.async_llm import AsyncLLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.engine import IterationStats
from vkrt.engine.request import RequestMetrics, RequestOutput

PROMPT = "Request {i}: the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, summed by name (Python's thread
    name, else the OS's) with trailing digits dropped."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    totals: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                # threads Python did not start (the device's workers) keep the process's name
                name = re.sub(r"[-_:]?\d+$", "", python_names.get(int(tid)) or f"native:{f.read().strip()}")
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        totals[name] += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return dict(totals)


class Probe:
    """Timestamps from inside the process: outputs handed to the event loop, engine step times."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.handoffs: list[float] = []
        self.first_metrics: RequestMetrics | None = None  # the engine's timestamps, from its first output
        self.steps: list[tuple[bool, float, float, int]] = []  # (had prefill tokens, runner s, device wait s, submits)
        original = async_llm._Stream.put

        def put(stream: async_llm._Stream, item: Any) -> None:
            self.handoffs.append(time.monotonic())
            if self.first_metrics is None and isinstance(item, RequestOutput):
                self.first_metrics = item.metrics
            original(stream, item)

        async_llm._Stream.put = put  # type: ignore[assignment]
        llm.add_stats_listener(self._on_step)

    def _on_step(self, stats: IterationStats) -> None:
        counters = stats.step.counters
        self.steps.append((stats.num_prompt_tokens > 0, stats.step.seconds, counters.get("wait_us", 0) / 1e6,
                           counters.get("submits", 0)))

    def reset(self) -> None:
        self.handoffs.clear()
        self.steps.clear()
        self.first_metrics = None

    def decode_step_ms(self) -> float:
        return 1e3 * statistics.median(s for prefill, s, _, _ in self.steps if not prefill)

    def prefill_ms(self) -> float:
        return 1e3 * sum(s for prefill, s, _, _ in self.steps if prefill)

    def prefill_host_ms(self) -> float:
        """The prefill step's time not spent waiting for the device: recording it on the host."""
        return 1e3 * sum(s - wait for prefill, s, wait, _ in self.steps if prefill)

    def prefill_submits(self) -> int:
        return sum(submits for prefill, _, _, submits in self.steps if prefill)


async def engine_round(llm: AsyncLLM, probe: Probe, i: int, max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    probe.reset()
    start = time.monotonic()
    times = []
    async for output in llm.generate(PROMPT.format(i=i), params):
        if output.outputs[0].token_ids:
            times.append(time.monotonic())
    return {"engine_step_ms": probe.decode_step_ms(), "facade_itl_ms": 1e3 * float(np.median(np.diff(times))),
            "facade_ttft_ms": 1e3 * (times[0] - start), "facade_prefill_ms": probe.prefill_ms(),
            "facade_prefill_host_ms": probe.prefill_host_ms(), "facade_prefill_submits": probe.prefill_submits()}


async def http_round(url: str, model: str, probe: Probe, i: int, max_tokens: int) -> dict[str, float]:
    body = {"model": model, "prompt": PROMPT.format(i=i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        await client.get("/health")  # connected before the clock starts, as a client that keeps its connection
        probe.reset()
        cpu_before = thread_cpu()
        sent = time.monotonic()
        received = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    received.append(time.monotonic())
        cpu_after = thread_cpu()
    handoffs = probe.handoffs[:len(received)]
    row = {"http_ttft_ms": 1e3 * (received[0] - sent), "http_itl_ms": 1e3 * float(np.median(np.diff(received))),
           "http_engine_step_ms": probe.decode_step_ms(), "http_prefill_ms": probe.prefill_ms(),
           "handoff_to_client_ms": 1e3 * float(np.median(np.subtract(received, handoffs)))}
    row["http_ttft_over_prefill_ms"] = row["http_ttft_ms"] - row["http_prefill_ms"]
    first = probe.first_metrics
    if first is not None and first.first_scheduled_time is not None and first.first_token_time is not None:
        # TTFT in parts: HTTP, validation and tokenising up to the engine's queue; the wait for
        # a step; the prefill step (scheduling and sampling included); back to the client.
        row["ttft_sent_to_engine_ms"] = 1e3 * (first.arrival_time - sent)
        row["ttft_queued_ms"] = 1e3 * (first.first_scheduled_time - first.arrival_time)
        row["ttft_step_ms"] = 1e3 * (first.first_token_time - first.first_scheduled_time)
        row["ttft_token_to_client_ms"] = 1e3 * (received[0] - first.first_token_time)
    for name, seconds in cpu_after.items():
        row[f"cpu_ms_per_token[{name}]"] = 1e3 * (seconds - cpu_before.get(name, 0.0)) / len(received)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default model)")
    parser.add_argument("--device", default="vulkan")
    parser.add_argument("--rounds", type=int, default=5, help="engine and http rounds, alternating")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from vkrt.server import ServerConfig, build_app
    from vkrt.server.background import BackgroundServer

    config = ServerConfig(model=args.model, device=args.device, max_model_len=512, max_num_seqs=4)
    llm = AsyncLLM(config.engine_config())
    probe = Probe(llm)
    rows: dict[str, list[float]] = defaultdict(list)
    try:
        with BackgroundServer(build_app(llm, config)) as server:
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            asyncio.run(http_round(server.url, model, probe, -1, 4))  # warm-up: first-use costs
            asyncio.run(engine_round(llm, probe, -2, 4))
            for i in range(args.rounds):
                for key, value in asyncio.run(engine_round(llm, probe, 2 * i, args.max_tokens)).items():
                    rows[key].append(value)
                for key, value in asyncio.run(http_round(server.url, model, probe, 2 * i + 1,
                                                         args.max_tokens)).items():
                    rows[key].append(value)
                print(f"round {i + 1}: step {rows['engine_step_ms'][-1]:.1f} ms, http ITL "
                      f"{rows['http_itl_ms'][-1]:.1f} ms", file=sys.stderr)
    finally:
        llm.shutdown()
    ratios = [h / e for h, e in zip(rows["http_itl_ms"], rows["engine_step_ms"], strict=True)]
    print(f"median of {args.rounds} rounds, {args.max_tokens} tokens each, one stream")
    print(f"  http ITL / engine step: {statistics.median(ratios):.2f}x (rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    for key, values in sorted(rows.items()):
        print(f"  {key:40s} {statistics.median(values):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
