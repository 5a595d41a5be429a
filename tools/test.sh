#!/usr/bin/env bash
# Set up (tools/setup.sh), then run every check CI runs, in order; stops at the first
# failure and exits non-zero. Extra arguments go to pytest:
#
#   bash tools/test.sh                 everything
#   bash tools/test.sh -k rope -x      everything, with a narrower pytest run
#   VKRT_TEST_DRY_RUN=1 bash tools/test.sh    print the steps without running them
#   VKRT_TEST_WORKERS=1 bash tools/test.sh    pytest in one process (default: one per core, at most 4)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VKRT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
DRY_RUN="${VKRT_TEST_DRY_RUN:-}"
export PYTHONUNBUFFERED=1

cd "$ROOT"

now_ms() { date +%s%3N; }

step() {  # step NAME CMD...: run CMD, print its duration, exit on failure
  local name="$1"
  shift
  printf '\n==> %s: %s\n' "$name" "$*"
  [[ "$DRY_RUN" == 1 ]] && return 0
  local start rc=0
  start="$(now_ms)"
  "$@" || rc=$?
  local elapsed=$(($(now_ms) - start))
  local secs
  secs="$(printf '%d.%ds' $((elapsed / 1000)) $((elapsed % 1000 / 100)))"
  if ((rc != 0)); then
    printf '==> FAILED: %s (exit %d, %s)\n' "$name" "$rc" "$secs" >&2
    exit "$rc"
  fi
  printf '==> ok: %s (%s)\n' "$name" "$secs"
}

no_tests_is_failure() {  # pytest exits 5 when it collected nothing; say so plainly
  local rc=0
  "$@" || rc=$?
  if ((rc == 5)); then
    echo "pytest collected no tests (exit 5): a run that tests nothing fails;" \
      "check the test paths and any -k/-m arguments" >&2
  fi
  return "$rc"
}

step setup bash tools/setup.sh
step prerequisites "$PY" tools/check_prerequisites.py
step spirv-fresh "$PY" -m spirv_gen --check
step device-leakage "$PY" tools/check_device_leakage.py
step layers "$PY" tools/check_layers.py
step ruff "$PY" -m ruff check .
step mypy "$PY" -m mypy vkrt tools
# pytest in parallel processes (pytest-xdist), a whole test file to a process: one process kept
# ~1.2 of 2 cores busy (llvmpipe compiles a shader, and the host runs Python, on one core), and a
# file's tests share their pipelines and loaded models. At most 4: each process holds its own device
# and models (~2.5 GB).
# llvmpipe JIT-compiles every kernel variant the suite runs, most of them for a few dispatches, and
# that compiling is most of the suite's time: without LLVM's optimisation passes (Mesa's
# GALLIVM_PERF=nopt) the kernel tests ran ~1.6x faster and the model tests ~10% slower (docs/TESTING.md). Every check
# still runs; the code llvmpipe users run (optimised) is checked with GALLIVM_PERF= (empty).
export GALLIVM_PERF="${GALLIVM_PERF-nopt}"
WORKERS="${VKRT_TEST_WORKERS:-$(($(nproc) < 4 ? $(nproc) : 4))}"
[[ "$WORKERS" =~ ^[0-9]+$ ]] || { echo "VKRT_TEST_WORKERS must be a number, got '$WORKERS'" >&2; exit 2; }
PARALLEL=()
((WORKERS > 1)) && PARALLEL=(-n "$WORKERS" --dist loadfile)
step pytest no_tests_is_failure "$PY" -m pytest -q -rs -p no:cacheprovider --durations=15 "${PARALLEL[@]}" "$@"
if [[ "$DRY_RUN" == 1 ]]; then
  printf '\n==> dry run: nothing was run\n'
else
  printf '\n==> all checks passed\n'
fi
