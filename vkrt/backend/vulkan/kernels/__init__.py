"""Native kernels of the Vulkan backend, one module per shader family.

Every module here that defines `register(backend)` is a family; it registers its kernels.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from vkrt.backend.vulkan.kernels.common import KernelBackend


def families() -> list[Any]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "register"):
            found.append(mod)
    return found


def register_all(backend: KernelBackend) -> None:
    for family in families():
        family.register(backend)
