"""reasoning_content: the <think> part of the output split from the answer, whole and
streamed in pieces of every size, and over a live server (SmolLM2 made to think by a grammar).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.live_model import LiveModel, live_model
from vkrt.server.reasoning import (
    THINK,
    ReasoningSplitter,
    split_reasoning,
    starts_inside,
    template_tags,
)

THOUGHT = "<think>\nfirst 2, then 2 more</think>\n\nThe answer is 4."


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), [
    (THOUGHT, False, "\nfirst 2, then 2 more", "The answer is 4."),
    ("first 2</think>\n\nfour", True, "first 2", "four"),  # the prompt opened the thought
    ("plain answer", False, None, "plain answer"),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    ("<thin", False, None, "<thin"),  # not a tag after all
])
def test_split_whole_and_streamed(text: str, inside: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, inside) == (reasoning, content)
    for size in (1, 2, 3, 7):
        splitter = ReasoningSplitter(inside)
        pieces = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)]
        pieces.append(splitter.feed("", final=True))
        assert "".join(r for r, _ in pieces) == (reasoning or "")
        assert "".join(c for _, c in pieces) == content


def test_template_and_prompt_detection() -> None:
    assert template_tags("{{ '<think>\\n' }}...{{ '</think>' }}") == THINK and template_tags("{{ messages }}") is None
    assert starts_inside("<|im_start|>assistant\n<think>\n") and not starts_inside("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=512, max_num_seqs=8, reasoning_parser="think") as server:
        yield server


def test_reasoning_content_live(live: LiveModel) -> None:
    """A grammar makes the model think first; the answer and the thought come apart, and the
    streamed deltas of the same seed add up to the same two strings."""
    grammar = 'start: "<think>" /[a-z ]{1,12}/ "</think>\\n\\n" /[A-Za-z ]{1,12}/'
    extra = {"structured_outputs": {"grammar": grammar}}
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=900)

    async def whole() -> Any:
        return (await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, seed=3,
                                                     temperature=0.8, extra_body=extra)).choices[0].message

    async def streamed() -> tuple[str, str]:
        reasoning, content = "", ""
        async for chunk in await client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=40, seed=3, temperature=0.8, stream=True,
                extra_body=extra):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        return reasoning, content

    async def plain() -> Any:
        return (await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=3,
                                                     extra_body={"structured_outputs": {"regex": "[a-z]{3}"}}))

    async def run() -> list[Any]:
        return await asyncio.gather(whole(), streamed(), plain())

    message, (reasoning, content), unthinking = asyncio.run(run())
    thought = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{1,12}", thought) and re.fullmatch(r"[A-Za-z ]{1,12}", message.content)
    assert (reasoning, content) == (thought, message.content)
    assert unthinking.choices[0].message.model_extra["reasoning_content"] is None
