"""The Messages API over the real default model (SmolLM2 on llvmpipe), with the anthropic SDK:
a streamed reply whose accumulated message equals the events' text, greedy equal to the
non-streamed one, a forced tool call valid for its schema, and count_tokens equal to usage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.live_model import MODEL_NAME, LiveModel, live_model

anthropic = pytest.importorskip("anthropic", reason="anthropic is a dev extra (pip install -e .[dev])")

API_KEY = "live-key"
USER = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather in a city",
                     "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                                      "properties": {"city": {"type": "string", "maxLength": 12}}}}]


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=512, max_num_seqs=4, api_key=API_KEY) as server:
        yield server


def test_messages_on_the_real_model(live: LiveModel) -> None:
    client = anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0, timeout=900)
    greedy: dict[str, Any] = {"extra_body": {"temperature": 0.0}}
    plain = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=USER, **greedy)
    assert plain.content[0].type == "text" and plain.content[0].text
    assert plain.stop_reason in ("max_tokens", "end_turn")
    assert plain.usage.input_tokens == client.messages.count_tokens(model=MODEL_NAME, messages=USER).input_tokens
    with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=USER, **greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == plain.content[0].text
    forced = client.messages.create(model=MODEL_NAME, max_tokens=60, messages=USER, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    [call] = forced.content
    assert call.type == "tool_use" and call.name == "get_weather" and forced.stop_reason == "tool_use"
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str) and len(call.input["city"]) <= 12
