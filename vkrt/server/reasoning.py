"""Reasoning content: the thought of a thinking model's output (`<think>...</think>` in Qwen3
and DeepSeek-R1, `<seed:think>...</seed:think>` in Seed-OSS), split from the answer as vLLM's
`reasoning_content`.

A template that opens the thought itself (the generation prompt ends with the opening tag) makes
the output start inside it; otherwise the output is thought only if it opens with that tag.
An output cut before the closing tag is all thought. Seed-OSS's thinking-budget reflections
(`<seed:cot_budget_reflect>I have used 129 tokens...</seed:cot_budget_reflect>`, written inside
the thought) stay in the thought as written: they are the model's reasoning, and a client that
sends it back as `reasoning_content` gets the turn the template would have rendered.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTags:
    """The tags that open and close a thought."""

    open: str
    close: str


THINK = ThinkTags("<think>", "</think>")
SEED_THINK = ThinkTags("<seed:think>", "</seed:think>")
# --reasoning-parser values that name a tag pair ("auto" reads it from the template).
TAGS_BY_PARSER = {"think": THINK, "seed_oss": SEED_THINK}


def template_tags(chat_template: str | None) -> ThinkTags | None:
    """The think tags the chat template knows (the parser is then on by default), else None."""
    template = chat_template or ""
    # Seed's first: "</think>" is no substring of "</seed:think>", but a template may know both.
    return next((tags for tags in (SEED_THINK, THINK) if tags.close in template), None)


def starts_inside(prompt: str | None, tags: ThinkTags = THINK) -> bool:
    """True when the rendered prompt leaves the model inside an open thought."""
    return prompt is not None and prompt.rstrip().endswith(tags.open)


def _held(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that may be the beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits streamed output into (reasoning, content) pieces as it arrives."""

    def __init__(self, inside: bool, tags: ThinkTags = THINK) -> None:
        self._tags = tags
        self._state = "thinking" if inside else "start"
        self._pending = ""
        self._after_thought = False  # the newlines a model writes after the close are not content

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that `text` (appended to what came before) settles."""
        opening, closing = self._tags.open, self._tags.close
        self._pending += text
        reasoning, content = "", ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(opening):
                self._state, self._pending = "thinking", stripped[len(opening):]
            elif opening.startswith(stripped) and not final:
                return "", ""  # may still become the opening tag
            else:
                self._state = "content"
        if self._state == "thinking":
            cut = self._pending.find(closing)
            if cut >= 0:
                reasoning, self._pending = self._pending[:cut], self._pending[cut + len(closing):]
                self._state, self._after_thought = "content", True
            else:
                keep = 0 if final else _held(self._pending, closing)
                reasoning = self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return reasoning, ""
        if self._state == "content":
            content, self._pending = self._pending, ""
            if self._after_thought:
                content = content.lstrip("\n")
                self._after_thought = not content
        return reasoning, content


def split_reasoning(text: str, inside: bool, tags: ThinkTags = THINK) -> tuple[str | None, str]:
    """(reasoning or None when the output has no thought, content) of a whole output."""
    splitter = ReasoningSplitter(inside, tags)
    reasoning, content = splitter.feed(text, final=True)
    thought = inside or text.lstrip().startswith(tags.open)
    return (reasoning if thought else None), content
