"""Chat completions with n > 1, tool calls streamed as argument fragments, and grammar
compilation off the event loop, over the fake engine (no model)."""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from tests.server.fake_engine import FakeEngine
from tests.server.test_api import sse_events
from vkrt.engine.config import SamplingParams
from vkrt.engine.request import RequestOutput
from vkrt.server.tools import ToolCallStream, parse_tool_calls

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}


def test_chat_n_gives_n_choices_with_derived_seeds(serve_fake: Any) -> None:
    live = serve_fake()
    r = live.client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 40})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "abc" and c["finish_reason"] == "length" for c in body["choices"])
    prompt_tokens = len(live.engine.requests[0][1])
    # The prompt counts once, every choice's tokens count.
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 9,
                             "total_tokens": prompt_tokens + 9, "prompt_tokens_details": {"cached_tokens": 0}}
    seeds = sorted(params.seed for _, _, params, _ in live.engine.requests)
    assert seeds == [40, 41, 42]
    assert len({rid for rid, _, _, _ in live.engine.requests}) == 3


def test_chat_n_streams_every_choice_with_its_index(serve_fake: Any) -> None:
    live = serve_fake()
    r = live.client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    events = sse_events(r)
    *chunks, usage_chunk = events
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in chunks:
        [choice] = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "abc", 1: "abc"} and finishes == {0: "length", 1: "length"}
    roles = [e["choices"][0]["index"] for e in chunks if e["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6


class SlowCompileEngine(FakeEngine):
    """A fake whose request making blocks on a grammar until released, as a big schema's
    compile would."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 *, prompt_text: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        if params.guided_decoding is not None and not self.release.is_set():
            self.entered.set()
            self.release.wait(30)
        return super().generate(prompt, params, request_id, prompt_text=prompt_text)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_grammar_compile_does_not_stall_health(serve_fake: Any, route: str) -> None:
    engine = SlowCompileEngine()
    live = serve_fake(engine)
    body: dict[str, Any] = {"max_tokens": 2, "response_format": {"type": "json_object"}}
    body |= {"prompt": "x"} if route == "/v1/completions" else {"messages": CHAT["messages"]}
    result: list[httpx.Response] = []
    slow = threading.Thread(target=lambda: result.append(live.client.post(route, json=body)))
    slow.start()
    try:
        assert engine.entered.wait(10), "the constrained request was never made"
        # The compile is still running; the loop answers others meanwhile.
        assert live.client.get("/health", timeout=5).status_code == 200
        assert not result
    finally:
        engine.release.set()
        slow.join(30)
    assert result and result[0].status_code == 200, result[0].text if result else "no response"


CALLS = {
    "hermes": 'Let me see.\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a}b\\"c"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "arguments": {"y": -3}}]',
    "llama3_json": '{"name": "f", "parameters": {"x": 12}}; {"name": "g", "parameters": {"y": "z"}}',
}


@pytest.mark.parametrize("parser", sorted(CALLS))
@pytest.mark.parametrize("piece_chars", [1, 3, 8])
def test_streamed_call_deltas_reassemble_to_the_parsed_calls(parser: str, piece_chars: int) -> None:
    """Fed a few characters at a time, the stream announces each call (index, id, type, name)
    once, then sends its arguments in several fragments, joining to the whole-output parse."""
    text = CALLS[parser]
    pieces = [text[i:i + piece_chars] for i in range(0, len(text), piece_chars)]
    stream = ToolCallStream(parser, parallel=True)
    content, calls, fragments = "", {}, 0
    for k, piece in enumerate([*pieces, ""]):
        sent, deltas = stream.feed(piece, final=k == len(pieces))
        content += sent
        for delta in deltas:
            if delta["index"] not in calls:
                assert delta["type"] == "function" and delta["id"].startswith("call_")
                calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
            fragments += 1
    want_content, want_calls = parse_tool_calls(text, parser)
    assert stream.found_calls
    assert content.rstrip() == want_content
    assert [calls[i] for i in sorted(calls)] == [{"name": c.name, "arguments": c.arguments} for c in want_calls]
    assert fragments > len(want_calls)  # arguments came in pieces, not once per call at the end


def test_a_call_parsed_whole_keeps_the_models_argument_text() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"x":1,\n  "y": [true]}}\n</tool_call>'
    [call] = parse_tool_calls(text, "hermes")[1]
    assert call.arguments == '{"x":1,\n  "y": [true]}'


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "</tool_call>"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}]"),
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}"),
])
def test_json_nested_deeper_than_the_decoder_goes_is_text_not_a_crash(parser: str, text: str) -> None:
    """A model that writes "[[[[..." past json's recursion limit gets its text back, no calls."""
    assert parse_tool_calls(text, parser) == (text, [])


def test_without_calls_the_stream_is_all_content() -> None:
    stream = ToolCallStream("hermes", parallel=True)
    sent = [stream.feed(p, final=False) for p in ("Hi <tool", "_ca", "t> there")]
    last = stream.feed("", final=True)
    assert "".join(content for content, _ in [*sent, last]) == "Hi <tool_cat> there"
    assert all(not deltas for _, deltas in [*sent, last]) and not stream.found_calls


def test_only_the_first_call_without_parallel_calls() -> None:
    stream = ToolCallStream("mistral", parallel=False)
    deltas = stream.feed(CALLS["mistral"], final=False)[1] + stream.feed("", final=True)[1]
    assert {d["index"] for d in deltas} == {0}


# Outputs that stop inside their calls, as max_tokens or a stop string leaves them.
UNFINISHED = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a}b', 1),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu', 2),
    ("hermes", 'Hi \n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool', 1),
    ("hermes", 'Hi <tool_call>\n{"na', 0),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "arguments": {"y": -', 2),
    ("mistral", 'Ok [TOOL_CALLS] ', 0),
    ("llama3_json", '{"name": "f", "parameters": {"x": 12}}; {"name": "g", "parameters": {"y": "z', 2),
    ("qwen3_xml", 'A\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\nab', 1),
    ("seed_oss", '<seed:tool_call>\n<function=f>\n<parameter=x>1</parameter>\n</func', 1),
]


