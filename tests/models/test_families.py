"""Every family through the generic decoder against transformers' goldens (rung 3).

The fixtures are tiny random-weight models made by each family's transformers class
(tools/make_fixtures.py --only families, see tests/fixtures/README.md); their prompts cross
every sliding window. These tests need no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.engine import LLM, SamplingParams
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.models.decoder import DecoderModel

FAMILIES = ["tiny_qwen2", "tiny_qwen2_gguf", "tiny_qwen3", "tiny_qwen3_gguf", "tiny_mistral", "tiny_gemma2",
            "tiny_gemma2_gguf", "tiny_gemma3", "tiny_gemma3_gguf", "tiny_phi3", "tiny_smollm3", "tiny_granite"]
LLAMAS = ["tiny_llama", "tiny_llama_tied", "tiny_llama_bf16"]
# Stated bound: max |logit difference| against transformers' float32 forward. Measured
# 2.3e-5 at most on both backends (tiny_smollm3; most of it the goldens' 6-digit rounding),
# the bound ~10x that. The smallest greedy margin in these goldens (4.5e-4, tiny_smollm3)
# is above 2x the bound.
FAMILY_LOGIT_ATOL = 2e-4
MAX_LEN = 64  # the longest case: 40 prompt + 16 new tokens


def _golden(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden.json").read_text())


def _model_path(name: str) -> Path:
    """The fixture's HF directory, or its GGUF file for the *_gguf fixtures."""
    return FIXTURES / name / _golden(name)["meta"].get("model_file", "")


def _backend(device: str, request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("ref" if device == "reference" else "vk_default")


@pytest.mark.parametrize("name", FAMILIES + LLAMAS)
@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_decoder_logits_match_transformers(name: str, device: str, request: pytest.FixtureRequest) -> None:
    model = DecoderModel(load_model(_model_path(name)), _backend(device, request))
    for case in _golden(name)["cases"]:
        ids = case["input_ids"]
        logits = Greedy(model, max_len=MAX_LEN).step(ids, 0, all_logits=True)
        expected = np.array(case["all_logits"], dtype=np.float32)
        assert logits.shape == expected.shape
        diff = float(np.abs(logits - expected).max())
        assert diff <= FAMILY_LOGIT_ATOL, f"{name} len {len(ids)}: max |diff| {diff}"


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_family_greedy_matches_transformers(name: str, device: str, request: pytest.FixtureRequest) -> None:
    """Prefill, then one token per step through the paged cache (windows crossed in decode too)."""
    model = build_model(load_model(_model_path(name)), _backend(device, request))
    assert isinstance(model, DecoderModel)
    for case in _golden(name)["cases"]:
        got = Greedy(model, max_len=MAX_LEN).generate(case["input_ids"], len(case["greedy_ids"]))
        assert got == case["greedy_ids"], f"{name} len {len(case['input_ids'])}"


@pytest.mark.parametrize("name", FAMILIES)
def test_vulkan_equals_reference_token_for_token(name: str, ref: Backend, vk_default: Backend) -> None:
    """Greedy ids and the per-step argmax logits of both backends agree on the longest prompt."""
    case = _golden(name)["cases"][-1]
    runs = []
    for backend in (ref, vk_default):
        driver = Greedy(DecoderModel(load_model(_model_path(name)), backend), max_len=MAX_LEN)
        runs.append(driver.generate(case["input_ids"], len(case["greedy_ids"])))
    assert runs[0] == runs[1] == case["greedy_ids"]


@pytest.mark.parametrize("name", FAMILIES)
def test_replayed_decode_step_is_one_submit_without_drains(name: str, vk_default: Backend) -> None:
    """Through the engine: recorded decode steps replay in one submit and never drain."""
    cases = _golden(name)["cases"][1:]
    llm = LLM(_model_path(name), device="vulkan", max_model_len=MAX_LEN, max_num_seqs=4, enable_replay=True)
    outputs = llm.generate([c["input_ids"] for c in cases],
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [c["greedy_ids"] for c in cases]
    stats = llm.stats()
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= 15
    assert worst["drains"] == 0, "a decode step fell back to the reference tier"
    assert worst["submits"] == 1 and worst["fence_waits"] == 1
    assert stats["last_step"]["replayed"]
