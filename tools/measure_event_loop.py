"""How a live `vkrt serve` answers others while it is handed megabyte prompts (not a test).

Starts a server on 127.0.0.1 with the default model, runs one authenticated stream, then
sends four large prompts at once (8 MB to /tokenize, and 1 Mi characters each to
/tokenize, /v1/completions and /v1/chat/completions) while polling GET /health. Prints
/health latencies before and during, and the stream's gaps between chunks, as JSON.

    .venv/bin/python tools/measure_event_loop.py
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

API_KEY = "measure"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG_REQUESTS = [
    ("tokenize 8 MB", "/tokenize", {"prompt": "abc def " * 1035000}),
    ("tokenize 1 Mi chars", "/tokenize", {"prompt": "abc def " * 131000}),
    ("completion 1 Mi chars", "/v1/completions", {"prompt": "abc def " * 131000, "max_tokens": 2}),
    ("chat 1 Mi chars", "/v1/chat/completions", {"messages": [{"role": "user", "content": "abc def " * 131000}]}),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": round(1000 * statistics.median(values), 1),
            "max": round(1000 * max(values), 1)} if values else {"n": 0}


def health_latency(url: str) -> float:
    started = time.monotonic()
    httpx.get(f"{url}/health", timeout=30).raise_for_status()
    return time.monotonic() - started


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "vkrt.cli", "serve", "--port", str(port), "--max-model-len", "512"],
                              env={**os.environ, "VKRT_API_KEY": API_KEY}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                print("the server exited before it was ready", file=sys.stderr)
                return 1
            time.sleep(0.5)

        chunk_times: list[float] = []

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
            with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", headers=AUTH,
                                                                     json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk_times.append(time.monotonic())

        streamer = threading.Thread(target=stream)
        streamer.start()
        while len(chunk_times) < 5:
            time.sleep(0.1)
        baseline = [health_latency(url) for _ in range(20)]

        results: dict[str, Any] = {}

        def send(name: str, route: str, body: dict[str, Any]) -> None:
            started = time.monotonic()
            r = httpx.post(f"{url}{route}", headers={**AUTH, "Content-Type": "application/json"},
                           content=json.dumps(body), timeout=600)
            results[name] = {"status": r.status_code, "seconds": round(time.monotonic() - started, 2)}

        senders = [threading.Thread(target=send, args=case) for case in BIG_REQUESTS]
        window_start = time.monotonic()
        for sender in senders:
            sender.start()
        during = []
        while any(sender.is_alive() for sender in senders):
            during.append(health_latency(url))
            time.sleep(0.05)
        window_end = time.monotonic()
        for sender in senders:
            sender.join()
        streamer.join(600)
        gaps = [(t, t - prev) for prev, t in zip(chunk_times, chunk_times[1:], strict=False)]
        print(json.dumps({
            "big_requests": results, "window_s": round(window_end - window_start, 2),
            "health_ms_before": summary_ms(baseline), "health_ms_during": summary_ms(during),
            "stream_gap_ms_before": summary_ms([g for t, g in gaps if t < window_start]),
            "stream_gap_ms_during": summary_ms([g for t, g in gaps if window_start <= t <= window_end]),
        }, indent=1))
        return 0
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
