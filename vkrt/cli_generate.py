"""`vkrt generate`, `chat`, `bench` and `serve`: the commands that load a model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vkrt.backend import BACKEND_NAMES
from vkrt.core.kv_format import KV_DTYPES
from vkrt.errors import VkrtError

if TYPE_CHECKING:
    from vkrt.server.reasoning import ThinkTags

DEFAULT_MAX_TOKENS = 128
DEFAULT_MAX_MODEL_LEN = 4096  # generate/chat/bench: min(model's context, this) unless given
# Sampling defaults follow llama.cpp's, which users of `llama-cli` expect.
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_MIN_P = 0.8, 40, 0.95, 0.05


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None


def _model_args(p: argparse.ArgumentParser, default_len: str = "min(model, 4096)", several: bool = False) -> None:
    help_text = ("GGUF file, Hugging Face model directory, or a pulled model's name (`vkrt pull --list`; "
                 "default: SmolLM2-135M-Instruct, pulled on first use)")
    if several:
        p.add_argument("--model", "-m", action="append", default=None,
                       help=help_text + "; repeat it to serve several models, each loaded on first use")
    else:
        p.add_argument("--model", "-m", default=None, help=help_text)
    p.add_argument("--device", choices=BACKEND_NAMES, default="auto",
                   help="vulkan, reference (numpy) or auto: Vulkan if usable (default)")
    p.add_argument("--max-model-len", type=int, default=None, help=f"context length (default: {default_len})")
    p.add_argument("--kv-cache-memory", type=_parse_bytes, default=None, help="KV cache size, e.g. 256M")
    p.add_argument("--state-memory", type=_parse_bytes, default=None,
                   help="recurrent-state memory of hybrid models, e.g. 1G (default 512M; caps concurrent sequences)")
    p.add_argument("--state-snapshot-memory", type=_parse_bytes, default=None,
                   help="hybrid models: memory for the recurrent-state snapshots prefix caching keeps at cached "
                        "block boundaries, e.g. 1G (default 256M; 0: prefix caching off for them)")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="f16",
                   help="KV cache format (default f16: half the memory of f32; q8_0: GGUF 8-bit blocks, "
                        "~0.53x of f16, needs head_dim a multiple of 32; f32 for exactness checks)")
    p.add_argument("--no-replay", action="store_true",
                   help="run every decode step eagerly instead of replaying recorded steps")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        "(+ prompt_lookup_max / prompt_lookup_min, default 4 / 2), or a draft model with the same "
                        'tokenizer: \'{"model": PATH_OR_NAME, "num_speculative_tokens": 3}\', or the model\'s own MTP '
                        'head: \'{"method": "mtp", "num_speculative_tokens": 2}\'; greedy output is unchanged')
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="P",
                   help="split the model's layers over P stage processes, each on its own Vulkan device, for a "
                        "model larger than one device (default 1)")
    p.add_argument("--pipeline-devices", type=lambda text: [d for d in text.split(",") if d], default=[],
                   metavar="SEL[,SEL...]",
                   help="the VKRT_DEVICE selector of each pipeline stage, one per stage (default: each stage takes "
                        "VKRT_DEVICE or the best device)")
    p.add_argument("--pipeline-micro-batches", type=int, default=None, metavar="M",
                   help="cut a step of several sequences into up to M micro-batches so the stages work at once "
                        "(default: one per stage; 1: stages one after another)")
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="pipeline stages as local processes (mp, default) or Ray actors spread over a Ray "
                        "cluster's nodes (ray; joins RAY_ADDRESS or --ray-address, else starts a local instance)")
    # default None, not False: without the flag VKRT_CHECK_TENSORS decides
    p.add_argument("--check-tensors", action="store_true", default=None,
                   help="scan every weight for NaN / Inf while loading and refuse the file naming the tensor "
                        "(like llama.cpp's --check-tensors; reads every float weight and block scale once)")


def _speculative_config(text: str) -> Any:
    from vkrt.engine.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except VkrtError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None


def _kv_events_config(text: str) -> Any:
    from vkrt.engine.kv_events import KVEventsConfig

    try:
        return KVEventsConfig.parse(text)
    except VkrtError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events-config: ")) from None


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate")
    p.add_argument("--temperature", "--temp", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="0 = off")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--min-p", type=float, default=DEFAULT_MIN_P)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _params(args: argparse.Namespace, seed: int | None) -> Any:
    from vkrt.engine.config import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _load(args: argparse.Namespace, max_num_seqs: int = 1, **overrides: Any) -> Any:
    from vkrt.engine.llm import LLM

    return LLM(args.model or "", device=args.device, max_num_seqs=max_num_seqs,
               max_model_len=args.max_model_len, default_max_model_len=DEFAULT_MAX_MODEL_LEN,
               kv_cache_memory=args.kv_cache_memory, kv_dtype=args.kv_cache_dtype,
               state_memory=args.state_memory, state_snapshot_memory=args.state_snapshot_memory,
               enable_replay=not args.no_replay, speculative=args.speculative_config,
               check_tensors=args.check_tensors, pipeline_parallel_size=args.pipeline_parallel_size,
               pipeline_devices=tuple(args.pipeline_devices), pipeline_micro_batches=args.pipeline_micro_batches,
               distributed_executor_backend=args.distributed_executor_backend, **overrides)


def _prompt_of(args: argparse.Namespace, llm: Any) -> tuple[Any, str | None]:
    """(the prompt to generate from, the rendered chat text or None when not a chat)."""
    if not args.chat:
        return args.prompt, None
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    from vkrt.engine.prompts import render_chat

    text, ids = render_chat(llm.tokenizer, messages)
    return ids, text


def _stats_line(run: dict[str, Any]) -> str:
    c = run["decode_counters_per_step"]
    return (f"load {run['load_seconds']:.2f} s | prefill {run['prompt_tokens']} tok "
            f"{run['prefill_tok_s']:.1f} tok/s | decode {run['generated_tokens']} tok {run['decode_tok_s']:.2f} tok/s"
            f" | per decode step: {c.get('dispatches', 0):.0f} dispatches, {c.get('submits', 0):.0f} submits, "
            f"{c.get('fence_waits', 0):.0f} fence waits, {c.get('drains', 0):.0f} drains")


@dataclass(frozen=True)
class ChatReading:
    """How `vkrt chat` shows a reply whose template thinks: the thought (harmony's analysis
    channel, or the text inside think tags) on stderr, the answer on stdout, split as the
    server splits `reasoning_content` off."""

    tags: ThinkTags | None  # None: harmony's channels
    inside: bool = False  # the prompt leaves the model inside an open thought

    def params(self, params: Any, tokenizer: Any) -> Any:
        """`params` that keep the markers the reply is read by in its text."""
        from vkrt.server import harmony
        from vkrt.server.markers import keep_markers, special_ids

        if self.tags is None:
            return harmony.sampling_params(params, tokenizer)
        return keep_markers(params, special_ids(tokenizer, [self.tags.open, self.tags.close]))

    def reader(self) -> Callable[[str, bool], tuple[str, str]]:
        """A fresh reader of one streamed reply: each piece to its (reasoning, answer) text."""
        from vkrt.server.harmony import HarmonyParser
        from vkrt.server.reasoning import ReasoningSplitter

        if self.tags is None:
            channels = HarmonyParser()

            def by_channel(text: str, final: bool) -> tuple[str, str]:
                read = channels.feed(text, final=final)
                return read.reasoning, read.content
            return by_channel
        return ReasoningSplitter(self.inside, self.tags).feed


def _chat_reading(args: argparse.Namespace, llm: Any, prompt_text: str | None) -> ChatReading | None:
    """How a chat's reply is shown: by harmony's channels (gpt-oss) or with the thought of the
    think tags its template knows split off; None (not a chat, or no thinking template): as written."""
    from vkrt.server.harmony import template_speaks_harmony
    from vkrt.server.reasoning import starts_inside, template_tags

    template = llm.tokenizer.chat_template if llm.tokenizer else None
    if not args.chat:
        return None
    if template_speaks_harmony(template):
        return ChatReading(None)
    tags = template_tags(template)
    return None if tags is None else ChatReading(tags, starts_inside(prompt_text, tags))


def _run_once(llm: Any, prompt: Any, params: Any, stream: bool, reading: ChatReading | None = None) -> dict[str, Any]:
    """One generation, streamed to stdout (a thinking chat's thought to stderr: `ChatReading`)."""
    start = time.perf_counter()
    first = None
    final = None
    pieces: list[str] = []
    ids: list[int] = []
    read = reading.reader() if reading is not None else None
    for out in llm.generate_stream(prompt, params):  # deltas: each holds what its step added
        if first is None and out.token_ids:
            first = time.perf_counter() - start
        if stream and read is not None:
            reasoning, content = read(out.text, out.finished)
            sys.stderr.write(reasoning)
            sys.stdout.write(content)
            sys.stdout.flush()
        elif stream:
            sys.stdout.write(out.text)
            sys.stdout.flush()
        pieces.append(out.text)
        ids += out.token_ids
        final = out
    if stream:
        sys.stdout.write("\n")
    assert final is not None
    if final.finish_reason == "error":
        raise VkrtError(final.outputs[0].error or "the generation failed")
    return {"text": "".join(pieces), "ids": ids, "prompt_ids": final.prompt_token_ids,
            "finish_reason": final.finish_reason, "first_token_s": first,
            "seconds": time.perf_counter() - start}


def _measure(llm: Any, prompt: Any, params: Any, stream: bool, reading: ChatReading | None = None) -> dict[str, Any]:
    """One generation with the engine's per-phase stats taken around it."""
    run = _run_once(llm, prompt, params, stream, reading)
    stats = llm.stats()
    run.update(load_seconds=stats["load_seconds"], prompt_tokens=len(run["prompt_ids"]),
               generated_tokens=len(run["ids"]),
               prefill_tok_s=stats["prefill_tokens_per_second"], decode_tok_s=stats["decode_tokens_per_second"],
               decode_counters_per_step=stats["decode_counters_per_step"],
               decode_counters_max=stats["decode_counters_max"],
               decode_step_s=stats["decode_seconds"] / stats["decode_steps"] if stats["decode_steps"] else 0.0)
    if "speculative" in stats:
        run["speculative"] = stats["speculative"]
    return run


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise VkrtError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    llm = _load(args)
    prompt, prompt_text = _prompt_of(args, llm)
    reading = _chat_reading(args, llm, prompt_text)
    runs = []
    for i in range(max(1, args.repeat)):
        seed = args.seed if args.seed is not None else random.randrange(1 << 31)
        llm.engine.reset_totals()
        params = _params(args, seed)
        if reading is not None:
            params = reading.params(params, llm.tokenizer)
        run = _measure(llm, prompt, params, stream=not args.json, reading=reading)
        run["seed"] = seed
        runs.append(run)
        if args.stats and not args.json:
            print(f"[run {i + 1}] {_stats_line(run)}", file=sys.stderr)
    if args.json:
        backend = llm.engine.model.backend
        print(json.dumps({"model": str(args.model or "default"), "device": backend.name,
                          "runs": runs, "memory": backend.memory_stats()}, indent=2))
    return 0


def _prompt_lengths(text: str) -> list[int]:
    """`-p 128` or `-p 128,2048`: prompt lengths in tokens, each at least 1."""
    try:
        lengths = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count or a comma-separated list of them: {text!r}") from None
    if min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"prompt lengths must be >= 1, got {text!r}")
    if len(set(lengths)) != len(lengths):
        raise argparse.ArgumentTypeError(f"a prompt length is given twice: {text!r}")
    return lengths


