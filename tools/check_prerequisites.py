"""Check what the test suite needs: a Vulkan device, the default model, the shader compiler,
headless Chromium (the browser tests of the page at /).

Under CI (CI=true) a missing one is an error (exit 1, one line per missing prerequisite), so
a CI run cannot pass by skipping every test that needs it; elsewhere each is reported and
the tests that need it skip with the same reason.

    python tools/check_prerequisites.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _vulkan() -> str | None:
    from vkrt.backend import vulkan_unavailable_reason

    return vulkan_unavailable_reason()


def _default_model() -> str | None:
    from vkrt.errors import VkrtError
    from vkrt.loader.pull import ensure_default_model

    try:
        ensure_default_model(progress=False)
    except VkrtError as exc:
        return str(exc)
    return None


def _shader_compiler() -> str | None:
    from spirv_gen import __main__ as gen

    try:
        gen.find_glslang()
    except SystemExit as exc:
        return str(exc)
    return None


def _chromium() -> str | None:
    from tests.server.browser import chromium_unavailable_reason

    return chromium_unavailable_reason()


CHECKS: dict[str, Callable[[], str | None]] = {
    "Vulkan device": _vulkan, "default model": _default_model, "shader compiler": _shader_compiler,
    "Chromium": _chromium,
}


def main() -> int:
    ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
    missing = 0
    for name, check in CHECKS.items():
        reason = check()
        if reason is None:
            print(f"ok: {name}")
            continue
        missing += 1
        print(f"{'error' if ci else 'warning'}: {name} unavailable: {reason}", file=sys.stderr)
    if missing and ci:
        print(f"CI=true: {missing} prerequisite(s) missing; the tests that need them would only skip",
              file=sys.stderr)
        return 1
    if missing:
        print("the tests that need them will skip (with CI=true they fail)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
