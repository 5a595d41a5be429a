"""llama.cpp Vulkan peer for tools/bench_peers.py: a llama-bench-like pp/tg measurement.

Runs under the *peer* interpreter (a venv with `cyllama-vulkan`, never vkrt's), so it uses
only the standard library and cyllama's low-level bindings. Protocol with bench_peers.py:

    python tools/peer_llamacpp.py --model M.gguf --serve
        stdout: one line per message, "PEER_JSON {...}"; first {"event": "ready", ...} after
        loading and the untimed warm-up, then one {"event": "result", ...} per "run" line read
        on stdin; "quit" (or EOF) exits. Progress goes to stderr as "peer: ..." lines.

Standalone (for debugging): drop --serve and pass --repeats N; it prints the results.

What one run measures (like llama-bench): clear the KV cache; prefill = one llama_decode of
`prompt_tokens` fixed token ids in one batch + synchronize; decode = `gen_tokens` steps of
(greedy sample, llama_decode of that one token). Warm-up is one such run with a few decode
steps, untimed: on llvmpipe this is where ggml-vulkan compiles its pipelines (minutes).

Device: if GGML_VK_VISIBLE_DEVICES is unset, llama.cpp's default choice is kept; when that
finds no Vulkan GPU (llama.cpp skips CPU-type Vulkan devices such as llvmpipe unless told to
use them), the runner re-executes itself with GGML_VK_VISIBLE_DEVICES=0 and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

_FALLBACK_FLAG = "_VKRT_PEER_VK_FALLBACK"

# Fixed text; tokenized once and repeated to the requested prompt length.
PROMPT_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run many "
    "tasks. Compilers translated readable languages into machine code, operating systems shared "
    "one processor among many users, and graphics processors, first built to draw triangles, "
    "became general engines for parallel arithmetic. Today a small language model can run on a "
    "laptop, predicting one token after another, each step a long chain of matrix products. "
)


def say(msg: str) -> None:
    print(f"peer: {msg}", file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    sys.stdout.write("PEER_JSON " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class LogCapture:
    """llama.cpp log callback: keeps INFO+ lines (joined continuations) and the vulkan device lines."""

    KEEP = ("ggml_vulkan:", "using device", "offloaded", "model buffer size", "KV buffer size",
            "Flash Attention", "compute buffer size", "cannot be used with preferred buffer type")

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.kept: list[str] = []
        self.errors: list[str] = []
        self._partial = ""
        self._level = 2

    def __call__(self, level: int, text: str) -> None:
        try:
            if level == 5:  # continuation of the previous message: keeps its level
                self._partial += text
                level = self._level
            else:
                self._partial, self._level = text, level
            if not self._partial.endswith("\n"):
                return
            line, self._partial = self._partial.rstrip("\n"), ""
            if self.echo and (level >= 2 or "ggml_vulkan" in line):
                print(f"llama.cpp: {line}", file=sys.stderr, flush=True)
            if level >= 4:
                self.errors.append(line)
            if any(k in line for k in self.KEEP) and line not in self.kept:
                self.kept.append(line)
        except Exception:  # never raise into C
            pass

    def find(self, needle: str) -> list[str]:
        return [line for line in self.kept if needle in line]


def vulkan_devices(llama) -> list[dict]:
    return [d for d in llama.ggml_backend_dev_info() if d.get("name", "").startswith("Vulkan")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--warmup-gen-tokens", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=0, help="0: max(512, prompt + gen + warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="0: llama.cpp's default")
    ap.add_argument("--n-gpu-layers", type=int, default=99)
    ap.add_argument("--serve", action="store_true", help="read 'run'/'quit' lines on stdin")
    ap.add_argument("--repeats", type=int, default=1, help="without --serve")
    ap.add_argument("--verbose", action="store_true", help="echo llama.cpp's log")
    args = ap.parse_args()

    try:
        import cyllama  # noqa: F401
        from cyllama.llama import llama_cpp as llama
    except ImportError as exc:
        emit({"event": "error", "error": f"cannot import cyllama ({exc}); install cyllama-vulkan "
                                          "into this interpreter's venv"})
        return 2

    logs = LogCapture(echo=args.verbose)
    llama.set_log_callback(logs)
    llama.ggml_backend_load_all()
    devices = vulkan_devices(llama)
    vis = os.environ.get("GGML_VK_VISIBLE_DEVICES")
    selection = f"GGML_VK_VISIBLE_DEVICES={vis}" if vis is not None else "llama.cpp default"
    cpu = args.n_gpu_layers == 0  # llama.cpp's CPU backend: no device needed
    if not devices and not cpu:
        if vis is None:
            say("llama.cpp found no Vulkan GPU by default (it skips CPU-type devices such as "
                "llvmpipe); re-running with GGML_VK_VISIBLE_DEVICES=0")
            env = dict(os.environ, GGML_VK_VISIBLE_DEVICES="0", **{_FALLBACK_FLAG: "1"})
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, [sys.executable] + sys.argv, env)
        emit({"event": "error", "error": f"llama.cpp's Vulkan backend found no device ({selection}); "
                                          f"log: {logs.find('ggml_vulkan')}"})
        return 3
    if os.environ.get(_FALLBACK_FLAG):
        selection = "GGML_VK_VISIBLE_DEVICES=0, as llama.cpp's default found no Vulkan GPU"

    # ---- load -------------------------------------------------------------------------
    pp, tg, wtg = args.prompt_tokens, args.gen_tokens, args.warmup_gen_tokens
    n_ctx = args.n_ctx or max(512, pp + max(tg, wtg) + 8)
    t0 = time.perf_counter()
    mp = llama.LlamaModelParams()
    mp.n_gpu_layers = args.n_gpu_layers
    model = llama.LlamaModel(args.model, mp)
    cp = llama.LlamaContextParams()
    cp.n_ctx = n_ctx
    cp.n_batch = max(cp.n_batch, pp)  # the prompt is one batch and one ubatch
    cp.n_ubatch = max(cp.n_ubatch, pp)
    if args.threads > 0:
        cp.n_threads = args.threads
        cp.n_threads_batch = args.threads
    ctx = llama.LlamaContext(model, cp)
    load_s = time.perf_counter() - t0
    vocab = model.get_vocab()

    ids = vocab.tokenize(PROMPT_TEXT, add_special=False, parse_special=False)
    prompt: list[int] = []
    if vocab.get_add_bos():
        prompt.append(vocab.token_bos())
    while len(prompt) < pp:
        prompt.extend(ids)
    prompt = prompt[:pp]

    sp = llama.LlamaSamplerChainParams()
    sp.no_perf = True

    def one_run(n_gen: int, label: str | None) -> dict:
        ctx.kv_cache_clear()
        sampler = llama.LlamaSampler(sp)
        sampler.add_greedy()
        t = time.perf_counter()
        ctx.decode(llama.llama_batch_get_one(prompt, 0))
        ctx.synchronize()
        prefill_s = time.perf_counter() - t
        if label:
            say(f"{label}: prefill of {pp} tokens took {prefill_s:.1f} s")
        steps: list[float] = []
        out: list[int] = []
        pos = pp
        t_dec = time.perf_counter()
        for i in range(n_gen):
            ts = time.perf_counter()
            tok = sampler.sample(ctx, -1)
            out.append(tok)
            ctx.decode(llama.llama_batch_get_one([tok], pos))
            ctx.synchronize()
            pos += 1
            steps.append(time.perf_counter() - ts)
            if label and (i == 0 or (i + 1) % 16 == 0 or i + 1 == n_gen):
                say(f"{label}: decode step {i + 1}/{n_gen}, {steps[-1]:.2f} s "
                    f"(elapsed {time.perf_counter() - t_dec:.1f} s)")
        decode_s = time.perf_counter() - t_dec
        sampler.close()
        ordered = sorted(steps)
        return {
            "prompt_tokens": pp, "gen_tokens": n_gen,
            "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_tok_s": pp / prefill_s if prefill_s > 0 else None,
            "decode_tok_s": n_gen / decode_s if n_gen and decode_s > 0 else None,
            "decode_step_ms_median": 1e3 * ordered[len(ordered) // 2] if ordered else None,
            "decode_step_ms_first": 1e3 * steps[0] if steps else None,
            "decode_step_ms_max": 1e3 * ordered[-1] if ordered else None,
            "tokens": out,
        }

    # ---- untimed warm-up: ggml-vulkan compiles pipelines on first use ------------------
    device = "CPU (llama.cpp's CPU backend)" if cpu else devices[0]["description"]
    say(f"warm-up on {device}: prefill {pp} + decode {wtg} tokens, untimed "
        "(compiles Vulkan pipelines; minutes on llvmpipe)")
    t = time.perf_counter()
    warm = one_run(wtg, "warm-up")
    warmup_s = time.perf_counter() - t
    say(f"warm-up done in {warmup_s:.1f} s")

    offloaded = logs.find("offloaded")
    info = {
        "runtime": "llama.cpp",
        "backend": "vulkan",
        "llama_cpp_version": _versions().get("llama_cpp_version"),
        "ggml_version": llama.ggml_version(),
        "ggml_commit": llama.ggml_commit(),
        "cyllama_version": _cyllama_version(),
        "device": device,
        "devices": [d["description"] for d in devices],
        "device_selection": selection,
        "vulkan_log": logs.find("ggml_vulkan:"),
        "offload": offloaded[-1].split(": ", 1)[-1] if offloaded else None,
        "offload_complete": _offload_complete(offloaded[-1] if offloaded else ""),
        "model_devices": [line.split("using device ", 1)[-1] for line in logs.find("using device")],
        "buffers": logs.find("buffer size"),
        "flash_attn": _flash_attn(logs.find("Flash Attention")),
        "model": os.path.basename(args.model),
        "model_desc": model.desc,
        "model_bytes": model.size,
        "n_params": model.n_params,
        "n_ctx": ctx.n_ctx, "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch,
        "n_gpu_layers": args.n_gpu_layers,
        "n_threads": ctx.n_threads(), "n_threads_batch": ctx.n_threads_batch(),
        "threads_note": "llama.cpp default" if args.threads <= 0 else "--threads",
        "cpu_count": os.cpu_count(),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "warmup_prefill_s": warm["prefill_s"],
        "warmup_first_decode_s": warm["decode_step_ms_first"] / 1e3 if warm["tokens"] else None,
        "warmup_decode_s": warm["decode_s"],
        "prompt_ids_head": prompt[:8],
        "log_errors": logs.errors[-5:],
    }

    def run_once() -> dict:
        r = one_run(tg, "run")
        r["tokens_head"] = r.pop("tokens")[:16]
        return r

    if not args.serve:
        print(json.dumps(info, indent=2), flush=True)
        for _ in range(args.repeats):
            print(json.dumps(run_once(), indent=2), flush=True)
        return 0

    emit({"event": "ready", **info})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "run":
            try:
                emit({"event": "result", **run_once()})
            except Exception as exc:  # report, keep serving
                emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        elif cmd in ("quit", "exit"):
            break
    return 0


def _offload_complete(line: str) -> bool | None:
    """'offloaded 31/31 layers to GPU' -> True."""
    m = re.search(r"offloaded (\d+)/(\d+) layers", line)
    return None if m is None else m.group(1) == m.group(2)


def _flash_attn(lines: list[str]) -> str | None:
    """'Flash Attention was auto, set to enabled' -> 'enabled (auto)'."""
    if not lines:
        return None
    text = lines[-1].split(": ", 1)[-1]
    state = "enabled" if "enabled" in text else "disabled" if "disabled" in text else text
    return f"{state} (auto)" if "auto" in text else state


def _versions() -> dict:
    try:
        import cyllama
        path = os.path.join(os.path.dirname(cyllama.__file__), "build_config.json")
        with open(path) as fh:
            return json.load(fh).get("versions", {})
    except Exception:
        return {}


def _cyllama_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("cyllama-vulkan")
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
