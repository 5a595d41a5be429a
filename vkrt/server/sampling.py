"""OpenAI request bodies -> prompt token ids and a validated SamplingParams."""

from __future__ import annotations

from typing import Any

from vkrt.engine.config import SamplingParams
from vkrt.errors import RequestError
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError
from vkrt.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)

# OpenAI's default for /v1/completions; chat defaults to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def check_unsupported(body: SamplingFields) -> None:
    """Reject what vkrt does not implement, saying so, instead of silently ignoring it."""
    if body.n != 1:
        raise _bad("n", f"only n=1 is supported, got {body.n}")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options", "only allowed when stream=true")
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type in ("json_object", "json_schema"):
            raise _bad("response_format", f"type {fmt.type!r} is not implemented (vkrt has no guided "
                       "decoding); use {\"type\": \"text\"} and ask for JSON in the prompt")
        raise _bad("response_format", f"unknown type {fmt.type!r}; only 'text' is supported")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise _bad("suffix", "not supported")
        if body.best_of not in (None, 1):
            raise _bad("best_of", f"only best_of=1 is supported, got {body.best_of}")
        if body.echo and body.logprobs is not None:
            raise _bad("echo", "echo together with logprobs is not supported")
    if isinstance(body, ChatCompletionRequest):
        if body.tools and body.tool_choice != "none":
            raise _bad("tools", "tool calling is not supported")
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad("top_logprobs", "requires logprobs=true")


def completion_prompt_ids(engine: EngineClient, body: CompletionRequest) -> list[int]:
    """The single prompt of a completion request as token ids."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _bad("prompt", f"batched prompts are not supported ({len(prompt)} given); "
                       "send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = require_tokenizer(engine, "prompt").encode(prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = list(prompt)  # ids outside the vocabulary are refused by engine.check_request
    if not ids:
        raise _bad("prompt", "the prompt is empty")
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
                    raise _bad(f"messages.{i}.content", f"content part type {part.get('type')!r} is not "
                               "supported; only text parts are")
                texts.append(part["text"])
            entry["content"] = "\n".join(texts)
        elif content is None:
            entry["content"] = ""
        out.append(entry)
    return out


def chat_prompt(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None) -> str:
    """Render the chat template (RequestError -> 400 through the error handlers)."""
    dicts = message_dicts(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise _bad("continue_final_message", "cannot be combined with add_generation_prompt=true")
        if dicts[-1]["role"] != "assistant":
            raise _bad("continue_final_message", "the last message must be from the assistant")
    tokenizer = require_tokenizer(engine, "messages")
    text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))
    if continue_final_message:
        # Cut the template's end-of-turn after the final message so generation continues it.
        final = dicts[-1]["content"]
        cut = text.rfind(final)
        if cut >= 0:
            text = text[: cut + len(final)]
    return text


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
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}") from None
    return out


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
        n=body.n,
    )
    try:
        engine.check_request(prompt_ids, params)
    except RequestError as exc:
        raise APIError.from_request_error(exc) from exc
    return params
