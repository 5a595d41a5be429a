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

from tests.conftest import FIXTURES, GOLDEN_LOGIT_ATOL_FOR
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.engine import LLM, SamplingParams
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.models.decoder import DecoderModel

FAMILIES = ["tiny_qwen2", "tiny_qwen2_gguf", "tiny_qwen3", "tiny_qwen3_gguf", "tiny_mistral", "tiny_gemma2",
            "tiny_gemma2_gguf", "tiny_gemma3", "tiny_gemma3_gguf", "tiny_phi3", "tiny_smollm3", "tiny_granite",
            "tiny_phi3_partial", "tiny_ernie4_5", "tiny_lfm2", "tiny_lfm2_gguf", "tiny_qwen3_5", "tiny_qwen3_5_gguf", "tiny_granite4", "tiny_qwen3_next", "tiny_qwen3_next_gguf", "tiny_qwen3_5_moe", "tiny_qwen3_5_moe_gguf", "tiny_nemotron_h", "tiny_qwen3_5_vl", "tiny_lfm2_moe", "tiny_lfm2_moe_gguf", "tiny_granite4_gguf", "tiny_nemotron_h_gguf", "tiny_olmo_hybrid", "tiny_granite4_moe", "tiny_granite4_moe_gguf", "tiny_nemotron_h_moe", "tiny_nemotron_h_moe_gguf", "tiny_falcon_h1", "tiny_falcon_h1_gguf", "tiny_falcon_h1_nonorm", "tiny_qwen3_5_moe_vl",
            # llama.cpp's converter on HF fixtures above (the mixtures of experts': tests/models/test_moe.py)
            "tiny_smollm3_gguf", "tiny_granite_gguf", "tiny_ernie4_5_gguf",
            "tiny_phi3_gguf", "tiny_phi3_partial_gguf", "tiny_glm4_moe", "tiny_glm4_moe_gguf",
            "tiny_gpt_oss", "tiny_gpt_oss_gguf", "tiny_gpt_oss_mxfp4_gguf", "tiny_gpt_oss_mxfp4",
            "tiny_olmo2", "tiny_olmo2_gguf", "tiny_olmo3", "tiny_olmo3_gguf", "tiny_exaone4", "tiny_exaone4_gguf",
            "tiny_seed_oss", "tiny_seed_oss_gguf", "tiny_ministral3", "tiny_ministral3_gguf",
            "tiny_ministral3_vl", "tiny_minimax_m2", "tiny_minimax_m2_gguf",
            # multi-head latent attention (tests/models/test_mla.py: its cache and absorption)
            "tiny_deepseek_v3", "tiny_deepseek_v3_gguf", "tiny_glm4_moe_lite", "tiny_glm4_moe_lite_gguf",
            "tiny_gemma4", "tiny_gemma4_moe", "tiny_gemma4_vl", "tiny_gemma4_gguf", "tiny_gemma4_moe_gguf",
            # Llama 4: chunked attention, NoPE layers with the query temperature, input-scaled experts
            "tiny_llama4", "tiny_llama4_gguf"]
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
        assert diff <= GOLDEN_LOGIT_ATOL_FOR.get(name, FAMILY_LOGIT_ATOL), f"{name} len {len(ids)}: max |diff| {diff}"


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


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen2_gguf"])
def test_qwen2_bias_joins_the_qkv_projection(name: str, vk_default: Backend) -> None:
    """Qwen2's q/k/v bias is the epilogue of the normed qkv matmul (rms_norm_matmul_add), not
    an add of its own. A decode step: embedding; per layer the qkv matmul with its norm and
    bias, qkv_rope_kv_write, paged_attention, o_proj + residual, gate_up with its norm and
    SwiGLU, down + residual; the gather and the normed LM head: 1 + 6 per layer + 2, which is
    15 for these 2 layers (17, one add more per layer, before the bias joined the matmul)."""
    model = DecoderModel(load_model(_model_path(name)), vk_default)
    assert model.config.qkv_bias and all(None not in layer.mixer.qkv.biases for layer in model.weights.layers)
    case = _golden(name)["cases"][-1]
    driver = Greedy(model, max_len=MAX_LEN)
    before = dict(vk_default.selections)
    assert driver.generate(case["input_ids"], 4) == case["greedy_ids"][:4]
    ran = {key: n - before.get(key, 0) for key, n in vk_default.selections.items() if n > before.get(key, 0)}
    assert not any(op == "add" for op, _ in ran), f"an add ran on its own: {ran}"
    decode = driver.step_counters[1:]  # after the prefill
    assert ran[("rms_norm_matmul_add", "rms_norm_matmul_add.vec")] == len(decode) * model.config.num_layers
    assert {c["dispatches"] for c in decode} == {1 + 6 * model.config.num_layers + 2}
    assert {c["drains"] for c in driver.step_counters} == {0}


def _logits_within_golden(model: DecoderModel, golden: str) -> None:
    for case in _golden(golden)["cases"]:
        logits = Greedy(model, max_len=MAX_LEN).step(case["input_ids"], 0, all_logits=True)
        diff = float(np.abs(logits - np.array(case["all_logits"], dtype=np.float32)).max())
        assert diff <= FAMILY_LOGIT_ATOL, f"len {len(case['input_ids'])}: max |diff| {diff}"


def test_gemma3_gguf_rope_scaling_applies_to_global_layers_only(tmp_path: Path, ref: Backend) -> None:
    """tiny_gemma3_gguf holds tiny_gemma3's weights; with `rope.scaling` linear 4 in its metadata
    (as Gemma 3 4B+ GGUFs carry it) it must reproduce tiny_gemma3's transformers golden, whose
    config scales the full-attention layers only."""
    from tests.models.test_family_configs import _rewrite_gguf

    path = tmp_path / "scaled.gguf"
    _rewrite_gguf(FIXTURES / "tiny_gemma3_gguf" / "model.gguf", path, rope_type="linear", rope_factor=4.0)
    _logits_within_golden(DecoderModel(load_model(path), ref), "tiny_gemma3")


def test_phi3_gguf_longrope_attention_factor_is_read(tmp_path: Path, ref: Backend) -> None:
    """tiny_phi3_gguf holds tiny_phi3's weights and its converter's longrope attention factor (1); with
    `rope.scaling.attn_factor` set to the one transformers derives from tiny_phi3's config (factor 4
    over a context of 64) it must reproduce tiny_phi3's transformers golden."""
    from tests.models.test_family_configs import _rewrite_gguf

    path = tmp_path / "attn_factor.gguf"
    _rewrite_gguf(FIXTURES / "tiny_phi3_gguf" / "model.gguf", path,
                  values={"phi3.rope.scaling.attn_factor": float(np.sqrt(1 + np.log(4.0) / np.log(64)))})
    _logits_within_golden(DecoderModel(load_model(path), ref), "tiny_phi3")
