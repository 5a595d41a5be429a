"""Harmony (gpt-oss) output split into reasoning, content and tool calls: whole, streamed in
pieces of every size (splits inside the special markers included), and over the server routes
(chat completions, Responses, Anthropic Messages) with a scripted model."""

from __future__ import annotations

import pytest

from vkrt.server.harmony import HarmonyParser, parse, template_speaks_harmony

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
    from tests.conftest import FIXTURES

    source = (FIXTURES / "chat_templates" / "gpt_oss.jinja").read_text(encoding="utf-8")
    assert template_speaks_harmony(source)
    assert not template_speaks_harmony((FIXTURES / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8"))
    assert not template_speaks_harmony(None)
