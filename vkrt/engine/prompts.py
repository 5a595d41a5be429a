"""Turning what callers send (text, token ids, chat messages) into prompt token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vkrt.errors import RequestError
from vkrt.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Messages = Sequence[dict[str, Any]]


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


def render_chat(tokenizer: Tokenizer | None, messages: Messages,
                chat_template_kwargs: dict[str, Any] | None = None,
                tools: Sequence[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """Render `messages` with the chat template (generation prompt added) and encode it.

    The template writes its own BOS, so the rendered text is encoded without special tokens.
    """
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so it cannot render chat messages", param="messages")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                         **(chat_template_kwargs or {}))
    return text, tokenizer.encode(text, add_special_tokens=False)


def is_single_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    """True for one prompt (a string or a flat list of ids), False for a batch of prompts."""
    if isinstance(prompts, str):
        return True
    return len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
