"""Turning what callers send (text, token ids, chat messages) into prompt token ids.

`render_chat` is the one chat renderer: LLM.chat, AsyncLLM and the server's chat route all
render through it (the server first turns OpenAI messages and tool calls into the plain
message dicts a template takes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from vkrt.chat_template import RESERVED_NAMES, TemplateBudget
from vkrt.errors import RequestError
from vkrt.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Messages = Sequence[dict[str, Any]]

# Stand-ins for message content while locating it in the rendered prompt (private use plane 15).
_MARK_OPEN, _MARK_CLOSE = "\U000f0001", "\U000f0002"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt ids): text is encoded with the model's special tokens."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer; send token ids instead of text", param="prompt")
        return prompt, tokenizer.encode(prompt)
    ids = list(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("a prompt is either a string or a list of integer token ids", param="prompt")
    return None, ids


def render_chat(tokenizer: Tokenizer | None, messages: Messages, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: Sequence[dict[str, Any]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, budget: TemplateBudget | None = None,
                escape_special_tokens: bool = False) -> tuple[str, list[int]]:
    """Render `messages` with the chat template and encode it: (prompt text, prompt ids).

    The template writes its own BOS, so the rendered text is encoded without special tokens.
    With `continue_final_message` the final (assistant) message is left open for generation
    to continue; with `escape_special_tokens` message content is tokenised as plain text.
    RequestError (a 400 at the server) for what cannot be rendered.
    """
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so it cannot render chat messages", param="messages")
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError("continue_final_message: cannot be combined with add_generation_prompt=true",
                               param="continue_final_message")
        if not messages or messages[-1].get("role") != "assistant":
            raise RequestError("continue_final_message: the last message must be from the assistant",
                               param="continue_final_message")
    kwargs = chat_template_kwargs or {}
    reserved = sorted(RESERVED_NAMES & kwargs.keys())
    if reserved:  # refused here too: as keyword arguments they would collide with the renderer's own
        raise RequestError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} cannot be set here: the "
                           "renderer passes it to the template itself", param="chat_template_kwargs")

    def render(entries: Messages) -> str:
        text = tokenizer.apply_chat_template(entries, add_generation_prompt=add_generation_prompt, tools=tools,
                                             budget=budget, **kwargs)
        return _cut_after_final(text, str(entries[-1].get("content", ""))) if continue_final_message else text

    text = render(messages)
    if escape_special_tokens:
        return text, _escaped_ids(tokenizer, messages, text, render)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _cut_after_final(text: str, final: str) -> str:
    """Cut the template's end-of-turn after the final message so generation continues it."""
    cut = text.rfind(final)
    return text[: cut + len(final)] if cut >= 0 else text


def _escaped_ids(tokenizer: Tokenizer, messages: Messages, text: str, render: Callable[[Messages], str]) -> list[int]:
    """`text`'s ids with each message's content tokenised as plain text, so a user writing
    "<|im_end|>" gets the characters, not the control token.

    The template is rendered again with numbered marks for the contents; if putting the
    contents back in for the marks gives `text` exactly, the marks show where each content
    lies. A template that rewrites content (strips, splits) defeats that: such a request is
    refused only when some content would tokenise differently as text.
    """
    marked = [{**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} for i, m in enumerate(messages)]
    pieces = _MARK.split(render(marked))  # template text, content index, template text, ...
    contents = [str(m.get("content", "")) for m in messages]
    rebuilt = "".join(p if k % 2 == 0 else contents[int(p)] for k, p in enumerate(pieces))
    if rebuilt != text:
        risky = [i for i, c in enumerate(contents)
                 if tokenizer.encode_as_text(c) != tokenizer.encode(c, add_special_tokens=False)]
        if risky:
            param = f"messages.{risky[0]}.content"
            raise RequestError(f"{param}: contains special-token text, and this model's chat template rewrites "
                               "message content, so it cannot be escaped (escape_special_tokens is on)", param=param)
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        else:
            ids += tokenizer.encode_as_text(contents[int(piece)])
    return ids


def is_single_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    """True for one prompt (a string or a flat list of ids), False for a batch of prompts."""
    if isinstance(prompts, str):
        return True
    return len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
