"""A model with an op the device has no kernel for cannot be recorded for replay (the op's
drain needs the host mid-step): the engine then runs decode steps eagerly, and the output
is still the golden's."""

from __future__ import annotations

import json
import logging

import pytest

from tests.conftest import FIXTURES
from vkrt.backend.base import Backend
from vkrt.engine import LLM, SamplingParams


def test_a_draining_model_decodes_eagerly(vk_default: Backend, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    golden = json.loads((FIXTURES / "tiny_llama" / "golden.json").read_text())
    case = golden["cases"][1]
    monkeypatch.setitem(vk_default._kernels, "paged_attention", [])  # now it drains
    llm = LLM(FIXTURES / "tiny_llama", device="vulkan", max_model_len=64, max_num_seqs=2, kv_dtype="f32")
    with caplog.at_level(logging.WARNING, logger="vkrt"):
        (out,) = llm.generate([case["input_ids"]], SamplingParams(max_tokens=len(case["greedy_ids"]),
                                                                  temperature=0.0, ignore_eos=True))
    assert out.token_ids == case["greedy_ids"]
    assert "cannot be recorded for replay" in caplog.text
    stats = llm.stats()
    assert stats["decode_counters_max"]["drains"] > 0 and not stats["last_step"]["replayed"]
