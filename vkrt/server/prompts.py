"""OpenAI request bodies -> prompt text and token ids: completion prompts, chat messages
rendered with the model's template, and the cheap text checks made before either."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from vkrt.chat_template import TemplateBudget
from vkrt.engine.prompts import render_chat
from vkrt.server.config import ServerConfig
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError, shown
from vkrt.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TokenizeRequest,
)
from vkrt.server.tools import template_messages
from vkrt.tokenizer import Tokenizer


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string under `value` holding a lone UTF-16 surrogate (JSON allows
    "\\ud800"; UTF-8, the tokenizer and the response encoder do not)."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        return _surrogate_at({**fields, **(value.model_extra or {})}, path)
    if isinstance(value, dict):
        for key, item in value.items():
            found = _surrogate_at(key, path) or _surrogate_at(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _surrogate_at(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def check_text_fields(body: BaseModel) -> None:
    """400 for any string in the body that is not valid Unicode (a lone surrogate)."""
    where = _surrogate_at(body, "")
    if where is not None:
        param = where[:64]
        raise APIError(400, f"{param}: contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                       "valid Unicode; send UTF-8 text", param=param, code="invalid_unicode")


def check_prompt_chars(num_chars: int, limit: int, param: str) -> None:
    """413 for prompt text over --max-prompt-chars, before any tokenising."""
    if num_chars > limit:
        raise APIError(413, f"{param}: {num_chars} characters of prompt text exceed the limit of {limit} "
                       "(--max-prompt-chars)", param=param, code="prompt_too_large")


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content if isinstance(part.get("text"), str))
    return 0


# Prompts up to this many characters (or token ids) are tokenised and made into engine requests
# on the event loop: well under a millisecond, where the hop to a niced worker thread took up
# to 13 ms of a short request's TTFT on a loaded machine (tools/profile_serving.py).
INLINE_PROMPT_SIZE = 1024


def is_small(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request's prompt work is cheap enough to run on the loop: short text or few
    token ids, and (chat) no tools to render."""
    prompt: Any = getattr(body, "prompt", None)
    if prompt is not None:
        items = prompt if isinstance(prompt, list) else [prompt]
        return sum(len(x) if isinstance(x, str | list) else 1 for x in items) <= INLINE_PROMPT_SIZE
    messages = getattr(body, "messages", None) or []
    return not getattr(body, "tools", None) and sum(_content_chars(m.content) for m in messages) <= INLINE_PROMPT_SIZE


def check_request_text(body: CompletionRequest | ChatCompletionRequest | TokenizeRequest, limit: int) -> None:
    """The cheap checks on the loop, before the request waits for a worker: prompt text
    over the limit (413), and strings that are not valid Unicode (400)."""
    prompt: Any = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), limit, "prompt")
    messages = getattr(body, "messages", None)
    if messages:
        check_prompt_chars(sum(_content_chars(m.content) for m in messages), limit, "messages")
    check_text_fields(body)


