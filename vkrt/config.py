"""Every VKRT_* environment variable is read here, and only here (docs/ENVIRONMENT.md)."""

from __future__ import annotations

import os
from pathlib import Path


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def device_selector() -> str | None:
    """VKRT_DEVICE: index or name substring of the Vulkan device to use."""
    return _env("VKRT_DEVICE")


def access_path_override() -> str | None:
    """VKRT_ACCESS: force the kernel memory-access path ('texel' or 'ssbo')."""
    value = _env("VKRT_ACCESS")
    return value.lower() if value else None


def delta_net_form() -> str | None:
    """VKRT_DELTA_NET: force the gated delta rule's prefill kernel ('chunked' or 'recurrent')."""
    value = _env("VKRT_DELTA_NET")
    return value.lower() if value else None


def mamba2_form() -> str | None:
    """VKRT_MAMBA2: force Mamba2's scan kernel for prefill ('chunked' or 'recurrent')."""
    value = _env("VKRT_MAMBA2")
    return value.lower() if value else None


def force_staging() -> bool:
    """VKRT_FORCE_STAGING=1: use device-local memory with staging copies even on unified memory."""
    return _env("VKRT_FORCE_STAGING") == "1"


def disable_vulkan() -> bool:
    """VKRT_DISABLE_VULKAN=1: behave as if no Vulkan loader were installed."""
    return _env("VKRT_DISABLE_VULKAN") == "1"


def check_tensors() -> bool:
    """VKRT_CHECK_TENSORS=1: scan every weight for NaN / Inf when loading (like --check-tensors)."""
    return _env("VKRT_CHECK_TENSORS") == "1"


def cache_dir() -> Path:
    """VKRT_CACHE: root of the model and pipeline caches (default: the user cache dir)."""
    value = _env("VKRT_CACHE")
    if value:
        return Path(value).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("vkrt"))


def log_level() -> str:
    """VKRT_LOG: logging level name for the vkrt logger (default WARNING)."""
    return (_env("VKRT_LOG") or "WARNING").upper()


def api_key() -> str | None:
    """VKRT_API_KEY: the key `vkrt serve` requires when neither --api-key nor --api-key-file is given."""
    return _env("VKRT_API_KEY")
