"""The Responses API over the real default model (SmolLM2 on llvmpipe), with the openai SDK: the
whole and the streamed reply, the stream's event sequence, and the text equal to what
/v1/chat/completions answers for the same greedy request (instructions as its system message)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.live_model import MODEL_NAME, LiveModel, live_model

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=512, max_num_seqs=4) as server:
        yield server


async def _all(live: LiveModel) -> tuple[Any, list[Any], Any]:
    """The whole response, the streamed events and the chat completion, run together (batch
    invariance makes concurrent greedy requests equal solo ones)."""
    client = live.async_client()
    greedy: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0}

    async def stream() -> list[Any]:
        events = await client.responses.create(input=[{"role": "user", "content": QUESTION}],
                                               instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS,
                                               stream=True, **greedy)
        return [event async for event in events]

    whole = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=MAX_TOKENS,
                                    **greedy)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": INSTRUCTIONS},
                                                    {"role": "user", "content": QUESTION}],
                                          max_tokens=MAX_TOKENS, **greedy)
    return await asyncio.gather(whole, stream(), chat)


def test_responses_on_the_real_model_equal_chat_completions(live: LiveModel) -> None:
    whole, events, chat = asyncio.run(_all(live))
    [choice] = chat.choices
    text = choice.message.content
    assert text
    # A reply cut by max_output_tokens is "incomplete", one that ended is "completed", as OpenAI's.
    status, last = (("completed", "response.completed") if choice.finish_reason == "stop"
                    else ("incomplete", "response.incomplete"))

    assert whole.status == status and whole.output_text == text
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens

    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        last])
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in deltas) == text
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.status == status and final.output_text == text
    assert final.id.startswith("resp_") and final.usage.output_tokens == chat.usage.completion_tokens
