"""Native kernels of the Vulkan backend, one module per shader family."""

from __future__ import annotations

from typing import Any

from vkrt.backend.vulkan.kernels import elementwise

FAMILIES = [elementwise]


def register_all(backend: Any) -> None:
    for family in FAMILIES:
        family.register(backend)
