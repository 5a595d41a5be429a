"""OpenAI request bodies -> prompt token ids and a validated SamplingParams."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from vkrt.chat_template import RESERVED_NAMES, TemplateBudget
from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import PARAM as GUIDED_PARAM
from vkrt.engine.guided import GuidedDecoding
from vkrt.errors import RequestError
from vkrt.server.config import ServerConfig
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError, shown
from vkrt.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    StructuredOutputs,
    TokenizeRequest,
)
from vkrt.server.tools import template_messages
from vkrt.tokenizer import Tokenizer

# OpenAI's default for /v1/completions; chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def check_unsupported(body: SamplingFields) -> None:
    """Reject what vkrt does not implement, saying so, instead of silently ignoring it."""
    if body.n < 1:
        raise _bad("n", f"must be >= 1, got {body.n}")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options", "only allowed when stream=true")
    fmt = body.response_format
    if fmt is not None and fmt.type not in ("text", "json_object", "json_schema", "structural_tag"):
        raise _bad("response_format", f"unknown type {shown(fmt.type)}; use 'text', 'json_object', "
                   "'json_schema' or 'structural_tag'")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise _bad("suffix", "not supported: vkrt has no fill-in-the-middle; put the text in the prompt")
        if body.best_of is not None and body.best_of < body.n:
            raise _bad("best_of", f"must be >= n ({body.n}), got {body.best_of}")
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise _bad("best_of", "cannot stream when best_of > n: the best are known only at the end")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad("top_logprobs", "requires logprobs=true")


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


def completion_prompts(engine: EngineClient, body: CompletionRequest,
                       max_chars: int) -> list[tuple[list[int], str | None]]:
    """Each prompt of a completion request as (token ids, text or None); a string, a list of
    ids, a list of strings or a list of id lists (CPU work: run it off the loop)."""
    raw: Any = body.prompt
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)):
        raw = [raw]
    if not raw:
        raise _bad("prompt", "the prompt is empty")
    kinds = {type(x) for x in raw}
    if len(kinds) > 1 and str in kinds:
        raise _bad("prompt", "mixes text and token ids; send a list of strings or a list of token-id lists")
    if len(kinds) > 1 or int in kinds:
        raise _bad("prompt", "mixes token ids and lists of token ids; send one list of ids per prompt")
    check_prompt_chars(sum(len(x) for x in raw if isinstance(x, str)), max_chars, "prompt")
    prompts: list[tuple[list[int], str | None]] = []
    for i, prompt in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            ids = require_tokenizer(engine, param).encode(prompt, add_special_tokens=body.add_special_tokens)
            prompts.append((ids, prompt))
        else:  # ids outside the vocabulary are refused by engine.check_request
            ids = list(prompt)
            prompts.append((ids, None))
        if not ids:
            raise _bad(param, "the prompt is empty")
    return prompts


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


def _message_chars(dicts: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in dicts if isinstance(m.get("content"), str))


# Stand-ins for message content while locating it in the rendered prompt (private use plane 15).
_MARK_OPEN, _MARK_CLOSE = "\U000f0001", "\U000f0002"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def _cut_after_final(text: str, final: str) -> str:
    """Cut the template's end-of-turn after the final message so generation continues it."""
    cut = text.rfind(final)
    return text[: cut + len(final)] if cut >= 0 else text


def chat_prompt(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                config: ServerConfig, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """Render the chat template and tokenise it (CPU work: run it off the loop).

    RequestError from the template becomes a 400 through the error handlers. With
    config.escape_special_tokens, message content is tokenised as plain text.
    """
    dicts = template_messages(message_dicts(messages))
    if continue_final_message:
        if add_generation_prompt:
            raise _bad("continue_final_message", "cannot be combined with add_generation_prompt=true")
        if not dicts or dicts[-1]["role"] != "assistant":
            raise _bad("continue_final_message", "the last message must be from the assistant")
    reserved = sorted(RESERVED_NAMES & (template_kwargs or {}).keys())
    if reserved:
        raise _bad("chat_template_kwargs", f"{', '.join(map(repr, reserved))} cannot be set here: the server "
                   "passes it to the template itself")
    check_prompt_chars(_message_chars(dicts), config.max_prompt_chars, "messages")
    tokenizer = require_tokenizer(engine, "messages")
    budget = TemplateBudget(seconds=config.chat_template_timeout, max_chars=config.max_prompt_chars)

    def render(entries: list[dict[str, Any]]) -> str:
        text = tokenizer.apply_chat_template(entries, add_generation_prompt=add_generation_prompt, tools=tools,
                                             budget=budget, **(template_kwargs or {}))
        return _cut_after_final(text, entries[-1]["content"]) if continue_final_message else text

    text = render(dicts)
    check_prompt_chars(len(text), config.max_prompt_chars, "messages")
    if config.escape_special_tokens:
        return text, _escaped_ids(tokenizer, dicts, text, render)
    # The template writes its own BOS and special tokens.
    return text, tokenizer.encode(text, add_special_tokens=False)


def _escaped_ids(tokenizer: Tokenizer, dicts: list[dict[str, Any]], text: str,
                 render: Callable[[list[dict[str, Any]]], str]) -> list[int]:
    """`text`'s ids with each message's content tokenised as plain text, so a user writing
    "<|im_end|>" gets the characters, not the control token.

    The template is rendered again with numbered marks for the contents; if putting the
    contents back in for the marks gives `text` exactly, the marks show where each content
    lies. A template that rewrites content (strips, splits) defeats that: such a request is
    refused only when some content would tokenise differently as text.
    """
    marked = [{**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} for i, m in enumerate(dicts)]
    pieces = _MARK.split(render(marked))  # template text, content index, template text, ...
    contents = [str(m.get("content", "")) for m in dicts]
    rebuilt = "".join(p if k % 2 == 0 else contents[int(p)] for k, p in enumerate(pieces))
    if rebuilt != text:
        risky = [i for i, c in enumerate(contents)
                 if tokenizer.encode_as_text(c) != tokenizer.encode(c, add_special_tokens=False)]
        if risky:
            raise _bad(f"messages.{risky[0]}.content", "contains special-token text, and this model's chat "
                       "template rewrites message content, so it cannot be escaped (--escape-special-tokens)")
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        else:
            ids += tokenizer.encode_as_text(contents[int(piece)])
    return ids


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the "
                       f"prompt has {num_prompt_tokens} tokens; shorten it", param=param,
                       code="context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; you asked "
                       f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                       f"{max_tokens} to generate); lower max_tokens", param="max_tokens",
                       code="context_length_exceeded")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise _bad("logit_bias", f"keys must be token ids, got {shown(key)}") from None
    return out


