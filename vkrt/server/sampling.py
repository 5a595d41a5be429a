"""OpenAI request fields -> SamplingParams, and the engine's errors back to those fields.

This is a mapping and nothing more: the engine validates the parameters, with the prompt,
when it makes the request (vkrt/engine/processor.py), and `field_error` names the request
field behind whatever it refuses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import PARAM as GUIDED_PARAM
from vkrt.engine.guided import GuidedDecoding
from vkrt.engine.json_bounds import DEFAULT_MAX_DIGITS
from vkrt.errors import RequestError
from vkrt.server.errors import APIError, shown
from vkrt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InfillRequest,
    SamplingFields,
    StructuredOutputs,
)

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
            raise _bad("suffix", "not supported on /v1/completions; for fill-in-the-middle send input_prefix and "
                       "input_suffix to POST /infill (a model with FIM tokens)")
        if body.best_of is not None and body.best_of < body.n:
            raise _bad("best_of", f"must be >= n ({body.n}), got {body.best_of}")
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise _bad("best_of", "cannot stream when best_of > n: the best are known only at the end")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad("top_logprobs", "requires logprobs=true")


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
        # llama.cpp's {"type": "json_object", "schema": {...}}: JSON valid for the schema.
        found.append((GuidedDecoding("json_object") if fmt.schema_ is None else GuidedDecoding("json", fmt.schema_),
                      "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
            # OpenAI's strict=false asks for best effort; vkrt then ignores schema keywords llguidance
            # does not implement instead of refusing them. The output always follows the rest.
            found.append((GuidedDecoding("json", fmt.json_schema.schema_, strict=fmt.json_schema.strict is not False),
                          "response_format"))
        elif fmt.schema_ is not None:  # llama.cpp also takes the schema beside the type
            found.append((GuidedDecoding("json", fmt.schema_), "response_format"))
        else:
            raise _bad("response_format", "type 'json_schema' needs json_schema.schema")
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


def sampling_params(body: SamplingFields, max_digits: int | None = DEFAULT_MAX_DIGITS) -> SamplingParams:
    """The OpenAI fields as SamplingParams (400 only for what cannot be mapped at all); a JSON
    schema constraint bounds its numbers to `max_digits` digits (the server's --json-max-digits)."""
    max_tokens: int | None
    if isinstance(body, ChatCompletionRequest):
        # None: until the context is full.
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    elif isinstance(body, InfillRequest):  # llama-server's n_predict, -1 (its default) until the context is full
        max_tokens = body.n_predict if body.n_predict is not None else body.max_tokens
        max_tokens, logprobs = (None if max_tokens == -1 else max_tokens), None
    else:
        assert isinstance(body, CompletionRequest)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        logprobs = body.logprobs
    constraint = guided_decoding(body)
    guided = None
    if constraint is not None:
        guided = constraint[0]
        if guided.kind != "grammar":  # a forced tool call's grammar has its bounds written in already
            guided = dataclasses.replace(guided, max_digits=max_digits)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
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
        guided_decoding=guided,
        speculative=body.speculative,
    )


def field_error(exc: RequestError, body: SamplingFields, prompt_param: str) -> APIError:
    """The engine's refusal of a request as the client's 400, named by the field the client
    sent: the one that asked for the output constraint (the engine calls it guided_decoding),
    and `prompt_param` for the prompt (a chat request's is its messages)."""
    error = APIError.from_request_error(exc)
    if exc.param == GUIDED_PARAM:
        constraint = guided_decoding(body)  # the mapping again, on this error path only
        if constraint is not None:
            message = str(exc).removeprefix(f"{GUIDED_PARAM}: ")
            return _bad(constraint[1], message)
    if exc.param == "prompt" and prompt_param != "prompt":
        error.param = prompt_param
    return error
