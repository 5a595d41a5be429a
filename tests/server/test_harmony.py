"""Harmony (gpt-oss) output split into reasoning, content and tool calls: whole, streamed in
pieces of every size (splits inside the special markers included), and over the server routes
(chat completions, Responses, Anthropic Messages) with a scripted model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import openai
import pytest

from tests.conftest import FIXTURES
from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import sse_events
from vkrt.engine.config import SamplingParams
from vkrt.server.harmony import (
    HarmonyParser,
    forcing_grammar,
    open_header,
    parse,
    template_speaks_harmony,
)

ANSWER = ("<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "note": "a<b|c"}<|call|>')
# The recipient before the channel, as the chat template writes past calls; no stop token.
CALL_RECIPIENT_FIRST = ' to=functions.now<|channel|>commentary json<|message|>{}'
PREAMBLE = ("<|channel|>commentary<|message|>Let me check.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.")


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), [
    (ANSWER, "User asks 2+2. Simple.", "2 + 2 = 4.", []),
    (CALL, "Need the weather tool.", "", [("get_weather", '{"city": "Paris", "note": "a<b|c"}')]),
    (CALL_RECIPIENT_FIRST, None, "", [("now", "{}")]),
    (PREAMBLE, None, "Let me check.\nDone.", []),
    ("<|channel|>analysis<|message|>cut off by max_tok", "cut off by max_tok", "", []),  # all thought
    ("plain text, no header at all", None, "plain text, no header at all", []),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", "a\nb", "c", []),
    # A built-in tool's message (browser, python) is no OpenAI call: dropped.
    ("<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>", None, "", []),
    # What follows a turn's end is not read.
    ("<|channel|>final<|message|>yes<|return|><|start|>assistant<|channel|>final<|message|>no", None, "yes", []),
])
def test_whole_and_streamed(text: str, reasoning: str | None, content: str, calls: list[tuple[str, str]]) -> None:
    assert parse(text) == (reasoning, content, calls)
    for size in (1, 2, 3, 5, 11):
        parser = HarmonyParser()
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)]
        pieces.append(parser.feed("", final=True))
        assert "".join(p.reasoning for p in pieces) == (reasoning or "")
        assert "".join(p.content for p in pieces) == content
        streamed: list[list[str]] = []
        for piece in pieces:
            for index, name, fragment in piece.calls:
                if name is not None:
                    assert index == len(streamed) and fragment == ""
                    streamed.append([name, ""])
                streamed[index][1] += fragment
        assert [tuple(c) for c in streamed] == calls
        assert parser.calls == calls


def test_no_marker_text_leaks_into_a_piece() -> None:
    """Split one character at a time, no piece ever holds part of a special marker."""
    parser = HarmonyParser()
    for ch in CALL + PREAMBLE:
        piece = parser.feed(ch)
        for text in (piece.reasoning, piece.content, *(f for _, _, f in piece.calls)):
            assert "<|" not in text and "|>" not in text


def test_arguments_stream_as_they_are_written() -> None:
    parser = HarmonyParser()
    head = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
    assert parser.feed(head).calls == [(0, "f", "")]
    assert parser.feed('{"x": ').calls == [(0, None, '{"x": ')]
    assert parser.feed("1}<|ca").calls == [(0, None, "1}")]  # "<|ca" may be <|call|>: held
    assert parser.feed("ll|>").calls == []


def test_template_detection() -> None:
    source = (FIXTURES / "chat_templates" / "gpt_oss.jinja").read_text(encoding="utf-8")
    assert template_speaks_harmony(source)
    assert not template_speaks_harmony((FIXTURES / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8"))
    assert not template_speaks_harmony(None)


# ---- over the routes, with a scripted model and gpt-oss's template ----------------------------

TEMPLATE = (FIXTURES / "chat_templates" / "gpt_oss.jinja").read_text(encoding="utf-8")
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "description": "The time"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
RETURN_ID, CALL_ID = 263, 264  # the fake tokenizer's <|return|> and <|call|>


def _harmony_engine(script: str | Callable[[SamplingParams], str]) -> FakeEngine:
    engine = FakeEngine(max_model_len=2048, script=script)
    engine.tokenizer.chat_template = TEMPLATE
    return engine


def _stream(live: Live, body: dict[str, Any]) -> tuple[str, str, dict[int, dict[str, str]], str | None]:
    """(reasoning, content, calls by index, finish_reason) of a streamed chat completion."""
    reasoning, content, calls, finish = "", "", {}, None
    for event in sse_events(live.client.post("/v1/chat/completions", json={**body, "stream": True})):
        [choice] = event["choices"]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_chat_answer_whole_and_streamed(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(ANSWER))
    body = {"messages": USER, "max_tokens": 200}
    r = live.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["message"]["reasoning_content"] == "User asks 2+2. Simple."
    assert choice["message"]["content"] == "2 + 2 = 4." and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == RETURN_ID  # <|return|> ended the turn, its text left out
    assert _stream(live, body) == ("User asks 2+2. Simple.", "2 + 2 = 4.", {}, "stop")
    _, _, params, prompt = live.engine.requests[0]
    assert not params.skip_special_tokens and {RETURN_ID, CALL_ID} <= set(params.stop_token_ids)
    assert prompt is not None and prompt.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")


def test_chat_tool_call_whole_and_streamed(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(CALL))
    body = {"messages": USER, "max_tokens": 200, "tools": TOOLS}
    [choice] = live.client.post("/v1/chat/completions", json=body).json()["choices"]
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "Need the weather tool."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "note": "a<b|c"}'}
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] == CALL_ID
    reasoning, content, calls, finish = _stream(live, body)
    assert (reasoning, content, finish) == ("Need the weather tool.", "", "tool_calls")
    assert calls == {0: call["function"]}
    # The tools reached the prompt as harmony's TypeScript namespace.
    prompt = live.engine.requests[0][3]
    assert prompt is not None and "namespace functions {" in prompt and "type get_weather = (_: {" in prompt


def test_without_tools_a_call_is_not_answered(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(CALL))
    [choice] = live.client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 200}).json()["choices"]
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == "Need the weather tool."


def test_reasoning_parser_none_leaves_the_analysis_out(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(ANSWER), reasoning_parser="none")
    [choice] = live.client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 200}).json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "2 + 2 = 4."}


def test_explicit_parser_reads_harmony_without_its_template(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(FakeEngine(max_model_len=512, script=ANSWER), reasoning_parser="harmony")
    [choice] = live.client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 200}).json()["choices"]
    assert choice["message"]["content"] == "2 + 2 = 4."


# A model that would think first: the grammar skips what does not fit the forced call's framing.
THINKING_CALL = ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant"
                 '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_in_harmony_framing(serve_fake: Callable[..., Live], tool_choice: Any) -> None:
    live = serve_fake(_harmony_engine(THINKING_CALL))
    body = {"messages": USER, "max_tokens": 200, "tools": TOOLS, "tool_choice": tool_choice}
    r = live.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] is None
    assert _stream(live, body)[2] == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_forcing_grammar_holds_the_arguments_to_the_schema() -> None:
    grammar = forcing_grammar(TOOLS, "now", max_digits=16)
    assert "call1" in grammar and "call0" not in grammar  # only the named function
    assert grammar.startswith("start: <|channel|>") and grammar.split("\n")[0].endswith("<|call|>")


def test_responses_api_items(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(CALL))
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    tool: Any = {"type": "function", "name": "get_weather", "description": "Weather now",
                 "parameters": TOOLS[0]["function"]["parameters"]}
    response = client.responses.create(model="fake", input="Weather in Paris?", tools=[tool])
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    with client.responses.stream(model="fake", input="Weather in Paris?", tools=[tool]) as stream:
        streamed = stream.get_final_response().output
    for output in (response.output, streamed):
        reasoning, call = output
        assert reasoning.content is not None and reasoning.content[0].text == "Need the weather tool."
        assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris", "note": "a<b|c"}')


def messages_api_replies(live: Live, tools: list[Any], messages: Any, max_tokens: int) -> list[Any]:
    """One turn offering the OpenAI-style `tools` through the anthropic SDK, whole and streamed."""
    anthropic = pytest.importorskip("anthropic", reason="anthropic is a dev extra (pip install -e .[dev])")
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=30)
    offered: Any = [{"name": t["function"]["name"], "description": t["function"]["description"],
                     "input_schema": t["function"]["parameters"]} for t in tools]
    message = client.messages.create(model="fake", max_tokens=max_tokens, messages=messages, tools=offered)
    with client.messages.stream(model="fake", max_tokens=max_tokens, messages=messages, tools=offered) as stream:
        return [message, stream.get_final_message()]


def test_messages_api_blocks(serve_fake: Callable[..., Live]) -> None:
    for reply in messages_api_replies(serve_fake(_harmony_engine(CALL)), TOOLS[:1], USER, 200):
        assert [block.type for block in reply.content] == ["thinking", "tool_use"]
        assert reply.content[0].thinking == "Need the weather tool."
        assert reply.content[1].name == "get_weather" and reply.content[1].input == {"city": "Paris", "note": "a<b|c"}
        assert reply.stop_reason == "tool_use"


def test_a_prompt_that_leaves_a_message_open() -> None:
    """continue_final_message: the prompt ends inside the final message, so the output is its body."""
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>The answer is"
    opened = open_header(prompt)
    assert opened == "assistant<|channel|>final"
    assert parse(" 4.<|end|>", opened) == (None, " 4.", [])
    thought = open_header("<|start|>assistant<|channel|>analysis<|message|>so")
    assert parse(" far<|end|><|start|>assistant<|channel|>final<|message|>4", thought) == (" far", "4", [])
    assert open_header("<|start|>user<|message|>Hi<|end|><|start|>assistant") is None
    assert open_header("<|start|>assistant<|channel|>final<|message|>done<|end|>") is None


def test_continue_final_message_over_the_route(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(" 4.<|end|>"))
    body = {"messages": [*USER, {"role": "assistant", "content": "The answer is"}], "max_tokens": 50,
            "add_generation_prompt": False, "continue_final_message": True}
    [choice] = live.client.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["message"]["content"] == " 4." and choice["message"]["reasoning_content"] is None
    assert _stream(live, body)[:2] == ("", " 4.")


def test_forcing_grammar_over_a_real_tokenizer() -> None:
    """llguidance indexing an HF tokenizer.json (as for a real model): the grammar's `<|...|>`
    match the special tokens, never their spelling in bytes, and a call through them completes it;
    the turn's ends become stop tokens and the markers stay in the decoded text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from vkrt.engine.guided import GrammarCompiler
    from vkrt.server import harmony
    from vkrt.server.tools import forcing_grammar as tool_grammar
    from vkrt.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    markers = [harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.END, harmony.RETURN, harmony.CALL,
               harmony.CONSTRAIN, "<|endoftext|>"]
    hf.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    eos = hf.token_to_id("<|endoftext|>")
    tok = Tokenizer(hf, bos_token_id=None, eos_token_ids=[eos], chat_template=TEMPLATE, byte_level=True)

    params = harmony.sampling_params(SamplingParams(stop_token_ids=[7]), tok)
    assert params.stop_token_ids == [7, hf.token_to_id("<|return|>"), hf.token_to_id("<|call|>")]
    assert not params.skip_special_tokens
    call = CALL[CALL.index("<|start|>assistant") + len("<|start|>assistant"):]
    ids = tok.encode(call, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == call

    compiler = GrammarCompiler(tok, hf.get_vocab_size(), [eos])
    guide = compiler.compile(tool_grammar(TOOLS, "get_weather", "harmony", parallel=True))
    mask = np.zeros(compiler.words, np.uint32)
    guide.fill_mask(mask)
    allowed = {t for t in range(hf.get_vocab_size()) if mask[t // 32] >> np.uint32(t % 32) & np.uint32(1)}
    assert allowed == {hf.token_to_id("<|channel|>")}  # not the byte "<"
    assert all(guide.advance(t) for t in ids) and guide.is_complete


def test_a_call_the_prompt_opened_is_announced_with_the_first_piece() -> None:
    header = "assistant<|channel|>commentary to=functions.f json"
    parser = HarmonyParser(header)
    assert parser.feed('{"x"').calls == [(0, "f", ""), (0, None, '{"x"')]
    assert parse('{"x": 1}', header) == (None, "", [("f", '{"x": 1}')])


def test_reasoning_effort_reaches_the_template(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(_harmony_engine(ANSWER))
    chat = {"messages": USER, "max_tokens": 5}
    for extra, want in [({}, "medium"), ({"reasoning_effort": "high"}, "high"),
                        ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}, "low")]:
        assert live.client.post("/v1/chat/completions", json={**chat, **extra}).status_code == 200
        assert f"\nReasoning: {want}\n" in (live.engine.requests[-1][3] or "")
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    client.responses.create(model="fake", input="hi", reasoning={"effort": "low"}, max_output_tokens=5)
    assert "\nReasoning: low\n" in (live.engine.requests[-1][3] or "")
    r = live.client.post("/v1/chat/completions", json={**chat, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and "reasoning_effort" in r.text