def cmd_bench(args: argparse.Namespace) -> int:
    from vkrt.engine.config import SamplingParams

    lengths = args.prompt_tokens
    guided = _bench_schema(args.json_schema)  # before the load a bad file would waste
    start = time.perf_counter()
    llm = _load(args, enable_prefix_caching=False)  # repeats must recompute the prompt
    load_s = time.perf_counter() - start
    if args.prompt_file:  # a real text (say, one a speculating run can draw on): its tokens
        if llm.tokenizer is None:
            raise VkrtError("--prompt-file needs the model's tokenizer; this model has none")
        try:
            text = open(args.prompt_file, encoding="utf-8").read()
        except OSError as exc:
            raise VkrtError(f"--prompt-file: cannot read {args.prompt_file}: {exc.strerror}") from None
        file_ids = list(llm.tokenizer.encode(text))
        lengths = [len(file_ids)]
        prompts = {lengths[0]: file_ids}
    else:
        vocab = llm.model_config.vocab_size
        rng = random.Random(0)  # each length's prompt is a prefix of one fixed stream of ids
        ids = [rng.randrange(100, min(vocab, 30000)) for _ in range(max(lengths))]
        prompts = {length: ids[:length] for length in lengths}
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True, guided_decoding=guided)
    backend = llm.engine.model.backend
    profiling = False
    if args.profile:
        profiling = backend.enable_profiling(True)
        if not profiling:
            print(f"--profile: the {backend.name} backend cannot time kernels on this device; "
                  "no profile", file=sys.stderr)
        else:
            llm.engine.stats_listeners.append(lambda stats: backend.profile_commit(_step_phase(stats)))
    # Several lengths run in turn within each repeat, so each round measures them all on the
    # machine as it is then: their ratios hold where absolute speed drifts between runs. An
    # untimed run first (as llama-bench's warm-up) creates the pipelines and records the decode
    # steps, which would otherwise slow the first round alone (~40% of a 128-token prefill).
    # With speculation each round also decodes the prompt plainly (the per-request opt-out), in
    # the same engine and alternating which goes first: its peer in one run, so the ratio holds
    # where this machine's speed drifts between commands.
    plain_params = dataclasses.replace(params, speculative=False) if llm.config.speculative else None
    load_before = host_load()
    if not args.no_warmup:
        llm.engine.reset_totals()
        _run_once(llm, prompts[lengths[0]], params, stream=False)
        if plain_params is not None:  # a copy accepted in full never ran a plain decode step
            _run_once(llm, prompts[lengths[0]], plain_params, stream=False)
        backend.profile_report(reset=True)
    results: dict[int, list[dict[str, Any]]] = {length: [] for length in lengths}
    plain: dict[int, list[dict[str, Any]]] = {length: [] for length in lengths}
    for round_ in range(max(1, args.repeat)):
        for length in lengths:
            if plain_params is not None and round_ % 2 == 0:
                plain[length].append(_measure_quietly(llm, prompts[length], plain_params))
            llm.engine.reset_totals()
            backend.profile_report(reset=True)
            run = _measure(llm, prompts[length], params, stream=False)
            if profiling:
                run["profile"] = backend.profile_report(reset=True)
            results[length].append(run)
            if plain_params is not None and round_ % 2 == 1:
                plain[length].append(_measure_quietly(llm, prompts[length], plain_params))
    load = {"before": load_before, "after": host_load()}
    reports = [_bench_report(args, llm, length, results[length], load_s) | {"host_load": load}
               for length in lengths]
    if plain_params is not None:
        for r, length in zip(reports, lengths, strict=True):
            r["plain"] = {"decode_tok_s": max(run["decode_tok_s"] for run in plain[length]),
                          "runs": [{k: run[k] for k in ("decode_tok_s", "seconds", "generated_tokens")}
                                   | {"num_drafts": run.get("speculative", {}).get("num_drafts", 0)}
                                   for run in plain[length]]}
            ratios = _ratios(plain[length], results[length])
            r["vs_plain"] = {"decode": ratios["decode"], "decode_median": ratios["decode_median"],
                             "same_ids": all(a["ids"] == b["ids"] for a, b in zip(plain[length], results[length],
                                                                                 strict=True))}
    report = reports[0]
    if len(lengths) > 1:
        common = ("model", "quant", "device", "backend", "access_path", "gen_tokens", "kv_cache_dtype",
                  "kv_bytes_per_token", "load_s", "warmup", "host_load")
        report = {key: reports[0][key] for key in common}
        report["prompts"] = [{k: v for k, v in r.items() if k not in common} for r in reports]
        report["vs_first"] = [_ratios(results[lengths[0]], results[length]) | {"prompt_tokens": length}
                              for length in lengths[1:]]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{reports[0]['device']} ({reports[0]['backend']}), model {reports[0]['model']}"
          + ("" if load_before is None else f"; host load {load_before:.2f} before, {load['after']:.2f} after"))
    for r in reports:
        per_step = r["per_step"]
        print(f"prefill {r['prompt_tokens']} tok: {r['prefill_tok_s']:.1f} tok/s | decode {args.gen_tokens} tok: "
              f"{r['decode_tok_s']:.2f} tok/s | load {load_s:.2f} s")
        if "speculative" in r:
            spec = r["speculative"]
            print(f"speculative: {spec['num_drafts']} drafts, acceptance {spec['acceptance_rate']:.2f}, "
                  f"mean accepted length {spec['mean_accepted_length']:.2f}")
        if "vs_plain" in r:
            vs = r["vs_plain"]
            print(f"plain decode (speculation off, same engine): {r['plain']['decode_tok_s']:.2f} tok/s; "
                  f"speculative vs plain, median of {len(vs['decode'])} rounds: {vs['decode_median']:.2f}x "
                  f"(rounds: {', '.join(f'{v:.2f}' for v in vs['decode'])}); "
                  + ("ids identical" if vs["same_ids"] else "ids DIFFER from plain decoding"))
        print(f"per decode step: {per_step}")
        gpu = per_step["gpu_ms"]
        print(f"decode step {per_step['step_ms']:.2f} ms: device (timestamps) "
              f"{'n/a' if gpu is None else f'{gpu:.2f} ms'}, host {per_step['host_ms']:.2f} ms")
        for phase, table in (r.get("profile") or {}).get("phases", {}).items():
            print(_profile_text(phase, table))
    for ratio in report.get("vs_first", []):
        print(f"prompt {ratio['prompt_tokens']} vs {lengths[0]}, median of {len(ratio['prefill'])} rounds: "
              f"prefill {ratio['prefill_median']:.2f}x, decode {ratio['decode_median']:.2f}x "
              f"(rounds: prefill {', '.join(f'{v:.2f}' for v in ratio['prefill'])}; "
              f"decode {', '.join(f'{v:.2f}' for v in ratio['decode'])})")
    return 0


