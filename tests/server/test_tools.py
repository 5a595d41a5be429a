"""Tool calling over /v1/chat/completions against a live server over the real SmolLM2, with
the official openai client: forced calls valid for their schema, streamed deltas that
reassemble to the same call, a tool result sent back, and the 400s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.server.live_model import LiveModel, live_model
from vkrt.chat_template import ChatTemplate
from vkrt.server.tools import ToolCall, parse_tool_calls, pick_parser, template_messages

UNITS = ["celsius", "fahrenheit"]
TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 16},
                                      "unit": {"type": "string", "enum": UNITS}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["offset_hours"],
                       "properties": {"offset_hours": {"type": "integer", "minimum": -12, "maximum": 14}}}}},
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_arguments(name: str, arguments: str) -> bool:
    """The arguments checked against the schemas above by hand."""
    args = json.loads(arguments)
    if name == "get_weather":
        return (set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 16
                and args["unit"] in UNITS)
    return set(args) == {"offset_hours"} and type(args["offset_hours"]) is int and -12 <= args["offset_hours"] <= 14


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=1024, max_num_seqs=8) as server:
        yield server


def _client(live: LiveModel) -> openai.AsyncOpenAI:
    return live.async_client(timeout=900)


def test_parsers_read_each_syntax() -> None:
    """Each family's call syntax, as its model card writes it, parses to OpenAI's shape."""
    hermes = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert parse_tool_calls(hermes, "hermes") == ("Let me look.", [_call("f", {"x": 1})])
    mistral = '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    assert parse_tool_calls(mistral, "mistral") == ("", [_call("f", {"x": 1}), _call("g", {})])
    llama = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "z"}}'
    assert parse_tool_calls(llama, "llama3_json") == ("", [_call("f", {"x": 1}), _call("g", {"y": "z"})])
    for text, parser in (("no call here", "hermes"), ("<tool_call>{oops</tool_call>", "hermes"),
                         ("The answer is {1}", "llama3_json"), ("[TOOL_CALLS] nothing", "mistral")):
        assert parse_tool_calls(text, parser) == (text, [])


def _call(name: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(name, json.dumps(arguments))


def test_required_round_trip_streamed_and_named(live: LiveModel) -> None:
    """tool_choice="required" gives a call valid for its schema; the same seed streamed
    reassembles to the same call; a named choice forces that function; the tool's result
    sent back gets an answer."""
    client = _client(live)

    async def call(**kwargs: Any) -> Any:
        return (await client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS,
                                                     max_tokens=80, temperature=0.8, **kwargs)).choices[0]

    async def streamed(**kwargs: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
        calls, finish, content = await _streamed_calls(client, max_tokens=80, temperature=0.8, **kwargs)
        return calls[0], finish[0], content[0]

    async def run() -> list[Any]:
        return await asyncio.gather(
            call(tool_choice="required", seed=11, parallel_tool_calls=False),
            streamed(tool_choice="required", seed=11, parallel_tool_calls=False),
            call(tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=12,
                 parallel_tool_calls=False),
            call(tool_choice="required", seed=13),
        )

    required, (stream_calls, stream_finish, stream_content), named, parallel = asyncio.run(run())
    assert required.finish_reason == "tool_calls"
    [tool_call] = required.message.tool_calls
    assert tool_call.type == "function" and tool_call.id
    assert _valid_arguments(tool_call.function.name, tool_call.function.arguments)
    assert stream_finish == "tool_calls" and stream_content == ""
    assert stream_calls == {0: {"name": tool_call.function.name, "arguments": tool_call.function.arguments,
                                "fragments": stream_calls[0]["fragments"]}}
    # The arguments came as they were generated, not in one piece at the end.
    assert int(stream_calls[0]["fragments"]) > 1
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    assert _valid_arguments("get_time", named.message.tool_calls[0].function.arguments)
    # Parallel calls: the grammar allows more after each; every complete one is valid (max_tokens
    # may cut the last, which is then kept with its arguments as far as written).
    calls = parallel.message.tool_calls
    complete = calls if parallel.finish_reason == "tool_calls" else calls[:-1]
    assert calls and all(_valid_arguments(c.function.name, c.function.arguments) for c in complete)

    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
               {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps({"result": "sunny, 21"})}]
    answer = asyncio.run(_client(live).chat.completions.create(  # a client per event loop
        model="smollm2", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, seed=14))
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


async def _streamed_calls(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[
        dict[int, dict[int, dict[str, str]]], dict[int, str | None], dict[int, str]]:
    """Per choice index: the tool calls reassembled from the deltas (with how many argument
    fragments each came in), the finish reason and the content."""
    calls: dict[int, dict[int, dict[str, str]]] = {}
    finish: dict[int, str | None] = {}
    content: dict[int, str] = {}
    async for chunk in await client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS,
                                                            stream=True, **kwargs):
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(choice.index, {}).setdefault(
                    delta.index, {"name": "", "arguments": "", "fragments": "0"})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                if delta.function.arguments:
                    entry["fragments"] = str(int(entry["fragments"]) + 1)
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    return calls, finish, content


def test_chat_n_choices_reproducible_streamed_and_each_called(live: LiveModel) -> None:
    """n=3 gives three choices, the same again for the same seed, choice k sampling with seed + k,
    streamed as non-streamed; with a forced tool call each choice holds its own valid call."""
    client = _client(live)
    sampled: dict[str, Any] = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 10, "temperature": 1.0}

    async def stream_texts(**kwargs: Any) -> dict[int, str]:
        texts: dict[int, str] = {}
        async for chunk in await client.chat.completions.create(stream=True, **sampled, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        return texts

    forced: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80,
                              "temperature": 0.8, "n": 2, "seed": 23}

    async def run() -> list[Any]:
        return await asyncio.gather(
            client.chat.completions.create(n=3, seed=21, logprobs=True, **sampled),
            client.chat.completions.create(n=3, seed=21, logprobs=True, **sampled),
            client.chat.completions.create(seed=22, **sampled),
            stream_texts(n=3, seed=21),
            client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS, **forced),
            _streamed_calls(client, **forced),
        )

    n3, n3_again, seed22, streamed, called, (stream_calls, stream_finish, _) = asyncio.run(run())
    texts = [c.message.content for c in n3.choices]
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in n3_again.choices]
    assert texts[1] == seed22.choices[0].message.content
    assert len(set(texts)) > 1  # the seeds differ, so do the samples
    assert streamed == dict(enumerate(texts))
    assert n3.usage.prompt_tokens == seed22.usage.prompt_tokens  # the prompt counts once
    assert n3.usage.completion_tokens == sum(len(c.logprobs.content) for c in n3.choices)

    assert [c.index for c in called.choices] == [0, 1]
    for choice in called.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert _valid_arguments(call.function.name, call.function.arguments)
        assert stream_finish[choice.index] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in stream_calls[choice.index].values()] == [
            (call.function.name, call.function.arguments)]


def test_chat_choices_share_the_prompt_blocks(live: LiveModel) -> None:
    """The n choices of a chat request compute its prompt once: the siblings find every full
    block before their last prompt token in the prefix cache."""
    messages = [{"role": "user", "content": "Lyon lies where the Rhone meets the Saone; list, one per line, "
                 "five things a visitor should see there, and say why each is worth the time it takes."}]
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=900)
    hits_before = live.engine.metrics().prefix_cache_hits
    response = client.chat.completions.create(model="smollm2", messages=messages, n=3, max_tokens=2, seed=1)
    hits = live.engine.metrics().prefix_cache_hits - hits_before
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    num_prompt = response.usage.prompt_tokens
    full_blocks = (num_prompt - 1) // 16 * 16  # EngineConfig's block size, which live_model keeps
    # The first choice may reuse blocks earlier requests left (the template's system prompt).
    assert hits == response.usage.prompt_tokens_details.cached_tokens + 2 * full_blocks
    assert full_blocks > 2 * 16


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "frobnicate"}}}}}]}, "tools.0.function.parameters"),
])
def test_bad_tools_are_400(live: LiveModel, body: dict[str, Any], param: str) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=900)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2, extra_body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2).choices[0].message.content


# Qwen 2.5's handling of tools and tool calls, cut down to the parts under test.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for tool_call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tool_call.function.name }}\", "
    "\"arguments\": {{ tool_call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
)


def test_tools_and_history_reach_the_template() -> None:
    """The template sees the tools, and a call's JSON-text arguments as an object, so the
    rendered call is the syntax the model was trained on (not a quoted string)."""
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    text = ChatTemplate(QWEN_TOOLS_TEMPLATE).render(template_messages(history), tools=TOOLS,
                                                    add_generation_prompt=False)
    assert '"name": "get_weather", "description": "The current weather in a city"' in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>') in text
    assert "<tool_response>\n21\n</tool_response>" in text


def test_parser_picked_by_template_or_flag() -> None:
    assert pick_parser(QWEN_TOOLS_TEMPLATE, None) == "hermes"
    assert pick_parser("{{ '[TOOL_CALLS]' }}", None) == "mistral"
    assert pick_parser("{{ '<|python_tag|>' }}{% if m.role == 'ipython' %}{% endif %}", None) == "llama3_json"
    assert pick_parser("{{ messages }}", None) == "hermes"
    assert pick_parser(QWEN_TOOLS_TEMPLATE, "mistral") == "mistral"


# ---- forced calls over a scripted model ---------------------------------------------------
# The fake engine writes a script, except where the grammar's mask refuses a token: what the
# server's forcing grammar lets through is then exactly what a model trying to write the
# script could write, deterministically.

PARIS = {"city": "Paris", "unit": "celsius"}
JSON_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
            "celsius\n</parameter>\n</function>\n</tool_call>")
# Seed-OSS's framing: its tags are special tokens of the fake vocabulary, as the grammar must know.
SEED_CALL = ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=unit>"
             "celsius</parameter>\n</function>\n</seed:tool_call>")
PARSERS = ["hermes", "qwen3_xml", "seed_oss", "mistral", "llama3_json"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _calls(parser: str, n: int) -> str:
    """n calls of get_weather(Paris, celsius) in `parser`'s syntax, as a model writes them."""
    if parser == "hermes":
        return "\n".join([f"<tool_call>\n{JSON_CALL}\n</tool_call>"] * n)
    if parser in ("qwen3_xml", "seed_oss"):
        return "\n".join([XML_CALL if parser == "qwen3_xml" else SEED_CALL] * n)
    if parser == "mistral":
        return "[TOOL_CALLS][" + ",".join([JSON_CALL] * n) + "]"
    return ";".join([JSON_CALL.replace('"arguments"', '"parameters"')] * n)


