"""Serving benchmark: N concurrent streams against a live vkrt server (a script, not a test).

For each concurrency N (default 1, 4, 8, 16) it sends N streaming completions at once,
greedy with ignore_eos so every stream generates exactly --max-tokens tokens, and reports
aggregate generated tok/s, TTFT and inter-token latency (ITL) p50/p99 as a markdown table.

  python tools/bench_serving.py                      # start a server in-process (default model)
  python tools/bench_serving.py --model m.gguf --device reference
  python tools/bench_serving.py --url http://127.0.0.1:8000 --concurrency 1,8

Absolute numbers from shared CPU machines are noise; compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

PROMPT_WORDS = ("the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat "
                "near the old stone bridge by the river").split()


@dataclass
class Stream:
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0


def prompt_for(i: int, num_words: int) -> str:
    words = [PROMPT_WORDS[(i + k) % len(PROMPT_WORDS)] for k in range(num_words)]
    return f"Request {i}: " + " ".join(words)


async def one_stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    stream = Stream(sent=time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"server answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise SystemExit(f"stream failed: {chunk['error']}")
            if chunk.get("usage"):
                stream.completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                stream.chunk_times.append(time.perf_counter())
    return stream


async def wave(url: str, headers: dict[str, str], model: str, n: int, max_tokens: int,
               prompt_words: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=n + 1)) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(one_stream(client, model, prompt_for(i, prompt_words), max_tokens)
                                         for i in range(n)))
        wall = time.perf_counter() - start
    ttft = [s.chunk_times[0] - s.sent for s in streams if s.chunk_times]
    itl = [float(d) for s in streams for d in np.diff(s.chunk_times)]
    tokens = sum(s.completion_tokens for s in streams)

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    return {"streams": n, "generated_tokens": tokens, "wall_s": wall, "requests_per_s": n / wall,
            "tok_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    base = rows[0]["tok_per_s"] if rows else 0.0
    out = [f"### {title}", "",
           "| streams | gen tokens | wall s | req/s | agg tok/s | vs 1st row | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
           "| ITL p99 ms |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['streams']} | {r['generated_tokens']} | {r['wall_s']:.1f} | {r['requests_per_s']:.2f} | "
                   f"{r['tok_per_s']:.2f} | "
                   f"{r['tok_per_s'] / base if base else 0:.2f}x | {r['ttft_p50_s'] * 1e3:.0f} | "
                   f"{r['ttft_p99_s'] * 1e3:.0f} | {r['itl_p50_s'] * 1e3:.0f} | {r['itl_p99_s'] * 1e3:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server; default: start one in-process")
    parser.add_argument("--model", default=None, help="model path for the in-process server (default model)")
    parser.add_argument("--device", default="auto", help="auto | vulkan | reference (in-process server)")
    parser.add_argument("--served-model-name", default=None, help="`model` to send (default: ask /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,8,16", help="comma-separated stream counts")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--prompt-words", type=int, default=24, help="words per prompt (distinct per stream)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (in-process server)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x]

    with ExitStack() as stack:
        url, device = args.url, args.device
        if url is None:
            from vkrt.server import ServerConfig, build_app, load_engine
            from vkrt.server.background import BackgroundServer

            config = ServerConfig(model=args.model, device=args.device, max_model_len=args.max_model_len,
                                  max_num_seqs=max(levels), kv_cache_memory=args.kv_cache_memory,
                                  api_key=args.api_key)
            print(f"loading {config.model_name()} on {args.device} ...", file=sys.stderr)
            engine = load_engine(config)
            stack.callback(engine.shutdown)
            device = engine.engine.model.backend.name
            url = stack.enter_context(BackgroundServer(build_app(engine, config))).url
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.served_model_name or httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        asyncio.run(wave(url, headers, model, 1, 2, args.prompt_words))  # warm-up: first-use costs
        rows = []
        for n in levels:
            print(f"{n} stream(s) ...", file=sys.stderr)
            rows.append(asyncio.run(wave(url, headers, model, n, args.max_tokens, args.prompt_words)))
    if args.json:
        print(json.dumps({"model": model, "device": device, "max_tokens": args.max_tokens, "rows": rows}, indent=2))
    else:
        print(markdown(rows, f"{model} on {device}: {args.max_tokens} tokens per stream, greedy, ignore_eos"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
