"""A load sweep with guidellm, the tool vLLM users run, against `vkrt serve` or `llama-server` (a
script, not a test).

For each shape (synthetic prompt tokens x output tokens) it runs guidellm's synchronous profile,
then fixed concurrency 1 / 4 / 8 / 16, then a throughput run (as many at once as
--throughput-concurrency allows), each bounded by --max-seconds, and prints one markdown table:
requests/s, output tok/s, TTFT and ITL p50 / p99, failed requests (and those still running
when the time limit cancelled them, which are not failures).

guidellm needs torch, so it lives in a venv of its own, never vkrt's; its synthetic prompts need a
Hugging Face tokenizer, which --make-tokenizer writes from the GGUF with that venv's transformers:

    python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm gguf
    .venv/bin/python tools/load_sweep.py --guidellm .venv-guidellm/bin/guidellm              # vkrt serve
    .venv/bin/python tools/load_sweep.py --guidellm .venv-guidellm/bin/guidellm \\
        --server llama-server --llama-server PATH/llama-server                               # the peer

Both servers get the same GGUF (default: the default model), 16 sequences at once and all cores.
Absolute numbers from shared machines are noise: compare rows of runs made side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

PROFILES = ("synchronous", "concurrent@1", "concurrent@4", "concurrent@8", "concurrent@16", "throughput")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(args: argparse.Namespace, model: Path, port: int, max_len: int) -> subprocess.Popen[bytes]:
    if args.server == "vkrt":
        command = [sys.executable, "-m", "vkrt.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--max-model-len", str(max_len), "--max-num-seqs", str(args.slots)]
    else:
        # llama-server splits -c over its slots: each slot gets max_len
        command = [args.llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                   "-c", str(max_len * args.slots), "--parallel", str(args.slots), "-t", str(os.cpu_count() or 1),
                   "--no-webui"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not ready after {timeout:.0f} s")


def make_tokenizer(guidellm: str, model: Path, out: Path) -> None:
    """The GGUF's tokenizer saved as a Hugging Face tokenizer directory, by the guidellm venv's
    transformers (which reads GGUF metadata; it needs the gguf package there)."""
    python = Path(guidellm).parent / "python"
    code = ("import sys; from transformers import AutoTokenizer; "
            "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])")
    subprocess.run([str(python), "-c", code, str(model.parent), model.name, str(out)], check=True)


def run_profile(args: argparse.Namespace, url: str, profile: str, prompt: int, output: int,
                tokenizer: Path, out: Path) -> dict[str, Any]:
    kind, _, streams = profile.partition("@")
    profile_arg = f"kind={kind}"
    if kind == "concurrent":
        profile_arg += f",streams={streams}"
    elif kind == "throughput":
        profile_arg += f",max_concurrency={args.throughput_concurrency}"
    command = [args.guidellm, "run",
               "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
               "--profile", profile_arg,
               "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
               "--constraint", f"kind=max_requests,count={args.max_requests}",
               "--output", f"kind=json,path={out}", "--disable-console"]
    subprocess.run(command, check=True)
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    m = benchmark["metrics"]
    totals = m["request_totals"]
    seconds = float(benchmark["duration"])

    def pct(name: str, q: str) -> float:
        return float(m[name]["successful"]["percentiles"][q])

    return {"profile": profile, "prompt_tokens": prompt, "output_tokens": output, "seconds": seconds,
            # incomplete: still running when the time limit cancelled them, not failures
            "completed": totals["successful"], "failed": totals["errored"], "cut": totals["incomplete"],
            "requests_per_s": totals["successful"] / seconds,
            "output_tok_per_s": m["output_token_count"]["successful"]["total_sum"] / seconds,
            "ttft_p50_ms": pct("time_to_first_token_ms", "p50"), "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
            "itl_p50_ms": pct("inter_token_latency_ms", "p50"), "itl_p99_ms": pct("inter_token_latency_ms", "p99")}


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    out = [f"### {title}", "",
           "| prompt x output | profile | completed | failed | cut at the limit | req/s | output tok/s | TTFT p50 ms "
           "| TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['prompt_tokens']} x {r['output_tokens']} | {r['profile']} | {r['completed']} | "
                   f"{r['failed']} | {r['cut']} | {r['requests_per_s']:.2f} | {r['output_tok_per_s']:.1f} | "
                   f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", required=True, help="the guidellm executable (in its own venv)")
    parser.add_argument("--server", choices=["vkrt", "llama-server"], default="vkrt")
    parser.add_argument("--llama-server", default="llama-server", help="llama-server's executable")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: vkrt's default model)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a Hugging Face tokenizer directory (default: made from the GGUF)")
    parser.add_argument("--shapes", default="128x64,512x256,2048x64",
                        help="PROMPTxOUTPUT token counts, comma-separated (default: %(default)s)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="default: %(default)s")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="each profile's run (default 30)")
    parser.add_argument("--max-requests", type=int, default=200, help="each profile's run (default 200)")
    parser.add_argument("--throughput-concurrency", type=int, default=32,
                        help="requests at once in the throughput run (default 32)")
    parser.add_argument("--slots", type=int, default=16, help="sequences the server runs at once (default 16)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from vkrt.loader.pull import ensure_default_model

        model = Path(ensure_default_model())
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",") if shape]
    max_len = max(p + o for p, o in shapes) + 64
    work = Path(tempfile.mkdtemp(prefix="vkrt-sweep-"))
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = work / "tokenizer"
        make_tokenizer(args.guidellm, model, tokenizer)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, model, port, max_len)
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(url, server)
        for prompt, output in shapes:
            for profile in args.profiles.split(","):
                print(f"{args.server}: {prompt} x {output}, {profile} ...", file=sys.stderr, flush=True)
                rows.append(run_profile(args, url, profile, prompt, output, tokenizer,
                                        work / f"{prompt}x{output}-{profile}.json"))
    finally:
        server.terminate()
        server.wait(timeout=30)
    if args.json:
        print(json.dumps({"server": args.server, "model": model.name, "rows": rows}, indent=2))
    else:
        print(markdown(rows, f"{args.server}, {model.name}: guidellm, {args.max_seconds:g} s or "
                             f"{args.max_requests} requests per profile"))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