def _scripted(serve_fake: Any, script: str, parser: str) -> openai.OpenAI:
    from tests.server.fake_engine import FakeEngine

    live = serve_fake(FakeEngine(max_model_len=2048, script=script), tool_call_parser=parser)
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The calls of the reply ((name, arguments decoded)), and its finish reason, streamed or not."""
    body: dict[str, Any] = {"model": "fake", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1500, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []], \
            choice.finish_reason
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", PARSERS)
def test_named_choice_is_one_call_then_the_turn_ends(serve_fake: Any, parser: str, stream: bool) -> None:
    """A model that would go on calling get_weather (three calls scripted) gets exactly one
    call under a named tool_choice, parallel_tool_calls or not, and the turn ends there."""
    client = _scripted(serve_fake, _calls(parser, 3), parser)
    for parallel in (True, False):
        calls, finish = _ask(client, stream, tool_choice=NAMED, parallel_tool_calls=parallel)
        assert calls == [("get_weather", PARIS)] and finish == "tool_calls", (parallel, calls, finish)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", PARSERS)
def test_required_is_at_least_one_call_and_may_stop_after_any(serve_fake: Any, parser: str, stream: bool) -> None:
    """"required": the model may end its turn after any complete call (one scripted: one call,
    "tool_calls"), write several with parallel_tool_calls (two scripted: two), and with
    parallel_tool_calls false it gets one whatever it would write."""
    call = _calls(parser, 1)
    one = _scripted(serve_fake, call + "<eos>", parser)
    assert _ask(one, stream, tool_choice="required") == ([("get_weather", PARIS)], "tool_calls")
    two = _scripted(serve_fake, _calls(parser, 2) + "<eos>", parser)
    assert _ask(two, stream, tool_choice="required") == ([("get_weather", PARIS)] * 2, "tool_calls")
    assert _ask(two, stream, tool_choice="required", parallel_tool_calls=False) == (
        [("get_weather", PARIS)], "tool_calls")
    # Chatter after a call is not a call's start: masked away, the turn ends with one call.
    chatty = _scripted(serve_fake, call + " All done, it is sunny!", parser)
    assert _ask(chatty, stream, tool_choice="required") == ([("get_weather", PARIS)], "tool_calls")


class Forecast(BaseModel):
    """The LOOSE tool's parameters as pydantic checks them: no other keys, each typed."""

    model_config = ConfigDict(extra="forbid", strict=True)
    city: str
    unit: Literal["celsius", "fahrenheit"]
    days: int | None = None
    where: dict[str, str] | None = None


