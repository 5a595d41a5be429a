"""Rung 4: greedy decode of the shipped SmolLM2 on Vulkan equals the reference backend token
for token, with and without replayed decode steps, and decode steps never drain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from vkrt.engine import LLM, SamplingParams

NEW_TOKENS = 64


def _prompts() -> list[list[int]]:
    golden = json.loads((FIXTURES / "smollm2_golden.json").read_text())
    text = [case["prompt_ids"] for case in golden["text_prompts"][:2]]
    chat = [golden["chats"][1]["prompt_ids"]]  # the one with its own system message
    return text + chat


def _greedy(path: Path, device: str, replay: bool = True) -> tuple[list[list[int]], dict]:
    # f32 KV: the token-exact contract is about the kernels, not the cache's f16 rounding.
    llm = LLM(path, device=device, max_model_len=256, max_num_seqs=4, enable_replay=replay, kv_dtype="f32")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(_prompts(), params)
    return [o.token_ids for o in outputs], llm.stats()


@pytest.fixture(scope="module")
def reference_ids(smollm2_path: Path) -> list[list[int]]:
    ids, _ = _greedy(smollm2_path, "reference")
    assert all(len(seq) == NEW_TOKENS for seq in ids)
    return ids


@pytest.mark.parametrize("replay", [False, True], ids=["eager", "replayed"])
def test_vulkan_greedy_equals_reference(smollm2_path: Path, reference_ids: list[list[int]],
                                        replay: bool, vk_default) -> None:
    ids, stats = _greedy(smollm2_path, "vulkan", replay)
    assert ids == reference_ids
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= NEW_TOKENS - 1
    assert worst["drains"] == 0, "a decode step fell back to the reference tier"
    if replay:
        assert worst["submits"] == 1 and worst["fence_waits"] == 1
        assert stats["last_step"]["replayed"]


LONG_PROMPT_TOKENS = 2000
LONG_NEW_TOKENS = 16


def _long_prompt() -> list[int]:
    """2000 tokens of the model's own text: each golden prompt with its greedy continuation,
    cycled. It crosses many KV blocks and prefill chunks, and the GQA attention kernel."""
    golden = json.loads((FIXTURES / "smollm2_golden.json").read_text())
    pieces = [case["prompt_ids_no_special"] + case["greedy_ids"] for case in golden["text_prompts"]]
    ids: list[int] = []
    while len(ids) < LONG_PROMPT_TOKENS:
        ids += pieces[len(ids) % len(pieces)]
    return ids[:LONG_PROMPT_TOKENS]


def test_vulkan_greedy_equals_reference_after_a_2000_token_prompt(smollm2_path: Path, vk_default) -> None:
    params = SamplingParams(max_tokens=LONG_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = {}
    for device in ("reference", "vulkan"):
        llm = LLM(smollm2_path, device=device, max_model_len=LONG_PROMPT_TOKENS + 64, max_num_seqs=1, kv_dtype="f32")
        ids[device] = llm.generate([_long_prompt()], params)[0].token_ids
        stats = llm.stats()
        del llm
    assert len(ids["reference"]) == LONG_NEW_TOKENS
    assert ids["vulkan"] == ids["reference"]
    assert stats["decode_counters_max"]["drains"] == 0
