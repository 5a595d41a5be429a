"""Download the wheels that install vkrt's tests (and the llama.cpp peer) on a machine with no
package index, for that machine's Python and platform.

    python3 tools/make_wheelhouse.py --out DIR [--python-version 3.12] [--glibc 2.39]
                                     [--have numpy,pytest,...] [--peer]

(itself on Python 3.11 or newer, for tomllib).
Run it on a connected machine, copy DIR and the checkout over, then install from DIR alone:
`bash tools/gpu_check.sh --wheels DIR [--system-site-packages]` (or `PIP_NO_INDEX=1
PIP_FIND_LINKS=DIR VKRT_SETUP_EXTRAS=test bash tools/setup.sh`). The wheels are vkrt's
dependencies with its `test` extra, resolved for the target (binary wheels only), and
setuptools (vkrt's build backend, which pip's isolated build installs from DIR). `--have`
leaves out the wheels of packages the target's Python already has, for a virtualenv made
with --system-site-packages (a smaller DIR to carry); `--peer` adds cyllama-vulkan (llama.cpp's
Vulkan backend, ~34 MB) for tools/bench_peers.py.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BUILD_BACKEND = "setuptools>=64"
PEER = "cyllama-vulkan"


def requirements(peer: bool) -> list[str]:
    """vkrt's runtime dependencies and its `test` extra, its build backend, and the peer."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["test"], BUILD_BACKEND]
    return reqs + [PEER] if peer else reqs


def platform_tags(glibc: str, machine: str) -> list[str]:
    """Every manylinux tag a glibc `glibc` machine accepts (pip matches tags exactly)."""
    major, minor = (int(part) for part in glibc.split(".")[:2])
    if major != 2 or minor < 17:
        raise SystemExit(f"make_wheelhouse: glibc {glibc}: want 2.17 or newer")
    tags = [f"manylinux_2_{m}_{machine}" for m in range(minor, 16, -1)]
    return tags + [f"manylinux2014_{machine}", "linux_" + machine]


def normalise(name: str) -> str:
    """A project name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def project_name(wheel: Path) -> str:
    """A wheel file's project name, normalised."""
    return normalise(wheel.name.split("-")[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the wheels (created)")
    parser.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the target's Python, e.g. 3.12 (default: this one)")
    parser.add_argument("--glibc", default=platform.libc_ver()[1] or "2.17",
                        help="the target's glibc version (default: this machine's)")
    parser.add_argument("--machine", default=platform.machine(), help="the target's CPU, e.g. x86_64")
    parser.add_argument("--have", default="", help="comma-separated packages the target already has")
    parser.add_argument("--peer", action="store_true", help=f"add {PEER} for tools/bench_peers.py")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version}: want 3.N")
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", args.python_version, "--implementation", "cp", "-d", str(args.out)]
    for tag in platform_tags(args.glibc, args.machine):
        cmd += ["--platform", tag]
    result = subprocess.run(cmd + requirements(args.peer), check=False)
    if result.returncode:
        print(f"make_wheelhouse: pip download failed (exit {result.returncode})", file=sys.stderr)
        return result.returncode
    have = {normalise(name) for name in args.have.split(",") if name.strip()}
    have.discard("setuptools")  # pip's isolated build of vkrt installs it from DIR, not the system
    for wheel in sorted(args.out.glob("*.whl")):
        if project_name(wheel) in have:
            wheel.unlink()
    wheels = sorted(args.out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out}")
    for wheel in wheels:
        print(f"  {wheel.name}  {wheel.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
