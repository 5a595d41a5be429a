"""SmolLM2's tokenisation of every golden case equals transformers' (the fixture's ids and
rendered chats, tools/make_fixtures.py): prompts with and without special tokens, chat
templates byte for byte, and the rendered chats' ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES
from vkrt.tokenizer import Tokenizer

GOLDEN = json.loads((FIXTURES / "smollm2_golden.json").read_text())


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.mark.parametrize("case", GOLDEN["text_prompts"], ids=lambda c: repr(c["prompt"][:16]))
def test_text_prompts(smol: Tokenizer, case: dict[str, Any]) -> None:
    assert smol.encode(case["prompt"], add_special_tokens=case["add_special_tokens"]) == case["prompt_ids"]
    assert smol.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids_no_special"]


@pytest.mark.parametrize("case", GOLDEN["chats"], ids=lambda c: f"{len(c['messages'])}-messages")
def test_chats(smol: Tokenizer, case: dict[str, Any]) -> None:
    rendered = smol.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered.encode() == case["rendered"].encode()
    assert smol.encode(rendered, add_special_tokens=case["add_special_tokens"]) == case["prompt_ids"]


@pytest.mark.parametrize("case", [*GOLDEN["text_prompts"], *GOLDEN["chats"]], ids=lambda c: str(c["greedy_ids"][:2]))
def test_greedy_text_decodes(smol: Tokenizer, case: dict[str, Any]) -> None:
    """The golden continuation's ids decode (special tokens kept) to transformers' text."""
    assert smol.decode(case["greedy_ids"], skip_special_tokens=False) == case["greedy_text"]
