"""KV cache format: f16 by default (half the memory of f32), f32 or q8_0 on request, through
EngineConfig and the --kv-cache-dtype flag; an f16 cache still decodes tiny_llama as
transformers' fp32 does and the same on both backends. q8_0 (GGUF 8-bit blocks of 32 values
per head) needs head_dim % 32 == 0, so its tests use tiny_llama_hd32: its logits stay within a
stated bound of transformers', both backends decode the same ids from it, and its replayed
decode steps are still 1 submit, 1 fence wait, 0 drains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import nmse
from tests.models.conftest import Greedy
from vkrt.backend import get_backend, vulkan_unavailable_reason
from vkrt.cli import build_parser
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.config import EngineConfig
from vkrt.errors import UnsupportedModelError
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.server.config import ServerConfig

TINY = Path(__file__).parents[1] / "fixtures" / "tiny_llama"
TINY_HD32 = Path(__file__).parents[1] / "fixtures" / "tiny_llama_hd32"
# Stated bound: NMSE of every prompt position's logits against transformers' fp32 forward with
# a q8_0 cache (measured 1.7e-4 .. 3.4e-4 on the three golden prompts, both backends; f16:
# <= 4.4e-7). A random-weight model with logits of +-4.5 is a harsh case: docs/BENCHMARKS.md
# has the real models' numbers.
Q8_0_LOGITS_NMSE = 1e-3


def test_default_is_f16_and_f32_stays_available() -> None:
    assert EngineConfig().kv_dtype == "f16"
    assert ServerConfig().engine_config().kv_dtype == "f16"
    assert ServerConfig(kv_dtype="f32").engine_config().kv_dtype == "f32"


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"], ["serve"], ["bench"]])
def test_kv_cache_dtype_flag(command: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(command).kv_cache_dtype == "f16"
    assert parser.parse_args([command[0], "--kv-cache-dtype", "f32", *command[1:]]).kv_cache_dtype == "f32"
    assert parser.parse_args([command[0], "--kv-cache-dtype", "q8_0", *command[1:]]).kv_cache_dtype == "q8_0"
    with pytest.raises(SystemExit):
        parser.parse_args([command[0], "--kv-cache-dtype", "q8", *command[1:]])


@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_f16_cache_halves_the_memory_and_matches_transformers(device: str) -> None:
    if device == "vulkan" and (reason := vulkan_unavailable_reason()) is not None:
        pytest.skip(f"Vulkan unavailable: {reason}")
    golden = json.loads((TINY / "golden.json").read_text())
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [c["input_ids"] for c in golden["cases"]]
    llm = LLM(TINY, device=device, max_model_len=128)
    c = llm.model_config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim  # K and V elements per token
    assert llm.engine.model.kv_bytes_per_block(16, llm.config.kv_dtype) == 16 * per_token * 2
    assert llm.engine.model.kv_bytes_per_block(16, "f32") == 16 * per_token * 4
    assert llm.engine.runner.kv.keys[0].dtype == "f16"
    outputs = llm.generate(prompts, params)
    for case, out in zip(golden["cases"], outputs, strict=True):
        assert out.token_ids == case["greedy_ids"]


def _skip_without_vulkan(device: str) -> None:
    if device == "vulkan" and (reason := vulkan_unavailable_reason()) is not None:
        pytest.skip(f"Vulkan unavailable: {reason}")


@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_q8_0_cache_is_17_32_of_f16_and_close_to_transformers(device: str) -> None:
    _skip_without_vulkan(device)
    golden = json.loads((TINY_HD32 / "golden.json").read_text())
    model = build_model(load_model(TINY_HD32), get_backend(device))
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim
    assert model.kv_bytes_per_block(16, "q8_0") == 16 * per_token // 32 * 34
    for case in golden["cases"]:
        driver = Greedy(model, max_len=64)
        driver.kv = model.allocate_kv_cache(4, 16, "q8_0")
        assert driver.kv.keys[0].dtype == "kv_q8_0"
        logits = driver.step(case["input_ids"], 0, all_logits=True)
        expected = np.array(case["all_logits"], np.float32)
        assert nmse(logits, expected) <= Q8_0_LOGITS_NMSE, f"prompt of {len(case['input_ids'])}"


def test_q8_0_decodes_the_same_on_both_backends_and_replays_in_one_submit() -> None:
    """The quantizer is bit-exact on both backends, so greedy ids agree (not with transformers':
    the quantized cache moves one near-tie of this random model); replay keeps its contract."""
    _skip_without_vulkan("vulkan")
    golden = json.loads((TINY_HD32 / "golden.json").read_text())
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [c["input_ids"] for c in golden["cases"]]
    ids = {}
    for device in ("reference", "vulkan"):
        llm = LLM(TINY_HD32, device=device, max_model_len=128, kv_dtype="q8_0")
        ids[device] = [o.token_ids for o in llm.generate(prompts, params)]
    assert ids["vulkan"] == ids["reference"]
    stats = llm.stats()
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= 15 and stats["last_step"]["replayed"]
    assert (worst["submits"], worst["fence_waits"], worst["drains"]) == (1, 1, 0)


def test_q8_0_refuses_heads_of_16_in_one_line() -> None:
    with pytest.raises(UnsupportedModelError, match="head_dim is 16; use f16 or f32"):
        LLM(TINY, device="reference", max_model_len=128, kv_dtype="q8_0")