# A schema that says nothing of additionalProperties: the forced grammar is strict anyway.
LOOSE: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": UNITS}, "days": {"type": "integer"},
                   "where": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}}}]


# get_weather of the issue: city and unit only, additionalProperties not said.
CITY_UNIT: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": UNITS}}}}}]


def _forced_arguments(serve_fake: Any, parser: str, script: str, tools: list[Any] = LOOSE, **config: Any) -> str:
    from tests.server.fake_engine import FakeEngine

    live = serve_fake(FakeEngine(max_model_len=2048, script=script), tool_call_parser=parser, **config)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
    choice = client.chat.completions.create(model="fake", messages=MESSAGES, tools=tools, tool_choice=NAMED,
                                            max_tokens=1500).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    return call.function.arguments


def test_forced_arguments_take_no_property_outside_the_schema(serve_fake: Any) -> None:
    """A model that writes "unit_type" beside city and unit (and "zip" inside an object that
    lists only city) cannot: the mask refuses the extra keys, and the arguments validate
    against the schema, closed. A required property the model skips is written after all."""
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    extra = head + '{"city": "Paris", "unit": "celsius", "unit_type": "weather"}}\n</tool_call>'
    arguments = _forced_arguments(serve_fake, "hermes", extra, CITY_UNIT)
    assert Forecast.model_validate_json(arguments) == Forecast(city="Paris", unit="celsius")
    nested = head + '{"city": "Paris", "unit": "celsius", "where": {"city": "Paris", "zip": "75001"}}}\n</tool_call>'
    arguments = _forced_arguments(serve_fake, "hermes", nested)
    assert Forecast.model_validate_json(arguments).where == {"city": "Paris"}
    # "unit" is required: the object cannot close after city, so the model's later "unit" lands.
    missing = head + '{"city": "Paris"}, "unit": "fahrenheit"}}\n</tool_call>'
    assert Forecast.model_validate_json(_forced_arguments(serve_fake, "hermes", missing)).unit == "fahrenheit"

    xml = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
           '</parameter>\n<parameter=where>\n{"city": "Lyon", "zip": "69001"}\n</parameter>\n'
           "<parameter=unit_type>\nweather\n</parameter>\n</function>\n</tool_call>")
    arguments = _forced_arguments(serve_fake, "qwen3_xml", xml)
    assert Forecast.model_validate_json(arguments) == Forecast(city="Paris", unit="celsius", where={"city": "Lyon"})


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml"])
def test_forced_integer_ends_at_16_digits(serve_fake: Any, parser: str) -> None:
    """An integer argument with no bounds in its schema takes at most 16 digits (the 17th is
    masked), so a model writing 1111... ends its call; --json-max-digits 0 lifts the bound."""
    ones = "1" * 30
    if parser == "hermes":
        script = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", '
                  f'"days": {ones}}}}}\n</tool_call>')
    else:
        script = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                  f"celsius\n</parameter>\n<parameter=days>\n{ones}\n</parameter>\n</function>\n</tool_call>")
    assert Forecast.model_validate_json(_forced_arguments(serve_fake, parser, script)).days == int("1" * 16)
    unbounded = _forced_arguments(serve_fake, parser, script, json_max_digits=0)
    assert Forecast.model_validate_json(unbounded).days == int(ones)



@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_call_tags_that_are_special_tokens_stay_in_the_text(serve_fake: Any, parser: str, stream: bool) -> None:
    """The fake's <tool_call>, </tool_call> and [TOOL_CALLS] are special tokens: decoded with
    special tokens skipped (the request default) the reply would hold bare JSON and no call.
    The request keeps them, so an unforced call is read, and a forced one names them by id."""
    from tests.server.fake_engine import SPECIALS, FakeEngine

    live = serve_fake(FakeEngine(max_model_len=2048, script=_calls(parser, 1) + "<eos>"), tool_call_parser=parser)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert _ask(client, stream) == ([("get_weather", PARIS)], "tool_calls")
    assert not live.engine.requests[0][2].skip_special_tokens
    assert _ask(client, stream, tool_choice=NAMED) == ([("get_weather", PARIS)], "tool_calls")
    grammar = live.engine.requests[1][2].guided_decoding
    tags = ["<tool_call>", "</tool_call>"] if parser == "hermes" else ["[TOOL_CALLS]"]
    ids = {text: i for i, text in SPECIALS.items()}
    assert grammar is not None and all(f"<[{ids[tag]}]>" in grammar.spec and tag not in grammar.spec for tag in tags)
