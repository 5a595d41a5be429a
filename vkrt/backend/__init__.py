"""Backends: `get_backend("vulkan" | "reference" | "auto")`."""

from __future__ import annotations

import logging

from vkrt.backend.base import Backend, Counters, Kernel
from vkrt.errors import DeviceUnavailable, VkrtError

log = logging.getLogger("vkrt")

BACKEND_NAMES = ("auto", "vulkan", "reference")
_vulkan_singleton: Backend | None = None


def vulkan_unavailable_reason() -> str | None:
    """None when a Vulkan device can be used, else a sentence saying why not."""
    try:
        _vulkan()
    except DeviceUnavailable as exc:
        return str(exc)
    return None


def _vulkan() -> Backend:
    # One VkDevice per process: a second idle device once crashed a lavapipe queue thread.
    global _vulkan_singleton
    if _vulkan_singleton is None:
        from vkrt.backend.vulkan import VulkanBackend

        _vulkan_singleton = VulkanBackend()
    return _vulkan_singleton


def started_vulkan_backend() -> Backend | None:
    """The process's Vulkan backend if something has started it, else None (starts nothing)."""
    return _vulkan_singleton


def get_backend(name: str = "auto") -> Backend:
    """The Vulkan backend, the reference backend, or ("auto") Vulkan falling back to reference."""
    if name == "reference":
        from vkrt.backend.reference import ReferenceBackend

        return ReferenceBackend()
    if name == "vulkan":
        return _vulkan()
    if name == "auto":
        try:
            return _vulkan()
        except DeviceUnavailable as exc:
            log.warning("Vulkan unavailable (%s); using the reference backend", exc)
            return get_backend("reference")
    raise VkrtError(f"unknown device {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


__all__ = ["BACKEND_NAMES", "Backend", "Counters", "Kernel", "get_backend", "started_vulkan_backend",
           "vulkan_unavailable_reason"]
