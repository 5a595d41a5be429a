"""Qwen3.5's XML tool calls (parser "qwen3_xml"): the calls transformers renders with the
model's own template read back to the same arguments, streamed deltas that reassemble to the
non-streamed calls, a forcing grammar that accepts that rendering and refuses what breaks the
schema, and forced calls from a live server that parse and are valid.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.live_model import LiveModel, live_model
from vkrt.engine.guided import GrammarCompiler
from vkrt.server.tools import (
    ToolCall,
    ToolCallStream,
    forcing_grammar,
    parse_tool_calls,
    pick_parser,
)
from vkrt.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
GOLDEN = {r["name"]: r for r in json.loads((TEMPLATES / "golden.json").read_text(encoding="utf-8"))["renders"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "units": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"}}}}}


def _rendered_calls() -> tuple[str, list[dict[str, Any]]]:
    """The assistant turn of the typed-arguments golden as transformers rendered it, and the
    calls that conversation holds."""
    case = GOLDEN["qwen3_5_tool_args_typed"]
    text = case["rendered"]
    start = text.index("Let me look.")
    turn = text[start:text.index("<|im_end|>", start)]
    [assistant] = [m for m in case["messages"] if m["role"] == "assistant"]
    return turn, [call["function"] for call in assistant["tool_calls"]]


def test_template_picks_the_xml_parser() -> None:
    template = (TEMPLATES / "qwen3_5.jinja").read_text(encoding="utf-8")
    assert pick_parser(template, None) == "qwen3_xml"
    assert pick_parser((TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"), None) == "hermes"


def test_rendered_calls_read_back_to_their_arguments() -> None:
    """Strings bare, an integer, a list and a mapping as the template writes them: each comes
    back as the value the conversation held."""
    turn, calls = _rendered_calls()
    content, parsed = parse_tool_calls(turn, "qwen3_xml", [WEATHER])
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]
    # Without the schema a value that reads as JSON is taken as JSON; a string stays text.
    _, untyped = parse_tool_calls(turn, "qwen3_xml")
    assert json.loads(untyped[0].arguments)["days"] == 3 and json.loads(untyped[1].arguments) == {"city": "Lyon"}
    # A string parameter keeps digits as text; Python's booleans read as booleans.
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n007\n</parameter>\n<parameter=flag>\nTrue\n"
            "</parameter>\n</function>\n</tool_call>")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "flag": {"type": "boolean"}}}}}
    [call] = parse_tool_calls(text, "qwen3_xml", [tool])[1]
    assert json.loads(call.arguments) == {"code": "007", "flag": True}
    for broken in ("no call", "<function=f>", "<tool_call>\n<function=f"):
        assert parse_tool_calls(broken, "qwen3_xml", [tool]) == (broken, [])
    # Cut inside the call (max_tokens): kept, its arguments as far as its closed parameters go.
    cut = "Hm <tool_call>\n<function=f>\n<parameter=code>\n1\n</parameter>\n<parameter=fl"
    assert parse_tool_calls(cut, "qwen3_xml", [tool]) == ("Hm", [ToolCall("f", '{"code": "1"')])


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_calls_reassemble(step: int) -> None:
    """Fed a few characters at a time: content up to the first call, each call announced once
    with its name, its arguments in one piece when it closes, equal to the parsed calls."""
    turn, _ = _rendered_calls()
    stream = ToolCallStream("qwen3_xml", parallel=True, tools=[WEATHER])
    content, calls = "", {}
    pieces = [turn[i:i + step] for i in range(0, len(turn), step)]
    for i, piece in enumerate(pieces):
        sent, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += sent
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
            if "id" in delta:
                assert call["name"] is None  # announced once
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    expected = parse_tool_calls(turn, "qwen3_xml", [WEATHER])[1]
    assert content.rstrip() == "Let me look."
    assert [calls[i] for i in sorted(calls)] == [{"name": c.name, "arguments": c.arguments} for c in expected]


def _accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar: Any, text: str) -> bool:
    guide = compiler.compile(grammar)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not guide.advance(token):
            return False
    return bool(guide._matcher.is_accepting())


def test_forcing_grammar_accepts_the_template_syntax(smollm2_path: Path) -> None:
    """The grammar's sentences are the template's own call syntax; a missing required
    parameter, a value of the wrong type or another function's name are refused."""
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    compiler = GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)
    grammar = forcing_grammar([WEATHER], "*", "qwen3_xml", parallel=True)
    turn, _ = _rendered_calls()
    calls = turn[turn.index("<tool_call>"):]
    assert _accepts(compiler, tokenizer, grammar, calls)
    single = forcing_grammar([WEATHER], "*", "qwen3_xml", parallel=False)
    first = calls[:calls.index("</tool_call>") + len("</tool_call>")]
    assert _accepts(compiler, tokenizer, single, first)
    assert not _accepts(compiler, tokenizer, single, calls)  # a second call needs parallel
    named = forcing_grammar([WEATHER], "get_weather", "qwen3_xml", parallel=True)
    assert _accepts(compiler, tokenizer, named, first)
    assert not _accepts(compiler, tokenizer, named, calls)  # a named choice is one call
    head = "<tool_call>\n<function=get_weather>\n"
    for bad in (head + "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",  # no city
                head + "<parameter=city>\nParis\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
                       "</function>\n</tool_call>",
                "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"):
        assert not _accepts(compiler, tokenizer, single, bad), bad


TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 16},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
]


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=1024, max_num_seqs=4, tool_call_parser="qwen3_xml") as server:
        yield server


def test_forced_call_from_a_live_server(live: LiveModel) -> None:
    """tool_choice "required" with --tool-call-parser qwen3_xml: the call parses, its
    arguments are valid for the schema, and the same seed streamed gives the same call."""
    client = live.async_client()
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "seed": 5, "max_tokens": 96}

    async def both() -> tuple[Any, dict[str, str]]:
        reply = await client.chat.completions.create(**body)
        streamed = {"name": "", "arguments": ""}
        async for chunk in await client.chat.completions.create(**body, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or []:
                streamed["name"] += delta.function.name or ""
                streamed["arguments"] += delta.function.arguments or ""
        return reply, streamed

    reply, streamed = asyncio.run(both())
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and {"city", "unit"} <= set(args) <= {"city", "unit", "days"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 16 and args["unit"] in ("celsius", "fahrenheit")
    assert "days" not in args or (type(args["days"]) is int and 1 <= args["days"] <= 7)
    assert streamed == {"name": call.function.name, "arguments": call.function.arguments}
