"""Soak a live `vkrt serve` on 127.0.0.1: N cycles of M concurrent streams, some dropped mid-way.

After each cycle it waits for the engine to go idle, then reports the requests, failures,
KV-cache blocks free (they must all come back: disconnects free their blocks), and the
server's RSS and open file descriptors (they must not grow without bound). Bounded in count
(--cycles, --streams) and time (--time-limit). Not a test: a script to run by hand.

    .venv/bin/python tools/soak.py --cycles 5 --streams 16                 # starts its own server
    .venv/bin/python tools/soak.py --url http://127.0.0.1:8000 --pid 1234  # an existing one

Exits 1 if a request failed unexpectedly or KV blocks did not come back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Cycle:
    requests: int = 0
    completed: int = 0
    dropped: int = 0  # disconnected on purpose
    failures: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_stats(pid: int | None) -> dict[str, Any]:
    if pid is None:
        return {"rss_mib": None, "open_fds": None}
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_mib": round(rss_kib / 1024, 1), "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def scrape(client: httpx.Client) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values


async def one_stream(client: httpx.AsyncClient, index: int, rng: random.Random, drop_fraction: float,
                     max_tokens: int, cycle: Cycle) -> None:
    drop_after = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < drop_fraction else None
    if index % 2:
        route = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Say something about {index}."}]}
    else:
        route = "/v1/completions"
        body = {"prompt": f"Once upon a time, in town number {index},"}
    body.update({"max_tokens": max_tokens, "stream": True, "temperature": 0.8, "seed": index})
    cycle.requests += 1
    chunks = 0
    try:
        async with client.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                cycle.failures.append(f"{route}: HTTP {response.status_code} {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    cycle.completed += 1
                    return
                if '"error"' in line:
                    cycle.failures.append(f"{route}: error event {line[:200]}")
                    return
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    cycle.dropped += 1
                    return  # leaving the block closes the connection mid-stream
        cycle.failures.append(f"{route}: the stream ended without [DONE]")
    except httpx.HTTPError as exc:
        cycle.failures.append(f"{route}: {type(exc).__name__}: {exc}")


async def run_cycle(url: str, headers: dict[str, str], streams: int, rng: random.Random, drop_fraction: float,
                    max_tokens: int) -> Cycle:
    cycle = Cycle()
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one_stream(client, i, rng, drop_fraction, max_tokens, cycle) for i in range(streams)))
    return cycle


def wait_idle(client: httpx.Client, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(client)
        idle = metrics.get("vkrt_num_requests_running", 0) == 0 and metrics.get("vkrt_num_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def start_server(port: int, serve_args: list[str], api_key: str | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if api_key:
        env["VKRT_API_KEY"] = api_key
    command = [sys.executable, "-m", "vkrt.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="an existing server on 127.0.0.1 (default: start one)")
    parser.add_argument("--pid", type=int, default=None, help="its process id, for RSS and fds")
    parser.add_argument("--serve-args", default="--max-model-len 512",
                        help="flags for the server this script starts (default: %(default)s)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams per cycle")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--drop-fraction", type=float, default=0.5, help="share of streams dropped mid-way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=900.0, help="stop starting cycles after this many s")
    args = parser.parse_args()
    if not (1 <= args.cycles <= 1000 and 1 <= args.streams <= 256):
        parser.error("--cycles must be in [1, 1000] and --streams in [1, 256]")

    server: subprocess.Popen[bytes] | None = None
    pid = args.pid
    if args.url is None:
        port = free_port()
        server = start_server(port, args.serve_args.split(), args.api_key)
        url, pid = f"http://127.0.0.1:{port}", server.pid
    else:
        url = args.url.rstrip("/")
        if urlparse(url).hostname not in LOCAL_HOSTS:
            parser.error("--url must be on 127.0.0.1: this script floods the server it talks to")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    started = time.monotonic()
    report: list[dict[str, Any]] = []
    ok = True
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if (server is not None and server.poll() is not None) or time.monotonic() > deadline:
                    print("soak: the server did not become ready", file=sys.stderr)
                    return 1
                time.sleep(0.5)
            before = {**process_stats(pid), **{k: v for k, v in scrape(client).items() if "kv_blocks" in k}}
            print(f"soak: {url} ready; before: {json.dumps(before)}")
            for n in range(args.cycles):
                if time.monotonic() - started > args.time_limit:
                    print(f"soak: time limit reached after {n} cycles")
                    break
                t0 = time.monotonic()
                cycle = asyncio.run(run_cycle(url, headers, args.streams, rng, args.drop_fraction, args.max_tokens))
                metrics = wait_idle(client, 60)
                row = {"cycle": n + 1, "requests": cycle.requests, "completed": cycle.completed,
                       "dropped": cycle.dropped, "failures": len(cycle.failures),
                       "kv_blocks_free": metrics.get("vkrt_num_free_kv_blocks"),
                       "kv_blocks": metrics.get("vkrt_num_kv_blocks"),
                       "running": metrics.get("vkrt_num_requests_running"),
                       "seconds": round(time.monotonic() - t0, 1), **process_stats(pid)}
                report.append(row)
                print("soak: " + json.dumps(row))
                for failure in cycle.failures[:5]:
                    print(f"soak:   failure: {failure}")
                leaked = row["kv_blocks_free"] != row["kv_blocks"] or row["running"] != 0
                ok = ok and not cycle.failures and not leaked
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    totals = {key: sum(r[key] for r in report) for key in ("requests", "completed", "dropped", "failures")}
    print("soak: " + json.dumps({"cycles": len(report), **totals, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
