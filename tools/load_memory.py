"""Host memory of loading a model: peak and steady resident set size, one model per process.

    python tools/load_memory.py MODEL [MODEL ...] [--device vulkan|reference] [--json]

For each model a fresh Python process imports vkrt, loads the file (`load_model`), builds the
model on the device (`build_model`: every weight uploaded) and drops the loader's result, then
reports the process's resident set after each phase (VmRSS) and its peak (VmHWM), in MiB, with
the device memory the weights took. On a unified-memory device (llvmpipe, GB10, iGPUs) device
memory is host memory, so the weights' device image is part of the resident set; the rest is
what loading leaves behind (host copies, mapped file pages still resident) and Python itself.
MODEL is a .gguf file, a Hugging Face directory, or a name `vkrt pull` knows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _status_mib(key: str) -> float:
    """A /proc/self/status field (kB) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(model: str, device: str) -> dict[str, Any]:
    """Load `model` in this process and report its memory after each phase."""
    import gc

    rss: dict[str, float] = {"start": _status_mib("VmRSS")}
    import vkrt
    from vkrt.backend import get_backend
    from vkrt.loader import load_model
    from vkrt.loader.pull import resolve_model
    from vkrt.models import build_model

    backend = get_backend(device)
    rss["imported"] = _status_mib("VmRSS")
    loaded = load_model(resolve_model(model)[0])
    rss["loaded"] = _status_mib("VmRSS")
    built = build_model(loaded, backend)
    rss["built"] = _status_mib("VmRSS")
    del loaded
    gc.collect()
    rss["steady"] = _status_mib("VmRSS")
    weights = backend.memory_stats().get("weights_bytes", 0) / (1 << 20)
    return {"model": model, "device": backend.name, "file_type": built.file_type,
            "rss_mib": {k: round(v, 1) for k, v in rss.items()}, "peak_rss_mib": round(_status_mib("VmHWM"), 1),
            # what the steady resident set is made of: anonymous memory (Python, copies, and on a
            # unified-memory device the device allocations) and pages of mapped files
            "steady_anon_mib": round(_status_mib("RssAnon"), 1), "steady_file_mib": round(_status_mib("RssFile"), 1),
            "device_weights_mib": round(weights, 1), "vkrt": str(Path(vkrt.__file__ or "").parent)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help=".gguf files, HF directories or pullable names")
    parser.add_argument("--device", default="vulkan", choices=("vulkan", "reference"))
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.models[0], args.device)))
        return 0
    for model in args.models:  # a process per model: the peak is that model's alone
        out = subprocess.run([sys.executable, __file__, "--child", "--device", args.device, model],
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            print(f"{model}: failed\n{out.stderr.strip()}", file=sys.stderr)
            return out.returncode
        row = json.loads(out.stdout.strip().splitlines()[-1])
        if args.json:
            print(json.dumps(row))
        else:
            r = row["rss_mib"]
            print(f"{model} ({row['file_type']}, {row['device']}): peak {row['peak_rss_mib']} MiB, steady "
                  f"{r['steady']} MiB ({row['steady_anon_mib']} anonymous, {row['steady_file_mib']} mapped files; "
                  f"imported {r['imported']}, loaded {r['loaded']}, built {r['built']}); "
                  f"device weights {row['device_weights_mib']} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
