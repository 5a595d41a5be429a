#!/usr/bin/env bash
# Set up a checkout: system Vulkan packages (Debian/Ubuntu), a virtualenv, and vkrt
# installed editable with its dev extras. Safe to run again: each step checks first.
#
#   VKRT_SETUP_SKIP_APT=1   never call apt-get (install the packages yourself)
#   VKRT_VENV=DIR           virtualenv location (default: .venv in the repo root)
#   VKRT_SETUP_EXTRAS=LIST  vkrt's extras to install (default: dev; test: only what the tests
#                           need, for a machine that runs them but no linters or shader compiler)
#   VKRT_SETUP_SYSTEM_SITE=1  a new virtualenv sees the system Python's packages (a machine
#                           whose Python already has numpy and friends, installing offline)
#
# The pip step is skipped while pyproject.toml is unchanged since the last install;
# delete "$VKRT_VENV/.vkrt-setup-stamp" to force it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VKRT_VENV:-$ROOT/.venv}"
STAMP="$VENV/.vkrt-setup-stamp"

say() { printf '==> %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }
quietly() {  # run a noisy command; show its output only if it fails
  local log rc=0
  log="$(mktemp)"
  "$@" >"$log" 2>&1 || rc=$?
  ((rc == 0)) || cat "$log" >&2
  rm -f "$log"
  ((rc == 0)) || die "failed (exit $rc): $*"
}

cd "$ROOT"

# --- system packages ----------------------------------------------------------------
have_deb() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
have_ensurepip() { python3 -c 'import ensurepip, venv' >/dev/null 2>&1; }

command -v python3 >/dev/null || die "python3 not found; install Python 3.10 or newer"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "vkrt needs Python >= 3.10; python3 is $(python3 -V 2>&1)"

if [[ "${VKRT_SETUP_SKIP_APT:-}" == 1 ]]; then
  say "system packages: skipped (VKRT_SETUP_SKIP_APT=1)"
elif ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
  say "system packages: no apt here; install a Vulkan loader and driver yourself"
else
  missing=()
  for pkg in mesa-vulkan-drivers libvulkan1; do
    have_deb "$pkg" || missing+=("$pkg")
  done
  # Headless Chromium and its driver: the browser tests of the page `vkrt serve` answers at /
  # (tests/server/test_webui_browser.py). Debian packages them; where apt has none (Ubuntu
  # ships Chromium as a snap) those tests skip, and fail under CI=true.
  browser=()
  for pkg in chromium chromium-driver; do
    have_deb "$pkg" || browser+=("$pkg")
  done
  if [[ ! -x "$VENV/bin/python" ]] && ! have_ensurepip; then
    missing+=("python3-venv")
  fi
  if ((${#missing[@]} == 0 && ${#browser[@]} == 0)); then
    say "system packages: already installed"
  else
    sudo=""
    if [[ "$(id -u)" != 0 ]]; then
      command -v sudo >/dev/null \
        || die "need root to install ${missing[*]} ${browser[*]}; run as root, install them, or set VKRT_SETUP_SKIP_APT=1"
      sudo="sudo"
    fi
    apt_get() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -qq "$@"; }
    say "system packages: installing ${missing[*]} ${browser[*]}"
    quietly apt_get update
    ((${#missing[@]} == 0)) || quietly apt_get install --no-install-recommends "${missing[@]}"
    if ((${#browser[@]})) && ! apt_get install --no-install-recommends "${browser[@]}" >/dev/null 2>&1; then
      say "system packages: ${browser[*]} unavailable from apt here; the browser tests will skip (fail under CI=true)"
    fi
    # vulkaninfo only lists the devices below; never fail over it.
    have_deb vulkan-tools || apt_get install --no-install-recommends vulkan-tools >/dev/null 2>&1 \
      || say "system packages: vulkan-tools unavailable (optional), continuing"
  fi
fi

# --- virtualenv ---------------------------------------------------------------------
if [[ -x "$VENV/bin/python" ]]; then
  say "virtualenv: $VENV exists"
else
  say "virtualenv: creating $VENV"
  venv_flags=()
  if [[ "${VKRT_SETUP_SYSTEM_SITE:-}" == 1 ]]; then
    venv_flags=(--system-site-packages)
    # A Python without ensurepip (Debian/Ubuntu without python3-venv) still makes a venv
    # without pip; the system's pip, which it sees, installs into it.
    have_ensurepip || venv_flags+=(--without-pip)
  fi
  python3 -m venv "${venv_flags[@]}" "$VENV" || die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
  if ((${#venv_flags[@]})); then
    # A venv made by a venv's python3 sees only the base interpreter's packages; a .pth file
    # adds the making venv's own site-packages after the new venv's.
    parent="$(python3 -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
    if [[ -n "$parent" ]]; then
      own="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      printf '%s\n' "$parent" >"$own/_vkrt_parent_site.pth"
      say "virtualenv: also sees $(echo "$parent" | tr '\n' ' ')"
    fi
  fi
fi
PY="$VENV/bin/python"
"$PY" -m pip --version >/dev/null 2>&1 \
  || die "$VENV has no pip (python3 has no ensurepip and its packages hold no pip); install python3-venv or python3-pip"

# --- python packages ----------------------------------------------------------------
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off
EXTRAS="${VKRT_SETUP_EXTRAS:-dev}"
[[ "$EXTRAS" =~ ^[a-z,]*$ ]] || die "VKRT_SETUP_EXTRAS must be extras' names, comma-separated (got '$EXTRAS')"
target="."
[[ -n "$EXTRAS" ]] && target=".[$EXTRAS]"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $ROOT $target"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$PY" -c 'import vkrt' 2>/dev/null; then
  say "python packages: up to date"
else
  if [[ "${PIP_NO_INDEX:-}" == 1 ]]; then
    say "python packages: offline (PIP_NO_INDEX=1), keeping this pip"
  else
    say "python packages: upgrading pip"
    quietly "$PY" -m pip install --upgrade pip
  fi
  say "python packages: pip install -e $target"
  quietly "$PY" -m pip install -e "$target"
  printf '%s\n' "$want" >"$STAMP"
fi

# --- report -------------------------------------------------------------------------
if command -v vulkaninfo >/dev/null; then
  say "vulkan devices:"
  vulkaninfo --summary 2>/dev/null | grep -E '^\s*(deviceName|deviceType|driverName)\s*=' \
    | sed 's/^\s*/    /' || echo "    (vulkaninfo found none)"
fi
say "setup done: $PY"
