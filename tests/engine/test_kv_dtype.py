"""KV cache element type: f16 by default (half the memory of f32), f32 on request, both through
EngineConfig and the --kv-cache-dtype flag; an f16 cache still decodes tiny_llama as
transformers' fp32 does and the same on both backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vkrt.backend import vulkan_unavailable_reason
from vkrt.cli import build_parser
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.config import EngineConfig
from vkrt.server.config import ServerConfig

TINY = Path(__file__).parents[1] / "fixtures" / "tiny_llama"


def test_default_is_f16_and_f32_stays_available() -> None:
    assert EngineConfig().kv_dtype == "f16"
    assert ServerConfig().engine_config().kv_dtype == "f16"
    assert ServerConfig(kv_dtype="f32").engine_config().kv_dtype == "f32"


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"], ["serve"], ["bench"]])
def test_kv_cache_dtype_flag(command: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(command).kv_cache_dtype == "f16"
    assert parser.parse_args([command[0], "--kv-cache-dtype", "f32", *command[1:]]).kv_cache_dtype == "f32"
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
