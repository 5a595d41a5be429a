"""Seed-OSS output read into reasoning, content and tool calls: the turn transformers renders
with the model's own template (a thought holding a thinking-budget reflection, then two calls)
read back whole and streamed in pieces of every size, the forcing grammar in its framing, and
the chat, Responses and Anthropic Messages routes over a scripted model whose Seed tags are
special tokens (so they must stay in the text and the grammar must name them by id)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import FIXTURES
from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from tests.server.test_harmony import _stream, messages_api_replies
from tests.server.test_tool_xml import _accepts
from vkrt.engine.guided import GrammarCompiler
from vkrt.server.chat import ChoiceStream, OutputReading
from vkrt.server.generation import Update
from vkrt.server.reasoning import SEED_THINK, THINK, template_tags
from vkrt.server.tools import forcing_grammar, pick_parser
from vkrt.tokenizer import Tokenizer

TEMPLATES = FIXTURES / "chat_templates"
TEMPLATE = (TEMPLATES / "seed_oss.jinja").read_text(encoding="utf-8")
GOLDEN = {r["name"]: r for r in json.loads((TEMPLATES / "golden.json").read_text(encoding="utf-8"))["renders"]}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "units": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"}}}}}
READING = OutputReading("seed_oss", parallel=True, inside=False, tags=SEED_THINK)


def _rendered_turn() -> tuple[str, dict[str, Any]]:
    """The thinking, calling assistant turn of the typed-arguments golden as transformers
    rendered it (what the model writes, up to its EOS), and that message."""
    case = GOLDEN["seed_oss_tool_args_typed"]
    text = case["rendered"]
    start = text.index("<seed:think>")
    [message] = [m for m in case["messages"] if m["role"] == "assistant"]
    return text[start:text.index("<seed:eos>", start)], message


def _read_streamed(text: str, size: int, tools: Any = None) -> tuple[str, str, list[dict[str, Any]], int]:
    """(reasoning, content, calls, argument deltas) of `text` fed `size` characters at a time."""
    stream = ChoiceStream(None, READING, tools)
    reasoning, content, calls, fragments = "", "", [], 0
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        for delta, _, _ in stream.deltas(Update(piece, [], None, "stop" if final else None)):
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls)  # announced once, in order
                    calls.append({"name": call["function"]["name"], "arguments": ""})
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
                fragments += bool(call["function"]["arguments"])
    return reasoning, content, calls, fragments


def test_template_picks_the_seed_parsers() -> None:
    assert pick_parser(TEMPLATE, None) == "seed_oss" and template_tags(TEMPLATE) == SEED_THINK
    qwen = (TEMPLATES / "qwen3_5.jinja").read_text(encoding="utf-8")
    assert pick_parser(qwen, None) == "qwen3_xml" and template_tags(qwen) == THINK


def test_rendered_turn_reads_back_whole_and_streamed() -> None:
    """The thought (its budget reflection kept as written) is the message's reasoning_content,
    the text before the calls its content, and each call's values come back typed by the schema
    from the template's Python spelling (['c', 'f'], {'wind': True}); streamed in pieces of every
    size it adds up to the same, the arguments a parameter at a time."""
    turn, message = _rendered_turn()
    reasoning, content, calls = READING.split(turn, [WEATHER])
    assert reasoning == message["reasoning_content"] and "<seed:cot_budget_reflect>I have used" in reasoning
    assert content == message["content"] and calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    for size in (1, 2, 3, 5, 11, len(turn)):
        streamed_reasoning, streamed_content, streamed_calls, fragments = _read_streamed(turn, size, tools=[WEATHER])
        assert (streamed_reasoning, streamed_content.strip()) == (reasoning, content)
        assert streamed_calls == [{"name": c.name, "arguments": c.arguments} for c in calls]
        if size == 1:
            assert fragments == 7  # four parameters and the brace of the first call, then the second's one and brace


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), [
    ("<seed:think>cut off by max_tok", "cut off by max_tok", "", None),  # all thought
    ("No thought at all.", None, "No thought at all.", None),
    # A call the model only thinks about is no call.
    ("<seed:think>I could write <seed:tool_call>\n<function=now>\n</function>\n</seed:tool_call>.</seed:think>"
     "Nothing to call.", "I could write <seed:tool_call>\n<function=now>\n</function>\n</seed:tool_call>.",
     "Nothing to call.", None),
    ("<seed:tool_call>\n<function=now>\n</function>\n</seed:tool_call>", None, "", [("now", "{}")]),
])
def test_edges_whole_and_streamed(text: str, reasoning: str | None, content: str,
                                  calls: list[tuple[str, str]] | None) -> None:
    whole = READING.split(text, None)
    assert (whole[0], whole[1]) == (reasoning, content)
    assert (None if whole[2] is None else [(c.name, c.arguments) for c in whole[2]]) == calls
    for size in (1, 3, 7):
        got_reasoning, got_content, got_calls, _ = _read_streamed(text, size)
        assert (got_reasoning, got_content) == (reasoning or "", content if calls is None else "")
        assert [(c["name"], c["arguments"]) for c in got_calls] == (calls or [])


def test_forcing_grammar_accepts_the_template_syntax(smollm2_path: Path) -> None:
    """Over a vocabulary that spells the tags as text the grammar's sentences are the
    template's own calls, but for a list or mapping, which it holds to JSON (valid for the
    schema, and read back as the Python spelling is); a missing required parameter, a mistyped
    value, another function or Qwen's framing is refused."""
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    compiler = GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)
    turn, _ = _rendered_turn()
    calls = turn[turn.index("<seed:tool_call>"):]
    assert not _accepts(compiler, tokenizer, forcing_grammar([WEATHER], "*", "seed_oss", parallel=True), calls)
    calls = calls.replace("['c', 'f']", '["c", "f"]').replace("{'wind': True}", '{"wind": true}')
    grammar = forcing_grammar([WEATHER], "*", "seed_oss", parallel=True)
    assert '"<seed:tool_call>"' in grammar.spec and _accepts(compiler, tokenizer, grammar, calls)
    single = forcing_grammar([WEATHER], "get_weather", "seed_oss", parallel=True)
    first = calls[:calls.index("</seed:tool_call>") + len("</seed:tool_call>")]
    assert _accepts(compiler, tokenizer, single, first) and not _accepts(compiler, tokenizer, single, calls)
    head = "<seed:tool_call>\n<function=get_weather>\n"
    for bad in (head + "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>",
                head + "<parameter=city>Paris</parameter>\n<parameter=days>three</parameter>\n</function>\n"
                       "</seed:tool_call>",
                "<seed:tool_call>\n<function=get_time>\n</function>\n</seed:tool_call>",
                "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</tool_call>"):
        assert not _accepts(compiler, tokenizer, single, bad), bad