def _structured_outputs(options: StructuredOutputs) -> GuidedDecoding:
    given: list[GuidedDecoding] = []
    if options.structural_tag is not None:
        given.append(GuidedDecoding("structural_tag", options.structural_tag))
    if options.json_ is not None:
        given.append(GuidedDecoding("json", options.json_))
    if options.regex is not None:
        given.append(GuidedDecoding("regex", options.regex))
    if options.choice is not None:
        given.append(GuidedDecoding("choice", tuple(options.choice)))
    if options.grammar is not None:
        given.append(GuidedDecoding("grammar", options.grammar))
    if options.json_object:
        given.append(GuidedDecoding("json_object"))
    if len(given) != 1:
        raise _bad("structured_outputs", f"give exactly one of json, regex, choice, grammar, json_object, "
                   f"structural_tag ({len(given)} given)")
    return given[0]


def guided_decoding(body: SamplingFields) -> tuple[GuidedDecoding, str] | None:
    """The output constraint a request asks for, with the field that asked; 400 for two at once."""
    found: list[tuple[GuidedDecoding, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((GuidedDecoding("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise _bad("response_format", "type 'json_schema' needs json_schema.schema")
        # OpenAI's strict=false asks for best effort; vkrt then ignores schema keywords llguidance
        # does not implement instead of refusing them. The output always follows the rest.
        found.append((GuidedDecoding("json", fmt.json_schema.schema_, strict=fmt.json_schema.strict is not False),
                      "response_format"))
    elif fmt is not None and fmt.type == "structural_tag":
        tag: dict[str, Any] = {"structures": fmt.structures, "triggers": fmt.triggers}
        found.append((GuidedDecoding("structural_tag", tag if fmt.format is None else {"format": fmt.format}),
                      "response_format"))
    if body.structured_outputs is not None:
        found.append((_structured_outputs(body.structured_outputs), "structured_outputs"))
    if body.json_schema is not None:
        found.append((GuidedDecoding("json", body.json_schema), "json_schema"))
    if body.grammar is not None:
        found.append((GuidedDecoding("grammar", body.grammar), "grammar"))
    if isinstance(body, ChatCompletionRequest) and body._tool_grammar is not None:
        found.append((body._tool_grammar, "tool_choice"))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise _bad(found[1][1], f"only one output constraint per request ({names} given)")
    return found[0] if found else None


def sampling_params(engine: EngineClient, body: SamplingFields, prompt_ids: list[int],
                    prompt_param: str) -> SamplingParams:
    """Map the OpenAI fields onto SamplingParams; the engine validates them with the prompt."""
    max_model_len = engine.max_model_len
    num_prompt_tokens = len(prompt_ids)
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        assert isinstance(body, CompletionRequest)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        logprobs = body.logprobs
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens", f"must be >= 1, got {max_tokens}")
    check_prompt_length(num_prompt_tokens, max_tokens, max_model_len, prompt_param)
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    constraint = guided_decoding(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        n=1,  # each choice is its own engine request (server/choices.py)
        guided_decoding=constraint[0] if constraint else None,
    )
    try:
        engine.check_request(prompt_ids, params)
    except RequestError as exc:
        if constraint is not None and exc.param == GUIDED_PARAM:
            # Name the request field, not the engine's parameter.
            message = str(exc).removeprefix(f"{GUIDED_PARAM}: ")
            raise _bad(constraint[1], message) from exc
        raise APIError.from_request_error(exc) from exc
    return params