def truncated(prompt_ids: list[int], body: SamplingFields, max_model_len: int) -> list[int]:
    """The prompt cut to vLLM's `truncate_prompt_tokens` (-1: max_model_len) from the
    `truncation_side` end (default left: the start goes, the end the model continues stays)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise _bad("truncate_prompt_tokens", f"must be -1 (max_model_len) or in [1, {max_model_len}], got {keep}")
    if len(prompt_ids) <= keep:
        return prompt_ids
    return prompt_ids[:keep] if body.truncation_side == "right" else prompt_ids[-keep:]


def completion_prompts(engine: EngineClient, body: CompletionRequest,
                       max_chars: int) -> list[tuple[list[int], str | None]]:
    """Each prompt of a completion request as (token ids, text or None); a string, a list of
    ids, a list of strings, a list of id lists, or llama-server's one prompt of text and ids
    mixed (`[12, "text", 34]`) (CPU work: run it off the loop)."""
    raw: Any = body.prompt
    kinds = {type(x) for x in raw} if isinstance(raw, list) else set()
    if isinstance(raw, str) or (raw and kinds <= {int, str} and int in kinds):
        raw = [raw]
    if not raw:
        raise _bad("prompt", "the prompt is empty")
    kinds = {type(x) for x in raw}
    if len(kinds) > 1:
        raise _bad("prompt", "mixes lists of token ids with text or ids; send a list of strings, a list of "
                   "token-id lists, or one prompt of text and ids")
    check_prompt_chars(sum(_chars(x) for x in raw), max_chars, "prompt")
    prompts: list[tuple[list[int], str | None]] = []
    for i, prompt in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt.{i}"
        text: str | None = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            ids = require_tokenizer(engine, param).encode(prompt, add_special_tokens=body.add_special_tokens)
        elif any(isinstance(piece, str) for piece in prompt):
            ids = _mixed_ids(require_tokenizer(engine, param), prompt, body.add_special_tokens)
        else:  # ids outside the vocabulary are refused by the engine when it makes the request
            ids = list(prompt)
        cut = truncated(ids, body, engine.max_model_len)
        prompts.append((cut, text if len(cut) == len(ids) else None))  # a cut prompt echoes its ids' text
        if not ids:  # the engine would refuse it too, but under "prompt" rather than this one's place
            raise _bad(param, "the prompt is empty")
    return prompts


def _chars(prompt: str | list[Any]) -> int:
    """The characters of text in one prompt (its strings, for a mixed one)."""
    return len(prompt) if isinstance(prompt, str) else sum(len(piece) for piece in prompt if isinstance(piece, str))


def _mixed_ids(tokenizer: Tokenizer, pieces: list[int | str], add_special_tokens: bool) -> list[int]:
    """A prompt of text and ids as llama-server tokenises it: each string on its own, the ids as
    given, special tokens (a BOS) only where the prompt starts with text."""
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0)
        else:
            ids.append(piece)
    return ids


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; content parts must be text (joined with newlines)."""
    out = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages.{i}.content", f"content part type {shown(part.get('type'))} is not "
                               "supported; only text parts are")
                texts.append(part["text"])
            entry["content"] = "\n".join(texts)
        elif content is None:
            entry["content"] = ""
        out.append(entry)
    return out


def turn_flags(body: ChatCompletionRequest | TokenizeRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) for rendering `body`'s messages. A final
    assistant message with text, and neither flag sent, is continued (llama-server's prefill:
    the reply goes on from that text), not closed by a new turn; sent flags are as vLLM reads them."""
    if {"add_generation_prompt", "continue_final_message"} & body.model_fields_set or not body.messages:
        return body.add_generation_prompt, body.continue_final_message
    final = body.messages[-1]
    prefill = (final.role == "assistant" and bool(final.content) and not (final.model_extra or {}).get("tool_calls"))
    return (False, True) if prefill else (body.add_generation_prompt, body.continue_final_message)


def _message_chars(dicts: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in dicts if isinstance(m.get("content"), str))


def chat_prompt(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                config: ServerConfig, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """OpenAI messages rendered with the chat template and tokenised (CPU work: run it off the
    loop), through the engine's renderer within the server's budget: the rendering may take
    --chat-template-timeout and build at most --max-prompt-chars (RequestError, a 400,
    beyond either). With config.escape_special_tokens, message content is tokenised as plain text.
    """
    dicts = template_messages(message_dicts(messages))
    check_prompt_chars(_message_chars(dicts), config.max_prompt_chars, "messages")
    tokenizer = require_tokenizer(engine, "messages")
    budget = TemplateBudget(seconds=config.chat_template_timeout, max_chars=config.max_prompt_chars)
    return render_chat(tokenizer, dicts, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools,
                       chat_template_kwargs=template_kwargs, budget=budget,
                       escape_special_tokens=config.escape_special_tokens)
