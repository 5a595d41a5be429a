"""Engine test fixtures: the numpy FakeLM with a byte tokenizer, wrapped in an LLM."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


@pytest.fixture(scope="module")
def recurrent_prefill() -> Iterator[None]:
    """The recurrent gated delta rule and Mamba2 scan for prefill too, for a whole test module.
    Tests that demand the same bits however a prompt is split into steps need it: the recurrent
    kernels do the same arithmetic per token whatever the split, while the chunked forms
    (VKRT_DELTA_NET=chunked, VKRT_MAMBA2=chunked) regroup the sums by chunk
    (tests/ops/test_gdn_chunked.py, tests/ops/test_ssm_chunked.py; their engine check is
    tests/engine/test_hybrid.py's test_chunked_prefill_matches_recurrent)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VKRT_DELTA_NET", "recurrent")
        patch.setenv("VKRT_MAMBA2", "recurrent")
        yield
