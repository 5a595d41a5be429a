"""The Anthropic Messages API over the fake engine, driven by the official anthropic SDK:
replies, streams the SDK's helpers accumulate, tool use round trips under a scripted engine,
forced tool choices, stop reasons, token counting, x-api-key auth and Anthropic-shaped errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine

anthropic = pytest.importorskip("anthropic", reason="anthropic is a dev extra (pip install -e .[dev])")

TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather in a city",
                     "input_schema": {"type": "object", "required": ["city"],
                                      "properties": {"city": {"type": "string", "maxLength": 12}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = [{"role": "user", "content": "Weather in Paris?"}]
START, END = "<|im_start|>", "<|im_end|>"  # one token each in the fake tokenizer


def _client(live: Live, api_key: str = "unused") -> Any:
    return anthropic.Anthropic(base_url=live.url, api_key=api_key, max_retries=0, timeout=30)


def test_create_text_reply_and_max_tokens(fake: Live) -> None:
    message = _client(fake).messages.create(model="fake", max_tokens=5, messages=USER)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "abcde"  # the fake engine's letters
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 5
    assert message.model == "fake"


def test_stop_sequences_give_stop_sequence(fake: Live) -> None:
    message = _client(fake).messages.create(model="fake", max_tokens=20, messages=USER, stop_sequences=["d"])
    assert message.content[0].text == "abc"
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "d"


def test_end_turn_and_system_blocks(serve_fake: Callable[..., Live]) -> None:
    engine = FakeEngine(max_model_len=512, script="Hello there")
    live = serve_fake(engine)
    message = _client(live).messages.create(model="fake", max_tokens=50, messages=USER,
                                            system=[{"type": "text", "text": "Be brief."}],
                                            metadata={"user_id": "u1"},
                                            extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert message.content[0].text == "Hello there" and message.stop_reason == "end_turn"
    # The system text reached the prompt: count_tokens with and without it differ by its length.
    client = _client(live)
    with_system = client.messages.count_tokens(model="fake", messages=USER, system="Be brief.").input_tokens
    without = client.messages.count_tokens(model="fake", messages=USER).input_tokens
    assert with_system - without == len("<|im_start|>system\nBe brief.<|im_end|>\n") - len(START + END) + 2


def test_stream_helpers_accumulate_the_message(fake: Live) -> None:
    client = _client(fake)
    with client.messages.stream(model="fake", max_tokens=6, messages=USER) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "abcdef" and len(texts) >= 2
    assert final.content[0].text == "abcdef" and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0


def test_stream_event_order(fake: Live) -> None:
    r = fake.client.post("/v1/messages", json={"model": "fake", "max_tokens": 3, "messages": USER, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "[DONE]" not in r.text


def test_tool_use_round_trip(serve_fake: Callable[..., Live]) -> None:
    prompts: list[str] = []

    def script(params: Any) -> str:
        return CALL if not prompts.append("x") and len(prompts) == 1 else "It is sunny."

    live = serve_fake(FakeEngine(max_model_len=512, script=script))
    client = _client(live)
    first = client.messages.create(model="fake", max_tokens=100, messages=USER, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    second = client.messages.create(model="fake", max_tokens=100, tools=TOOLS, messages=[
        *USER, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}]}])
    assert second.content[0].text == "It is sunny." and second.stop_reason == "end_turn"


def test_tool_use_streamed(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(FakeEngine(max_model_len=512, script="Let me check.\n" + CALL))
    with _client(live).messages.stream(model="fake", max_tokens=100, messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_choice_forces_a_call(serve_fake: Callable[..., Live], choice: dict[str, Any]) -> None:
    # The script answers in prose first; the forcing grammar's mask drops the prose (the fake
    # engine skips a token the mask refuses), so the reply is the call alone.
    live = serve_fake(FakeEngine(max_model_len=512, script="No tools needed. " + CALL))
    message = _client(live).messages.create(model="fake", max_tokens=200, messages=USER, tools=TOOLS,
                                            tool_choice=choice)
    assert [block.type for block in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather" and message.content[0].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"


def test_without_forcing_the_prose_stays(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(FakeEngine(max_model_len=512, script="No tools needed. " + CALL))
    message = _client(live).messages.create(model="fake", max_tokens=200, messages=USER, tools=TOOLS)
    assert [block.type for block in message.content] == ["text", "tool_use"]


def test_tool_choice_none_offers_no_tools(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(FakeEngine(max_model_len=512, script=CALL))
    message = _client(live).messages.create(model="fake", max_tokens=200, messages=USER, tools=TOOLS,
                                            tool_choice={"type": "none"})
    assert [block.type for block in message.content] == ["text"] and message.stop_reason == "end_turn"


def test_count_tokens_matches_the_prompt(fake: Live) -> None:
    count = _client(fake).messages.count_tokens(model="fake", messages=USER).input_tokens
    rendered = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert count == len(rendered) - len(START + START + END) + 3  # each special tag is one token
    message = _client(fake).messages.create(model="fake", max_tokens=1, messages=USER)
    assert message.usage.input_tokens == count


def test_x_api_key_and_anthropic_401(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(api_key="secret")
    assert _client(live, "secret").messages.create(model="fake", max_tokens=1, messages=USER).content
    with pytest.raises(anthropic.AuthenticationError) as raised:
        _client(live, "wrong").messages.create(model="fake", max_tokens=1, messages=USER)
    assert raised.value.status_code == 401
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "authentication_error"
    bearer = live.client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": USER},
                              headers={"Authorization": "Bearer secret", "anthropic-version": "2023-06-01"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    # The OpenAI routes keep their own error shape.
    openai_401 = live.client.post("/v1/chat/completions", json={"messages": USER})
    assert openai_401.status_code == 401 and "type" not in openai_401.json()


@pytest.mark.parametrize("body, fragment", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "nope"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
])
def test_anthropic_shaped_400(fake: Live, body: dict[str, Any], fragment: str) -> None:
    r = fake.client.post("/v1/messages", json={"model": "fake", **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]


def test_unknown_model_is_not_found(fake: Live) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        _client(fake).messages.create(model="claude-x", max_tokens=1, messages=USER)
    assert raised.value.body["error"]["type"] == "not_found_error"


def test_bad_json_is_anthropic_shaped(fake: Live) -> None:
    r = fake.client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert json.loads(r.text)["type"] == "error"


def test_routes_in_the_openapi_document(fake: Live) -> None:
    paths = fake.client.get("/openapi.json").json()["paths"]
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= paths.keys()
    ok = paths["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/MessageResponse")


def test_limits_answer_in_anthropic_shape(serve_fake: Callable[..., Live]) -> None:
    # 408 and 413 come from the HTTP layer, before any route: they too speak the route's API.
    from tests.server.test_hardening import raw_request
    live = serve_fake(max_request_body_bytes=1000, timeout_read=0.5)
    r = live.client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": USER * 100})
    assert r.status_code == 413 and r.json() == {"type": "error", "error": {
        "type": "request_too_large", "message": r.json()["error"]["message"]}}
    reply = raw_request(live, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n{\"model\": ")
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["type"] == "error" and "--timeout-read" in body["error"]["message"]
