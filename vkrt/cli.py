"""`vkrt` command line: generate, chat, serve, bench, devices, ops, pull."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from vkrt import __version__, config
from vkrt.errors import VkrtError

log = logging.getLogger("vkrt")


def _setup_logging(debug: bool) -> None:
    level = logging.DEBUG if debug else getattr(logging, config.log_level(), logging.WARNING)
    logging.basicConfig(level=level, format="vkrt: %(levelname)s: %(message)s", stream=sys.stderr)


# -- devices / ops / pull ------------------------------------------------------------
def cmd_devices(args: argparse.Namespace) -> int:
    from vkrt.backend import get_backend, vulkan_unavailable_reason

    reason = vulkan_unavailable_reason()
    if reason is not None:
        info: dict[str, Any] = {"vulkan": False, "reason": reason, "backend": "reference"}
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"Vulkan unavailable: {reason}\nvkrt will run on the reference (numpy) backend.")
        return 0
    desc = get_backend("vulkan").describe()
    chosen = desc["device"]
    if args.json:
        print(json.dumps({"vulkan": True, "chosen": chosen["index"], "devices": desc["devices"]}, indent=2))
        return 0
    print("\n".join(get_backend("vulkan").describe_text()))
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from vkrt.backend import get_backend, vulkan_unavailable_reason
    from vkrt.ops import OPS

    reason = vulkan_unavailable_reason()
    vk = get_backend("vulkan") if reason is None else None
    rows: list[dict[str, Any]] = []
    for name in sorted(OPS):
        kernels = [k.name for k in vk.kernels(name)] if vk is not None else []
        rows.append({"op": name, "reference": "numpy",
                     "vulkan": kernels if kernels else ("reference (drain)" if vk is not None else None),
                     "doc": OPS[name].doc})
    if args.json:
        out: dict[str, Any] = {"ops": rows, "vulkan_available": vk is not None}
        if vk is not None:
            out["access_path"] = vk.describe()["device"]["access_path"]
        else:
            out["reason"] = reason
        print(json.dumps(out, indent=2))
        return 0
    if vk is None:
        print(f"Vulkan unavailable ({reason}); every op runs on the reference backend.\n")
    else:
        device = vk.describe()["device"]
        print(f"device: {device['name']}, access path: {device['access_path']}\n")
    width = max(len(r["op"]) for r in rows)
    print(f"{'op':<{width}}  vulkan")
    for r in rows:
        vulkan = r["vulkan"]
        shown = ", ".join(vulkan) if isinstance(vulkan, list) else (vulkan or "-")
        print(f"{r['op']:<{width}}  {shown}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from vkrt.loader.pull import DEFAULT_MODEL, list_models, pull

    if args.list:
        rows = list_models()
        width = max(len(r.name) for r in rows)
        print(f"{'NAME':<{width}}  {'SIZE':>7}  {'CACHED':<6}  DESCRIPTION")
        for r in rows:
            print(f"{r.name:<{width}}  {r.size / 1e6:>4.0f} MB  {'yes' if r.path else 'no':<6}  {r.description}")
            if r.path:
                print(f"{'':<{width}}  {'':>7}  {'':<6}  {r.path}")
        return 0
    path = pull(args.name or DEFAULT_MODEL, progress=not args.quiet)
    print(path)
    return 0


def _resolve_model_arg(args: argparse.Namespace) -> None:
    """`--model NAME` of a pullable model becomes its cached GGUF (and, for serve, the served name)."""
    spec = getattr(args, "model", None)
    if isinstance(spec, list):  # serve's --model, which may be repeated
        if len(spec) > 1 or getattr(args, "models_dir", None):
            return  # several models: vkrt.serve_models names and resolves each
        spec = args.model = spec[0]
    if not spec:
        return
    from vkrt.loader.pull import resolve_model

    path, name = resolve_model(spec)
    args.model = str(path)
    if name is not None and getattr(args, "served_model_name", "unset") is None:
        args.served_model_name = name


# -- entry point -------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vkrt", description="Vulkan-first LLM inference runtime")
    parser.add_argument("--version", action="version", version=f"vkrt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("devices", help="list Vulkan devices, the chosen one and its capabilities")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("ops", help="list ops and which backend runs each natively")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("pull", help="fetch a model by name into the model cache (`--list` shows them)")
    from vkrt.loader.pull import DEFAULT_MODEL

    p.add_argument("name", nargs="?", default=None, help=f"model to fetch (default: {DEFAULT_MODEL})")
    p.add_argument("--list", action="store_true", help="show the models vkrt can pull and which are cached")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pull)

    from vkrt import cli_generate

    cli_generate.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.debug)
    try:
        _resolve_model_arg(args)
        return int(args.func(args) or 0)
    except VkrtError as exc:
        if args.debug:
            raise
        print(f"vkrt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vkrt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
