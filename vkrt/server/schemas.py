"""Response bodies as pydantic models: what the OpenAPI document promises each route sends.

The routes build their JSON directly (no second validation per response); these models
only describe it, and tests/server/test_fuzz.py checks responses against the document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, RootModel

from vkrt.server.errors import ERROR_TYPES


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    # with code context_length_exceeded, as llama-server's: the prompt's tokens and the context
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # null for the first prompt token under echo (the model never scores it)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the message is only tool calls
    tool_calls: list[ToolCall] | None = None  # when tools were offered and the model called
    reasoning_content: str | None = None  # when the reasoning parser is on (null: no thought)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class InvocationResponse(RootModel[ChatCompletionResponse | CompletionResponse]):
    """What POST /invocations answers: the response of the route its body's shape picks."""


# POST /invocations takes either request body (it reads the body itself to pick the route).
INVOCATIONS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    {"$ref": "#/components/schemas/ChatCompletionRequest"}, {"$ref": "#/components/schemas/CompletionRequest"}]}}}}}


class InfillResponse(BaseModel):
    """POST /infill's answer, in llama-server's shape (its last stream event has the same fields)."""

    content: str
    stop: bool
    model: str
    stop_type: Literal["eos", "word", "limit"]
    stopping_word: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int
    truncated: bool  # the prompt was cut to fit the context


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None = None
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


_ERROR_MEANINGS = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key",
    404: "unknown model or route",
    408: "the request body did not arrive within --timeout-read",
    413: "request body over the size limit, or prompt text over --max-prompt-chars",
    429: "too many requests waiting (--max-waiting-requests)",
    431: "request line and headers over --max-header-bytes",
    500: "unexpected failure (the message gives the request id)",
    503: "the model is still loading or failed to load",
}


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route can send (`model`: the body)."""
    assert all(status in ERROR_TYPES for status in statuses)
    return {status: {"model": model, "description": _ERROR_MEANINGS[status]} for status in statuses}


# An event of the stream as a client parses it (what schemathesis checks each one against).
SSE_EVENT_PROPERTIES = {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}}
SSE = {"text/event-stream": {"schema": {"type": "object", "properties": SSE_EVENT_PROPERTIES,
                                        "description": "data: <chunk JSON> events, then data: [DONE]"}}}
