"""Unpack llvmpipe's cached machine code and summarise each loop (a script, not a test).

    MESA_SHADER_CACHE_DIR=/tmp/mc .venv/bin/vkrt generate "Hi" -n 4    # any run, empty dir
    .venv/bin/python tools/llvmpipe_asm.py /tmp/mc [--out DIR (default /tmp/mc/asm)] [--min 300]

llvmpipe (Mesa 22.x) stores each compiled shader as a zstd-compressed ELF object in the
Mesa disk cache. This writes every object and its `objdump -d` listing to --out, then
prints, per object, each backward jump's loop body with more than --min instructions:
its size, the calls in it (a texelFetch from a uniform texel buffer is a call; the kernels'
imageLoad is inline) and the commonest
instructions (spills show up as vmovaps/vmovdqa to and from the stack). Needs the `zstd`
and `objdump` commands (Debian: zstd, binutils).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LINE = re.compile(r"\s*([0-9a-f]+):\s+(\S+)\s*(.*)")


def unpack(cache: Path, out: Path) -> list[Path]:
    """Cache entries -> ELF objects in `out` (entries without one are skipped)."""
    objects = []
    for entry in sorted(cache.glob("mesa_shader_cache/*/*")):
        data = entry.read_bytes()
        start = data.find(ZSTD_MAGIC)
        if start < 0:
            continue
        raw = subprocess.run(["zstd", "-d", "-c"], input=data[start:], capture_output=True).stdout
        elf = raw.find(b"\x7fELF")
        if elf >= 0:
            path = out / f"{entry.parent.name}{entry.name[:8]}.o"
            path.write_bytes(raw[elf:])
            objects.append(path)
    return objects


def loops(listing: str, minimum: int) -> list[str]:
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(LINE.match, listing.splitlines()) if m]
    found = []
    for addr, op, arg in ins:
        target = re.match(r"([0-9a-f]+)", arg) if op.startswith("j") else None
        if target and int(target.group(1), 16) < addr:
            body = [i for i in ins if int(target.group(1), 16) <= i[0] <= addr]
            if len(body) > minimum:
                ops = collections.Counter(i[1] for i in body)
                top = ", ".join(f"{name} {n}" for name, n in ops.most_common(10))
                found.append(f"  loop {target.group(1)}-{addr:x}: {len(body)} instructions, {ops['call']} calls; {top}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="the MESA_SHADER_CACHE_DIR of the run")
    parser.add_argument("--out", type=Path, help="where to write .o and .s files (default: CACHE/asm)")
    parser.add_argument("--min", type=int, default=300, help="smallest loop body to report")
    args = parser.parse_args(argv)
    for tool in ("zstd", "objdump"):
        if shutil.which(tool) is None:
            print(f"llvmpipe_asm: needs the `{tool}` command", file=sys.stderr)
            return 2
    out = args.out or args.cache / "asm"
    out.mkdir(parents=True, exist_ok=True)
    objects = unpack(args.cache, out)
    if not objects:
        print(f"llvmpipe_asm: no compiled shaders under {args.cache}/mesa_shader_cache", file=sys.stderr)
        return 1
    for obj in objects:
        listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True,
                                 text=True).stdout
        obj.with_suffix(".s").write_text(listing)
        found = loops(listing, args.min)
        if found:
            print(f"{obj.name}: {listing.count(chr(10))} lines")
            print("\n".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
