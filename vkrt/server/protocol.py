"""Request bodies of the OpenAI (and vLLM extension) routes, as pydantic models.

Unknown fields are ignored, as OpenAI's own server does. Values are only type-checked
here, strictly (no "true" for a number, no "5" for an int: what the OpenAPI document says
is what is accepted); ranges are checked once, by SamplingParams.validate, when the
request is mapped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's form: {"type": "json_object", "schema": {...}} (instructor's JSON_SCHEMA mode)
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    # vLLM's type "structural_tag"
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: Any = None  # xgrammar's newer structural tag form, refused with a 400


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of the constraint fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None  # vLLM sends its JSON text


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # -1: every vocabulary entry
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] | None = None  # which end truncation cuts (default left)
    use_beam_search: bool = False  # n (best_of on completions) is the beam width (vkrt/server/beam_search.py)
    length_penalty: float = 1.0  # a beam's score: cumulative logprob / len ** length_penalty
    early_stopping: bool = False  # stop once `width` beams have finished
    # llama.cpp extensions
    json_schema: dict[str, Any] | bool | None = None
    grammar: str | None = None
    # vkrt: false decodes this request without speculation when the server speculates
    speculative: bool = True


class CompletionRequest(SamplingFields):
    # The last member takes mixed lists only so that the route can say what is wrong with them.
    prompt: str | list[int] | list[str] | list[list[int]] | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class InfillChunk(_Body):
    """One file of llama-server's `input_extra`: context from elsewhere in the project."""

    text: str
    filename: str = "tmp"  # llama-server's default


class InfillRequest(SamplingFields):
    """llama-server's /infill: the code before and after the cursor, other files as context."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = Field(default_factory=list)
    prompt: str = ""  # written after input_prefix: the start of the line being completed
    n_predict: int | None = None  # llama-server's max_tokens; -1: until the context is full


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, tool_calls, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: passed to the chat template as `reasoning_effort` (gpt-oss's writes it into its
    # system message; a chat_template_kwargs entry of that name wins).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    parallel_tool_calls: bool = True
    # Set by the route, never by the client: the grammar that forces tool_choice "required"
    # or a named function (a GuidedDecoding).
    _tool_grammar: Any = PrivateAttr(default=None)


class TokenizeRequest(_Body):
    """vLLM's /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