# ---- over the routes, with a scripted model and Seed-OSS's template --------------------------

USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
THOUGHT = ("<seed:think>Need the weather.\n<seed:cot_budget_reflect>I have used 5 tokens, and there are 507 "
           "tokens remaining for use.</seed:cot_budget_reflect>\nCall it.</seed:think>")
CALL = ("\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>2"
        "</parameter>\n</function>\n</seed:tool_call>")
REASONING = THOUGHT[len("<seed:think>"):-len("</seed:think>")]
ARGUMENTS = '{"city": "Paris", "days": 2}'


def _seed_engine(script: str) -> FakeEngine:
    engine = FakeEngine(max_model_len=4096, script=script)
    engine.tokenizer.chat_template = TEMPLATE
    return engine


def test_chat_tool_call_whole_and_streamed(serve_fake: Callable[..., Live]) -> None:
    """Parsers picked from the template; the tags are special tokens, so the request keeps them
    in its text; a token at a time the stream adds up to the whole reply."""
    live = serve_fake(_seed_engine(THOUGHT + CALL))
    body = {"messages": USER, "max_tokens": 400, "tools": TOOLS}
    r = live.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == REASONING and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": ARGUMENTS}]
    assert choice["finish_reason"] == "tool_calls"
    assert _stream(live, body) == (REASONING, "", {0: {"name": "get_weather", "arguments": ARGUMENTS}}, "tool_calls")
    _, _, params, prompt = live.engine.requests[0]
    assert not params.skip_special_tokens
    assert prompt is not None and "def get_weather(city: str,days: int):" in prompt  # the template's spacing


