"""Bodies of the Anthropic Messages routes (POST /v1/messages, /v1/messages/count_tokens):
requests as strict pydantic models, responses as models that only describe the JSON the route
builds (for the OpenAPI document, as vkrt/server/schemas.py does for the OpenAI routes).

Unknown fields (cache_control, citations, service_tier, ...) are ignored, as in protocol.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlockParam(_Body):
    type: Literal["text"]
    text: str


class ImageBlockParam(_Body):
    """Accepted by the schema only so the route can refuse it with a message that says why."""

    type: Literal["image"]
    source: dict[str, Any] | None = None


class ToolUseBlockParam(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(_Body):
    """A thinking block sent back with its turn: dropped (the template never sees old thoughts)."""

    type: Literal["thinking"]
    thinking: str | None = None
    signature: str | None = None


class RedactedThinkingBlockParam(_Body):
    """Dropped like a thinking block. Its own model, so that each `type` of the discriminated
    union maps to one schema: an OpenAPI discriminator maps a value to one schema, and a client
    (or a fuzzer) reading the document expects each schema to take exactly its own value."""

    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlockParam = Annotated[
    TextBlockParam | ImageBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type")]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Body):
    """`enabled` / `disabled` turn a reasoning template's thinking on or off; the budget is not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Body):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    stream: bool = False


# Responses


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str  # always "": nothing here signs thoughts


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


SSE_EVENTS = {"text/event-stream": {"schema": {
    "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "description": "event: <name> / data: <event JSON> pairs: message_start, "
    "content_block_start, content_block_delta, content_block_stop, message_delta, message_stop, ping"}}}