def _streamed(parser: str, pieces: list[str]) -> tuple[str, list[dict[str, str]]]:
    """The content and calls (name, arguments joined) a stream fed `pieces` sends."""
    stream = ToolCallStream(parser, parallel=True)
    content, calls = "", {}
    for k, piece in enumerate([*pieces, ""]):
        sent, deltas = stream.feed(piece, final=k == len(pieces))
        content += sent
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser, text, written", UNFINISHED)
def test_a_stream_cut_inside_its_calls_sends_the_whole_parse_whatever_the_split(parser: str, text: str,
                                                                                 written: int) -> None:
    """Split anywhere in two, or a character at a time, the stream joins to the whole parse:
    each call whose name is written, the last with its arguments as far as written; with no
    name written, the text is content."""
    content, calls = parse_tool_calls(text, parser)
    want = (content, [{"name": c.name, "arguments": c.arguments} for c in calls])
    assert all(_streamed(parser, [text[:i], text[i:]]) == want for i in range(len(text) + 1))
    assert _streamed(parser, list(text)) == want
    assert len(calls) == written and (content == text) == (written == 0)  # a cut call is kept, not dropped


def test_a_call_cut_by_max_tokens_is_answered_alike_whole_and_streamed(serve_fake: Any) -> None:
    """Through the route: the call is in message.tool_calls and in the stream's deltas, its
    arguments as far as written, and the finish reason says the output was cut."""
    text = UNFINISHED[0][1]
    live = serve_fake(FakeEngine(max_model_len=2048, script=text + " more"))
    body = {**CHAT, "max_tokens": len(live.engine.tokenizer.encode(text)), "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    [choice] = live.client.post("/v1/chat/completions", json=body).json()["choices"]
    call = {"name": "f", "arguments": '{"x": 1, "s": "a}b'}
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Sure."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [call]
    events = sse_events(live.client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Sure."
    streamed = {"name": "", "arguments": ""}
    for d in deltas:
        for entry in d["delta"].get("tool_calls") or []:
            streamed["name"] += entry["function"].get("name") or ""
            streamed["arguments"] += entry["function"]["arguments"]
    assert streamed == call and deltas[-1]["finish_reason"] == "length"