def test_answer_without_tools_and_budget_zero(serve_fake: Callable[..., Live]) -> None:
    """No tools: the thought is split and a call-like text stays content. thinking_budget 0: the
    prompt closes the thought itself, so the output is all answer."""
    live = serve_fake(_seed_engine(THOUGHT + "\nParis is sunny."))
    [choice] = live.client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 400}).json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Paris is sunny.", "reasoning_content": REASONING}
    live = serve_fake(_seed_engine("Paris is sunny."))
    body = {"messages": USER, "max_tokens": 100, "chat_template_kwargs": {"thinking_budget": 0}}
    [choice] = live.client.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Paris is sunny.", "reasoning_content": None}
    prompt = live.engine.requests[0][3]
    assert prompt is not None and prompt.endswith("</seed:cot_budget_reflect>\n</seed:think>")


def test_explicit_parsers_read_seed_without_its_template(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(FakeEngine(max_model_len=4096, script=THOUGHT + CALL),
                      reasoning_parser="seed_oss", tool_call_parser="seed_oss")
    body = {"messages": USER, "max_tokens": 400, "tools": TOOLS}
    [choice] = live.client.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["message"]["reasoning_content"] == REASONING
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == ARGUMENTS


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_in_seed_framing(serve_fake: Callable[..., Live], tool_choice: Any) -> None:
    """A model that would think first: the grammar opens with the <seed:tool_call> token (by
    id), so the thought is masked away and the call lands, whole and streamed."""
    live = serve_fake(_seed_engine(THOUGHT + CALL))
    body = {"messages": USER, "max_tokens": 400, "tools": TOOLS, "tool_choice": tool_choice}
    r = live.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_weather", "arguments": ARGUMENTS}]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] is None
    assert _stream(live, body)[2] == {0: {"name": "get_weather", "arguments": ARGUMENTS}}
    grammar = live.engine.requests[0][2].guided_decoding
    assert grammar is not None and "<[268]>" in grammar.spec and "<[269]>" in grammar.spec


def test_responses_api_items(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_seed_engine(THOUGHT + CALL))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    tool: Any = {"type": "function", "name": "get_weather", "description": "Weather now",
                 "parameters": TOOLS[0]["function"]["parameters"]}
    response = client.responses.create(model="fake", input="Weather in Paris?", tools=[tool])
    with client.responses.stream(model="fake", input="Weather in Paris?", tools=[tool]) as stream:
        streamed = stream.get_final_response().output
    for output in (response.output, streamed):
        assert [item.type for item in output] == ["reasoning", "function_call"]
        reasoning, call = output
        assert reasoning.content is not None and reasoning.content[0].text == REASONING
        assert (call.name, call.arguments) == ("get_weather", ARGUMENTS)


def test_messages_api_blocks(serve_fake: Callable[..., Live]) -> None:
    for reply in messages_api_replies(serve_fake(_seed_engine(THOUGHT + CALL)), TOOLS[:1], USER, 400):
        assert [block.type for block in reply.content] == ["thinking", "tool_use"]
        assert reply.content[0].thinking == REASONING
        assert reply.content[1].name == "get_weather" and reply.content[1].input == {"city": "Paris", "days": 2}
        assert reply.stop_reason == "tool_use"


@pytest.mark.parametrize(("raw", "value"), [
    ("['c', 'f']", ["c", "f"]), ("{'wind': True, 'rain': None}", {"wind": True, "rain": None}),
    ('["c"]', ["c"]), ("(1, 2)", "(1, 2)"), ("{1, 2}", "{1, 2}"), ("{'a': {1}}", "{'a': {1}}"),
    ("b'x'", "b'x'"), ("1+2j", "1+2j"), ("__import__('os')", "__import__('os')"), ("[" * 5000, "[" * 5000),
])
def test_python_spelled_values(raw: str, value: Any) -> None:
    """A list or mapping in Python's spelling reads as JSON would; anything with no JSON form
    (a tuple, a set, bytes, a complex, code, nesting too deep) stays the text the model wrote."""
    text = f"<seed:tool_call>\n<function=f>\n<parameter=v>{raw}</parameter>\n</function>\n</seed:tool_call>"
    [call] = READING.split(text, None)[2] or []
    assert json.loads(call.arguments) == {"v": value}
