#!/usr/bin/env python3
"""Run llama.cpp's Vulkan backend and vkrt on the same device and GGUF; print vkrt/peer ratios.

A benchmark script, never a test. For pp (prefill) and tg (decode) tok/s it runs, interleaved,
peer, vkrt, peer, vkrt, ... and reports the median over repeats of the paired ratio
vkrt / llama.cpp. Absolute numbers on shared machines are noise; ratios in one run are the
signal.

    python tools/bench_peers.py                          # default model, pp 128 / tg 128, 2 repeats
    python tools/bench_peers.py --only peer --gen-tokens 32
    python tools/bench_peers.py --json > peers.json      # JSON on stdout, the table on stderr

The peer is llama.cpp through the `cyllama-vulkan` wheel, installed in its own venv so it
never touches vkrt's (see --peer-python). It runs as one long-lived subprocess
(tools/peer_llamacpp.py): it loads the model with every layer offloaded, does one untimed
warm-up (ggml-vulkan compiles its pipelines then: about a minute or more on llvmpipe; reported
as warmup_s) and then answers one timed run per repeat. vkrt runs as
`<vkrt python> -m vkrt.cli bench --json ...`, one fresh process per repeat, which likewise
makes one untimed warm-up run (creating its pipelines, recording its decode steps) before the
timed one.

Device: by default each runtime picks its own (vkrt: VKRT_DEVICE or its ranking; llama.cpp:
its default GPUs, or GGML_VK_VISIBLE_DEVICES=0 when it finds none because it skips CPU-type
Vulkan devices such as llvmpipe). --device-index N pins both to Vulkan physical device N
(VKRT_DEVICE=N, GGML_VK_VISIBLE_DEVICES=N). The two device names are printed and compared.
--peer-backend cpu runs llama.cpp's CPU backend instead (no Vulkan device visible to it, no
layer offloaded) on the same cores, against vkrt on its usual device.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_RUNNER = HERE / "peer_llamacpp.py"
DEFAULT_PEER_PYTHON = ".venv-peer/bin/python"
PEER_SETUP = "python3 -m venv .venv-peer && .venv-peer/bin/pip install cyllama-vulkan"


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"bench_peers: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# vkrt side: one subprocess per repeat
# ---------------------------------------------------------------------------------------
def run_vkrt(python: str, model: str, prompt_tokens: int, gen_tokens: int,
             env: dict[str, str], timeout: float) -> dict:
    """One `vkrt bench --json` run; returns its JSON (prefill_tok_s, decode_tok_s, ...)."""
    cmd = [python, "-m", "vkrt.cli", "bench", "--json", "--model", model,
           "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens), "--repeat", "1"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"vkrt bench timed out after {timeout:.0f} s: {shlex.join(cmd)}") from exc
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BenchError(f"vkrt bench exited {proc.returncode}: {shlex.join(cmd)}\n{tail}")
    data = _parse_json_output(proc.stdout)
    if data is None:
        raise BenchError(f"vkrt bench printed no JSON: {proc.stdout[-500:]!r}")
    # Tolerate a list of runs (take the median) or nested numbers.
    runs = data.get("runs") if isinstance(data.get("runs"), list) else None
    for key in ("prefill_tok_s", "decode_tok_s"):
        if data.get(key) is None and runs:
            vals = [float(r[key]) for r in runs if isinstance(r, dict) and r.get(key) is not None]
            data[key] = statistics.median(vals) if vals else None
        if data.get(key) is None:
            raise BenchError(f"vkrt bench JSON has no {key!r} (keys: {sorted(data)})")
    data["_wall_s"] = wall
    return data


def _parse_json_output(text: str) -> dict | None:
    text = text.strip()
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else None
    except ValueError:
        pass
    lines = text.splitlines()  # JSON after some other output: try from each '{' line, last first
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("{"):
            try:
                obj = json.loads("\n".join(lines[i:]))
                if isinstance(obj, dict):
                    return obj
            except ValueError:
                continue
    return None


# ---------------------------------------------------------------------------------------
# peer side: one long-lived llama.cpp process (tools/peer_llamacpp.py --serve)
# ---------------------------------------------------------------------------------------
class Peer:
    def __init__(self, python: str, model: str, prompt_tokens: int, gen_tokens: int,
                 env: dict[str, str], threads: int, verbose: bool, cpu: bool = False) -> None:
        cmd = [python, str(PEER_RUNNER), "--serve", "--model", model,
               "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens)]
        if cpu:
            cmd += ["--n-gpu-layers", "0"]
        if threads:
            cmd += ["--threads", str(threads)]
        if verbose:
            cmd.append("--verbose")
        self.cmd = cmd
        self.messages: queue.Queue = queue.Queue()
        self.stderr_tail: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PEER_JSON "):
                try:
                    self.messages.put(json.loads(line[len("PEER_JSON "):]))
                except ValueError:
                    self.stderr_tail.append(f"(bad message) {line.rstrip()}")
        self.messages.put(None)  # EOF

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.stderr_tail = (self.stderr_tail + [line])[-40:]
            if line.startswith(("peer:", "llama.cpp:")):
                print(f"  {line}", file=sys.stderr, flush=True)

    def _wait(self, what: str, timeout: float) -> dict:
        try:
            msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            self.close(kill=True)
            raise BenchError(f"llama.cpp peer: no {what} within {timeout:.0f} s (see --timeout)") from None
        if msg is None:
            rc = self.proc.wait(timeout=30)
            tail = "\n".join(self.stderr_tail[-15:])
            raise BenchError(f"llama.cpp peer exited ({rc}) before {what}: {shlex.join(self.cmd)}\n{tail}")
        if msg.get("event") == "error":
            raise BenchError(f"llama.cpp peer: {msg.get('error')}")
        return msg

    def ready(self, timeout: float) -> dict:
        return self._wait("ready (load + warm-up)", timeout)

    def run(self, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._wait("result", timeout)

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is not None:
            return
        if not kill:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
                return
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------------------
def default_model(python: str) -> str:
    code = "from vkrt.loader.pull import ensure_default_model; print(ensure_default_model())"
    proc = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError("could not locate the default model with vkrt's ensure_default_model(); "
                         f"pass --model PATH\n{proc.stderr.strip()[-800:]}")
    return proc.stdout.strip().splitlines()[-1]


def named_model(python: str, name: str) -> str:
    """The GGUF of a model `vkrt pull` knows by name, resolved as `vkrt generate --model NAME` does."""
    code = f"from vkrt.loader.pull import resolve_model; print(resolve_model({name!r})[0])"
    proc = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"--model {name}: not a file and not a model vkrt can pull "
                         f"(see `vkrt pull --list`)\n{proc.stderr.strip()[-800:]}")
    return proc.stdout.strip().splitlines()[-1]


def check_peer_python(path: str) -> str:
    p = Path(path)
    if not p.is_absolute():
        p = ROOT / p  # relative paths are taken from the repository root
    if not p.exists():
        raise BenchError(f"peer interpreter {path} not found. Create the peer venv (llama.cpp "
                         f"with Vulkan, kept apart from vkrt's) from the repository root:\n"
                         f"    {PEER_SETUP}\nor pass --peer-python PATH.")
    proc = subprocess.run([str(p), "-c", "import cyllama.llama.llama_cpp"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"{path} cannot import cyllama: install it with `{p} -m pip install "
                         f"cyllama-vulkan`\n{proc.stderr.strip()[-500:]}")
    return str(p)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _device_name(d) -> str | None:
    if isinstance(d, dict):
        return d.get("name") or d.get("device") or json.dumps(d)
    return d


def _same_device(a: str | None, b: str | None) -> bool | None:
    if not a or not b:
        return None
    a, b = a.lower(), b.lower()
    return a in b or b in a or a.split(" (")[0] == b.split(" (")[0]


def summarize(args, model: str, peer_info: dict | None, pairs: list[dict], load_start: float | None) -> dict:
    peer_runs = [p["peer"] for p in pairs if p.get("peer")]
    vkrt_runs = [p["vkrt"] for p in pairs if p.get("vkrt")]
    out: dict = {
        "model": model, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "repeats": args.repeats, "order": "interleaved: peer, vkrt, peer, vkrt, ...",
        "device_index": args.device_index, "peer_backend": args.peer_backend,
    }
    for key in ("prefill_tok_s", "decode_tok_s"):
        out[f"peer_{key}"] = _median([r.get(key) for r in peer_runs])
        out[f"vkrt_{key}"] = _median([r.get(key) for r in vkrt_runs])
        ratios = [p["vkrt"][key] / p["peer"][key] for p in pairs
                  if p.get("vkrt") and p.get("peer") and p["peer"].get(key) and p["vkrt"].get(key)]
        out[f"ratio_{key}"] = _median(ratios)
        out[f"ratios_{key}"] = ratios
    if peer_info is not None:
        out["peer"] = {k: v for k, v in peer_info.items() if k != "event"}
        out["peer"]["runs"] = [{k: v for k, v in r.items() if k != "event"} for r in peer_runs]
    if vkrt_runs:
        last = vkrt_runs[-1]
        out["vkrt"] = {k: last.get(k) for k in ("model", "quant", "device", "backend", "access_path", "per_step",
                                                 "resident_bytes", "load_s", "first_token_s")}
        out["vkrt"]["runs"] = vkrt_runs
    out["loadavg_1m"] = {"start": load_start, "end": _loadavg()}
    out["cpu_count"] = os.cpu_count()
    pdev = peer_info.get("device") if peer_info else None
    vdev = _device_name(vkrt_runs[-1].get("device")) if vkrt_runs else None
    out["same_device"] = _same_device(pdev, vdev)
    return out


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _compact(d) -> str:
    if not isinstance(d, dict):
        return str(d)
    return ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}"
                     for k, v in ((k, round(v, 2) if isinstance(v, float) else v) for k, v in d.items()))


def _fmt(x, nd=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{nd}f}{suffix}"


def markdown(s: dict) -> str:
    peer, vk = s.get("peer") or {}, s.get("vkrt") or {}
    lines = [
        f"model `{Path(s['model']).name}`, pp {s['prompt_tokens']} / tg {s['gen_tokens']}, "
        f"{s['repeats']} interleaved repeat(s), medians",
        "",
        f"| | llama.cpp {'CPU' if s.get('peer_backend') == 'cpu' else 'Vulkan'} tok/s | vkrt tok/s | vkrt / llama.cpp |",
        "|---|---|---|---|",
        f"| prefill (pp{s['prompt_tokens']}) | {_fmt(s['peer_prefill_tok_s'])} | "
        f"{_fmt(s['vkrt_prefill_tok_s'])} | {_fmt(s['ratio_prefill_tok_s'], suffix='x')} |",
        f"| decode (tg{s['gen_tokens']}) | {_fmt(s['peer_decode_tok_s'])} | "
        f"{_fmt(s['vkrt_decode_tok_s'])} | {_fmt(s['ratio_decode_tok_s'], suffix='x')} |",
        "",
    ]
    if peer:
        lines.append(f"- llama.cpp {peer.get('llama_cpp_version')} (cyllama-vulkan "
                     f"{peer.get('cyllama_version')}): device `{peer.get('device')}` "
                     f"({peer.get('device_selection')}), {peer.get('offload')}, "
                     f"flash attention {peer.get('flash_attn')}, CPU threads "
                     f"{peer.get('n_threads')}/{peer.get('n_threads_batch')} ({peer.get('threads_note')}), "
                     f"warm-up (pipeline compile) {_fmt(peer.get('warmup_s'), 1)} s, load "
                     f"{_fmt(peer.get('load_s'), 1)} s")
        runs = peer.get("runs") or []
        if runs:
            lines.append("- llama.cpp per repeat: " + ", ".join(
                f"pp {_fmt(r.get('prefill_tok_s'))} / tg {_fmt(r.get('decode_tok_s'))}" for r in runs))
    if vk:
        lines.append(f"- vkrt: device `{_device_name(vk.get('device'))}`, backend {vk.get('backend')}, "
                     f"quant {vk.get('quant')}, load {_fmt(vk.get('load_s'), 1)} s, first token "
                     f"{_fmt(vk.get('first_token_s'), 2)} s, per decode step {_compact(vk.get('per_step'))}")
        runs = vk.get("runs") or []
        lines.append("- vkrt per repeat: " + ", ".join(
            f"pp {_fmt(r.get('prefill_tok_s'))} / tg {_fmt(r.get('decode_tok_s'))}" for r in runs))
    cpu_peer = s.get("peer_backend") == "cpu"  # on the host's cores by design, offloading nothing
    if s.get("same_device") is False and not cpu_peer:
        lines.append("- WARNING: the two runtimes report different devices; pin both with --device-index")
    if peer and peer.get("offload_complete") is not True and not cpu_peer:
        lines.append(f"- WARNING: llama.cpp did not offload every layer ({peer.get('offload')})")
    if len(peer.get("devices") or []) > 1 and s.get("device_index") is None:
        lines.append(f"- WARNING: llama.cpp spread the model over {len(peer['devices'])} devices "
                     f"({', '.join(peer['devices'])}); pin both runtimes to one with --device-index")
    load, ncpu = s.get("loadavg_1m") or {}, s.get("cpu_count") or 0
    busiest = max([v for v in (load.get("start"), load.get("end")) if v is not None], default=None)
    lines.append(f"- machine: {ncpu} CPUs, 1-min load average {load.get('start')} at start, "
                 f"{load.get('end')} at end")
    if busiest is not None and ncpu and busiest > ncpu:
        lines.append("- WARNING: the machine was busy with other work (load average above the CPU "
                     "count); absolute numbers are noise, the paired ratios less so")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", help="GGUF file or a pulled model name such as gemma-3-270m "
                                    "(default: vkrt's default model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=("peer", "vkrt", "both"), default="both")
    ap.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds per run (peer load + warm-up counts as one run); default 1800")
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON,
                    help=f"interpreter of the peer venv (default {DEFAULT_PEER_PYTHON}; "
                         f"create it with: {PEER_SETUP})")
    ap.add_argument("--vkrt-python", default=sys.executable, help="interpreter with vkrt (default: this one)")
    ap.add_argument("--device-index", type=int, default=None,
                    help="pin both runtimes to Vulkan physical device N (default: each runtime's own choice)")
    ap.add_argument("--peer-threads", type=int, default=0, help="llama.cpp CPU threads (default: its own)")
    ap.add_argument("--peer-backend", choices=("vulkan", "cpu"), default="vulkan",
                    help="llama.cpp's Vulkan backend (default) or its CPU backend (no device, no offload)")
    ap.add_argument("--verbose", action="store_true", help="echo llama.cpp's log")
    args = ap.parse_args(argv)

    load_start = _loadavg()
    want_peer, want_vkrt = args.only in ("peer", "both"), args.only in ("vkrt", "both")
    try:
        peer_python = check_peer_python(args.peer_python) if want_peer else None
        model = args.model or default_model(args.vkrt_python)
        if not Path(model).is_file() and not model.endswith(".gguf"):
            model = named_model(args.vkrt_python, model)
        if not Path(model).is_file():
            raise BenchError(f"model file not found: {model}")
        model = str(Path(model).resolve())

        base_env = dict(os.environ)
        peer_env, vkrt_env = dict(base_env), dict(base_env)
        if args.device_index is not None:
            peer_env["GGML_VK_VISIBLE_DEVICES"] = str(args.device_index)
            vkrt_env["VKRT_DEVICE"] = str(args.device_index)
        if args.peer_backend == "cpu":
            peer_env["GGML_VK_VISIBLE_DEVICES"] = ""  # no Vulkan device: llama.cpp's CPU backend

        log(f"model {model}, pp {args.prompt_tokens} / tg {args.gen_tokens}, {args.repeats} repeat(s), "
            f"only={args.only}")
        peer = peer_info = None
        pairs: list[dict] = []
        try:
            if peer_python is not None:
                log(f"starting llama.cpp ({args.peer_backend}) peer: load + untimed warm-up ...")
                t0 = time.perf_counter()
                peer = Peer(peer_python, model, args.prompt_tokens, args.gen_tokens, peer_env,
                            args.peer_threads, args.verbose, cpu=args.peer_backend == "cpu")
                peer_info = peer.ready(args.timeout)
                log(f"peer ready after {time.perf_counter() - t0:.1f} s on {peer_info.get('device')!r} "
                    f"({peer_info.get('offload')}); warm-up {peer_info.get('warmup_s', 0):.1f} s")
            for i in range(args.repeats):
                pair: dict = {}
                if peer is not None:
                    log(f"repeat {i + 1}/{args.repeats}: llama.cpp ...")
                    r = peer.run(args.timeout)
                    log(f"  llama.cpp: prefill {_fmt(r.get('prefill_tok_s'))} tok/s, "
                        f"decode {_fmt(r.get('decode_tok_s'))} tok/s")
                    pair["peer"] = r
                if want_vkrt:
                    log(f"repeat {i + 1}/{args.repeats}: vkrt ...")
                    r = run_vkrt(args.vkrt_python, model, args.prompt_tokens, args.gen_tokens,
                                 vkrt_env, args.timeout)
                    log(f"  vkrt: prefill {_fmt(r.get('prefill_tok_s'))} tok/s, "
                        f"decode {_fmt(r.get('decode_tok_s'))} tok/s")
                    pair["vkrt"] = r
                pairs.append(pair)
        finally:
            if peer is not None:
                peer.close()
    except BenchError as exc:
        print(f"bench_peers: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

    summary = summarize(args, model, peer_info, pairs, load_start)
    table = markdown(summary)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(summary, indent=2))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
