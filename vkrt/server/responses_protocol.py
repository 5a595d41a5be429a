"""POST /v1/responses: the request body and the response object, as pydantic models.

The request is type-checked here, strictly, as the other routes' bodies are (unknown fields
ignored); vkrt/server/responses_api.py maps it onto a chat request. The response models only
describe the JSON the route builds, for the OpenAPI document (tests/server/test_fuzz.py
checks the route's answers against it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Body):
    # output_text: an earlier answer sent back as input; text: what some clients write
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallInput(_Body):
    """A tool call the model made earlier, sent back with its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningInput(_Body):
    """An earlier reasoning item sent back: accepted and left out of the prompt, as chat
    templates leave out earlier turns' thoughts."""

    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallInput | FunctionCallOutput | ReasoningInput


class FunctionTool(_Body):
    """The Responses API's flat function tool (chat nests the same fields under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    """How hard the model thinks: the chat request's reasoning_effort (the summary is not made)."""

    effort: Literal["low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    # Stateless: store is accepted and ignored (nothing is kept); previous_response_id,
    # conversation and background need stored state and are refused by the route.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# The response object --------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]  # always empty: the thought itself is in `content`
    content: list[ReasoningText]
    status: Literal["completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[OutputMessage | FunctionCallItem | ReasoningItem]
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str] | None
    previous_response_id: None
    store: Literal[False]
    usage: ResponseUsage
