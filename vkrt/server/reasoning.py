"""Reasoning content: the `<think>...</think>` part of a thinking model's output (Qwen3,
DeepSeek-R1 style), split from the answer as vLLM's `reasoning_content`.

A template that opens the thought itself (the generation prompt ends with `<think>`) makes
the output start inside it; otherwise the output is thought only if it opens with `<think>`.
An output cut before `</think>` is all thought.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    """True when the chat template knows the think tags (the parser is then on by default)."""
    return bool(chat_template) and CLOSE in (chat_template or "")


def starts_inside(prompt: str | None) -> bool:
    """True when the rendered prompt leaves the model inside an open thought."""
    return prompt is not None and prompt.rstrip().endswith(OPEN)


def _held(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that may be the beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits streamed output into (reasoning, content) pieces as it arrives."""

    def __init__(self, inside: bool) -> None:
        self._state = "thinking" if inside else "start"
        self._pending = ""
        self._after_thought = False  # the newlines a model writes after </think> are not content

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that `text` (appended to what came before) settles."""
        self._pending += text
        reasoning, content = "", ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(OPEN):
                self._state, self._pending = "thinking", stripped[len(OPEN):]
            elif OPEN.startswith(stripped) and not final:
                return "", ""  # may still become the opening tag
            else:
                self._state = "content"
        if self._state == "thinking":
            cut = self._pending.find(CLOSE)
            if cut >= 0:
                reasoning, self._pending = self._pending[:cut], self._pending[cut + len(CLOSE):]
                self._state, self._after_thought = "content", True
            else:
                keep = 0 if final else _held(self._pending, CLOSE)
                reasoning = self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return reasoning, ""
        if self._state == "content":
            content, self._pending = self._pending, ""
            if self._after_thought:
                content = content.lstrip("\n")
                self._after_thought = not content
        return reasoning, content


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning or None when the output has no thought, content) of a whole output."""
    splitter = ReasoningSplitter(inside)
    reasoning, content = splitter.feed(text, final=True)
    thought = inside or text.lstrip().startswith(OPEN)
    return (reasoning if thought else None), content