def host_load() -> float | None:
    """The host's 1-minute load average (None where the OS has none): a bench run beside other
    work on a CPU device is not comparable with one on an idle machine, so the report says
    (bench, tools/spec_ceiling.py)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _measure_quietly(llm: Any, prompt: Any, params: Any) -> dict[str, Any]:
    """_measure with the kernel profile (if on) of this run dropped: bench's peer runs."""
    llm.engine.reset_totals()
    run = _measure(llm, prompt, params, stream=False)
    llm.engine.model.backend.profile_report(reset=True)
    return run


def _bench_schema(path: str | None) -> Any:
    """--json-schema: the generation constrained to the JSON schema in that file (None: free)."""
    if path is None:
        return None
    from vkrt.engine.guided import GuidedDecoding

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise VkrtError(f"--json-schema: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise VkrtError(f"--json-schema: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(schema, dict):
        raise VkrtError(f"--json-schema: {path} must hold a JSON schema object")
    return GuidedDecoding("json", schema)


def _ratios(first: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Tok/s of `other`'s runs over `first`'s, round by round, and their medians."""
    out: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        key = f"{phase}_tok_s"
        values = [b[key] / a[key] if a[key] else 0.0 for a, b in zip(first, other, strict=True)]
        out[phase], out[f"{phase}_median"] = values, statistics.median(values)
    return out


def _bench_report(args: argparse.Namespace, llm: Any, prompt_tokens: int, results: list[dict[str, Any]],
                  load_s: float) -> dict[str, Any]:
    """One prompt length's report: its best run (by decode tok/s) and every run's speeds."""
    backend = llm.engine.model.backend
    best = max(results, key=lambda r: r["decode_tok_s"])
    per_step = dict(best["decode_counters_per_step"])
    # Host time: the decode step's wall time minus what it spent blocked on the device. (A
    # verify step makes several tokens: a step's time is not the time per token.)
    per_step["step_ms"] = 1000 * best["decode_step_s"]
    per_step["device_wait_ms"] = per_step.get("wait_us", 0) / 1000
    per_step["host_ms"] = max(0.0, per_step["step_ms"] - per_step["device_wait_ms"])
    # Device time from timestamp queries around each submit; null where the device has none.
    per_step["gpu_ms"] = per_step.get("gpu_us", 0) / 1000 if backend.supports_gpu_timing else None
    desc = backend.describe()
    device = desc.get("device", {}).get("name", backend.name) if isinstance(desc.get("device"), dict) else backend.name
    memory = backend.memory_stats()
    report = {
        "model": str(args.model or "default"), "quant": llm.engine.model.file_type,
        "device": device, "backend": backend.name,
        "access_path": desc.get("device", {}).get("access_path") if isinstance(desc.get("device"), dict) else None,
        "prompt_tokens": prompt_tokens, "gen_tokens": args.gen_tokens,
        "prefill_tok_s": best["prefill_tok_s"], "decode_tok_s": best["decode_tok_s"],
        "runs": [{k: r[k] for k in ("prefill_tok_s", "decode_tok_s", "first_token_s", "seconds", "generated_tokens")}
                 for r in results],
        "per_step": per_step, "per_step_max": best["decode_counters_max"],
        "resident_bytes": memory.get("reserved_bytes"), "memory": memory,
        "kv_cache_dtype": llm.config.kv_dtype,
        "kv_bytes_per_token": llm.engine.model.kv_bytes_per_block(1, llm.config.kv_dtype),
        "load_s": load_s, "first_token_s": best["first_token_s"], "warmup": not args.no_warmup,
    }
    if "speculative" in best:  # the best run's proposals: acceptance rate, mean accepted length
        report["speculative"] = best["speculative"]
    if args.profile:
        # Per-kernel device time of the best run, by phase; profiling adds a timestamp per
        # dispatch, so the tok/s of a profiled run are a little lower than unprofiled.
        report["profile"] = best.get("profile")
    return report


def _step_phase(stats: Any) -> str:
    """An engine step is "decode" when every sequence ran one token and none was a prompt's last,
    "verify" when no prompt finished and some sequence ran speculative proposals, else "prefill"."""
    step = stats.step
    if stats.num_prompt_tokens == 0 and step.num_tokens == step.num_seqs:
        return "decode"
    return "verify" if stats.num_prompt_tokens == 0 and stats.spec.num_drafts else "prefill"


def _profile_text(phase: str, table: dict[str, Any], top: int = 10) -> str:
    per_step = table["gpu_ms_per_step"]
    lines = [f"{phase}: {table['steps']} steps, {table['submits']} submits, device {table['gpu_ms']:.1f} ms"
             + (f" ({per_step:.2f} ms/step)" if per_step is not None else "")
             + f", attributed to kernels {table['attributed_ms']:.1f} ms",
             f"  {'kernel':<40} {'calls':>7} {'total ms':>10} {'mean us':>10} {'share':>7}"]
    for name, k in list(table["kernels"].items())[:top]:
        mean = "" if k["mean_us"] is None else f"{k['mean_us']:.1f}"
        lines.append(f"  {name:<40} {k['calls']:>7} {k['total_ms']:>10.2f} {mean:>10} {100 * k['share']:>6.1f}%")
    return "\n".join(lines)


def _server_for(args: argparse.Namespace) -> Callable[[Any], None]:
    """What serves the config: one engine in this process, or --data-parallel-size replicas on Ray."""
    from vkrt.errors import VkrtError
    from vkrt.server import serve

    ray_stages = args.distributed_executor_backend == "ray"  # --ray-address is then where the stages go
    if args.data_parallel_backend is None and args.data_parallel_size == 1 and (args.ray_address is None or ray_stages):
        return serve
    if args.data_parallel_backend != "ray":
        raise VkrtError("--data-parallel-size and --ray-address need --data-parallel-backend ray (the only one), "
                        "or --ray-address --distributed-executor-backend ray for pipeline stages on Ray")
    try:
        from vkrt.serve_ray.launch import serve_on_ray
    except ImportError as exc:
        raise VkrtError(f"--data-parallel-backend ray needs Ray Serve: pip install 'vkrt[ray]' ({exc})") from exc
    return lambda config: serve_on_ray(config, args.data_parallel_size, args.ray_address,
                                       tuple(args.data_parallel_devices))


def cmd_serve(args: argparse.Namespace) -> int:
    from vkrt.server.config import ServerConfig, resolve_api_key

    several = isinstance(args.model, list) or args.models_dir is not None
    config = ServerConfig(model=None if several else args.model, device=args.device, host=args.host, port=args.port,
                       api_key=resolve_api_key(args.api_key, args.api_key_file), public_metrics=args.public_metrics,
                       served_model_name=args.served_model_name, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=args.kv_cache_memory, kv_dtype=args.kv_cache_dtype,
                       state_memory=args.state_memory, state_snapshot_memory=args.state_snapshot_memory,
                       enable_log_requests=args.enable_log_requests,
                       max_log_len=args.max_log_len, disable_metrics=args.disable_metrics, disable_ui=args.disable_ui,
                       enable_replay=not args.no_replay, speculative_config=args.speculative_config,
                       check_tensors=args.check_tensors, kv_events_config=args.kv_events_config,
                       pipeline_parallel_size=args.pipeline_parallel_size,
                       pipeline_devices=tuple(args.pipeline_devices),
                       pipeline_micro_batches=args.pipeline_micro_batches,
                       distributed_executor_backend=args.distributed_executor_backend, ray_address=args.ray_address,
                       max_waiting_requests=args.max_waiting_requests,
                       max_prompt_chars=args.max_prompt_chars, chat_template_timeout=args.chat_template_timeout,
                       escape_special_tokens=args.escape_special_tokens, tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser, json_max_digits=args.json_max_digits,
                       pooling=args.pooling, reranker=args.reranker,
                       timeout_keep_alive=args.timeout_keep_alive,
                       timeout_read=args.timeout_read, limit_concurrency=args.limit_concurrency,
                       max_header_bytes=args.max_header_bytes, allowed_origins=tuple(args.allowed_origins))
    if several:
        _serve_several(args, config)
    else:
        _server_for(args)(config)
    return 0


def _serve_several(args: argparse.Namespace, config: Any) -> None:
    """--model given more than once, or --models-dir: one process per model, loaded on demand."""
    from vkrt.errors import VkrtError
    from vkrt.serve_models import PoolConfig, model_paths, serve_models

    if args.data_parallel_backend is not None or args.data_parallel_size != 1:
        raise VkrtError("--data-parallel-size serves one model; with several models run one server per model")
    models = model_paths(args.model or [], args.models_dir)
    serve_models(config, models, PoolConfig(models_max=args.models_max, models_memory=args.models_memory,
                                            load_timeout=args.model_load_timeout))


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    p.add_argument("prompt", help="the prompt text")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--repeat", type=int, default=1, help="run the generation N times (timing)")
    p.add_argument("--stats", action="store_true", help="print load time, tok/s and per-step counters to stderr")
    p.add_argument("--json", action="store_true", help="print ids, text and stats as JSON instead of streaming")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="like generate --chat")
    p.add_argument("prompt")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--repeat", type=int, default=1, help="run the generation N times (timing)")
    p.add_argument("--stats", action="store_true", help="print load time, tok/s and per-step counters to stderr")
    p.add_argument("--json", action="store_true", help="print ids, text and stats as JSON instead of streaming")
    p.set_defaults(func=cmd_generate, chat=True)

    p = sub.add_parser("bench", help="measure prefill and decode throughput (JSON with --json)")
    _model_args(p)
    p.add_argument("--prompt-tokens", "-p", type=_prompt_lengths, default=[128], metavar="N[,N...]",
                   help="prompt length; several (e.g. 128,2048) run in turn in each repeat and are "
                        "compared with the first, round by round (default 128)")
    p.add_argument("--gen-tokens", "-g", type=int, default=128)
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="the prompt is this file's text (tokenised) instead of --prompt-tokens random ids")
    p.add_argument("--json-schema", default=None, metavar="PATH",
                   help="constrain the output to the JSON schema in this file (structured output); it ends "
                        "where the schema's JSON does, even before --gen-tokens")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds; each length's best decode tok/s is reported (default 1)")
    p.add_argument("--no-warmup", action="store_true",
                   help="time the first run too (by default an untimed run of the first length comes first: "
                        "pipeline creation and decode-step recording are not timed)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="time every kernel with device timestamps (adds a 'profile' section; slows the run a little)")
    p.set_defaults(func=cmd_bench)

    from vkrt.engine.pooling import POOLING_METHODS
    from vkrt.server.config import REASONING_PARSERS, RERANKERS, TOOL_CALL_PARSERS, ServerConfig

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_args(p, default_len="the model's", several=True)
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model in DIR (each .gguf file by its stem, each directory holding config.json "
                        "by its name), loaded when a request first names it")
    p.add_argument("--models-max", type=int, default=4, metavar="N",
                   help="with several models: most loaded at once; the least recently used idle one is unloaded "
                        "to make room (default 4)")
    p.add_argument("--models-memory", type=_parse_bytes, default=None, metavar="SIZE",
                   help="with several models: device memory all loaded models may take, e.g. 8G (default: 90%% "
                        "of the device's memory)")
    p.add_argument("--model-load-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with several models: how long a request waits for its model to load (default 600)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /version and the page at / "
                        "(visible in ps: prefer --api-key-file or VKRT_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from the first line of PATH")
    p.add_argument("--public-metrics", action="store_true", help="let GET /metrics answer without the API key")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="answer CORS requests from these browser origins ('*' for any); none by default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--max-log-len", type=int, default=None)
    p.add_argument("--disable-metrics", action="store_true")
    p.add_argument("--disable-ui", action="store_true",
                   help="no chat and status page at / (it answers 404)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="queued requests beyond which new ones get HTTP 429")
    p.add_argument("--max-prompt-chars", type=int, default=ServerConfig.max_prompt_chars,
                   help="prompt text longer than this many characters gets HTTP 413 before tokenising")
    p.add_argument("--chat-template-timeout", type=float, default=ServerConfig.chat_template_timeout, metavar="SECONDS",
                   help="time one chat-template rendering may take (then HTTP 400)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model's tool-call syntax (default: picked from its chat template)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                   help="split reasoning into reasoning_content: auto (by the chat template: <think> or "
                        "<seed:think> tags, or harmony), think (<think> tags always), seed_oss (<seed:think> "
                        "tags always), harmony (gpt-oss's channels), none (never)")
    p.add_argument("--json-max-digits", type=int, default=ServerConfig.json_max_digits, metavar="N",
                   help="digits an integer may have in schema-constrained JSON and forced tool calls when the "
                        "schema sets no minimum/maximum (a number's fraction: at most 10); 0: unbounded")
    p.add_argument("--pooling", choices=POOLING_METHODS, default=None,
                   help="how /v1/embeddings pools a prompt's hidden states: last token, mean, or the first (cls) "
                        "token (default: the model's sentence-transformers or GGUF pooling, else last)")
    p.add_argument("--reranker", choices=RERANKERS, default=None,
                   help="yes-no: the model is a causal-LM reranker in Qwen3-Reranker's format, scoring "
                        "/v1/rerank and /score by its yes/no logits (a *ForSequenceClassification model scores "
                        "without it)")
    p.add_argument("--escape-special-tokens", action="store_true",
                   help="tokenise message content as text, so '<|im_end|>' typed by a user is not a control token")
    p.add_argument("--timeout-keep-alive", type=float, default=ServerConfig.timeout_keep_alive, metavar="SECONDS",
                   help="close idle keep-alive connections after this")
    p.add_argument("--timeout-read", type=float, default=ServerConfig.timeout_read, metavar="SECONDS",
                   help="a request's head, then its body, must arrive within this (else closed / HTTP 408)")
    p.add_argument("--limit-concurrency", type=int, default=ServerConfig.limit_concurrency,
                   help="open connections plus requests in progress; beyond it HTTP 503")
    p.add_argument("--max-header-bytes", type=int, default=ServerConfig.max_header_bytes,
                   help="request line plus headers; larger gets HTTP 431")
    p.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help='publish prefix-cache events for KV-aware routers, vLLM\'s keys: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558"}\' (+ topic, buffer_steps, hwm, max_queue_size)')
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N replicas, one engine on one device each, behind these routes (with --data-parallel-backend)")
    p.add_argument("--data-parallel-backend", choices=["ray"], default=None,
                   help="run the replicas as a Ray Serve application (docs/USAGE.md, Replicas on Ray Serve)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join the Ray cluster at ADDR ('auto', 'ray://HOST:10001'); default: a local instance")
    p.add_argument("--data-parallel-devices", type=lambda text: [d for d in text.split(",") if d], default=[],
                   metavar="SEL[,SEL...]",
                   help="VKRT_DEVICE selectors dealt to the replicas of each node by local rank (default: every "
                        "replica takes its node's VKRT_DEVICE or best device)")
    p.set_defaults(func=cmd_serve)

