"""Engine test fixtures: the numpy FakeLM with a byte tokenizer, wrapped in an LLM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from engine_fakes import FakeLM, byte_tokenizer

from vkrt.engine import LLM


@pytest.fixture
def make_llm() -> Callable[..., LLM]:
    """LLM over a fresh FakeLM; keyword arguments go to EngineConfig."""

    def make(**kwargs: Any) -> LLM:
        kwargs.setdefault("max_model_len", 128)
        kwargs.setdefault("device", "reference")
        # The fake's tests compare with logits computed without a cache: keep its keys exact.
        kwargs.setdefault("kv_dtype", "f32")
        return LLM(model=FakeLM(), tokenizer=byte_tokenizer(), **kwargs)

    return make
