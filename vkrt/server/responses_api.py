"""POST /v1/responses: OpenAI's Responses API, stateless, on the chat route's machinery.

A Responses request is mapped onto a ChatCompletionRequest (input items to messages, flat
function tools to chat's nested ones, text.format to response_format) and started through
chat.start_chat, so the template, tool parsing and forcing grammars, structured output and
the reasoning split are the chat route's. Only the answer's shape is this module's: output
items (reasoning, message, function_call) here, the streamed events in responses_stream.py.
Nothing is stored, so what needs a stored response (previous_response_id, conversation,
background) is refused with a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vkrt.server.chat import start_chat
from vkrt.server.choices import run_all
from vkrt.server.errors import APIError
from vkrt.server.generation import ServerState, raise_if_failed
from vkrt.server.protocol import ChatCompletionRequest
from vkrt.server.responses import event_stream, now_s
from vkrt.server.responses_items import (
    call_item,
    finished,
    item_id,
    message_item,
    reasoning_item,
    reasoning_tokens,
)
from vkrt.server.responses_protocol import (
    FunctionCallInput,
    FunctionCallOutput,
    InputMessage,
    InputText,
    ResponseObject,
    ResponsesRequest,
)
from vkrt.server.responses_stream import response_events
from vkrt.server.tools import ToolCall

# Chat field names in errors raised by the shared machinery, as this route's client wrote them.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "messages": "input", "response_format": "text.format"}


# The streamed form: named events (`event: response.output_text.delta` / `data: {...}`), as
# the Responses API sends them, not the chat routes' bare data lines.
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "description": "event: <event type> / data: <event JSON> pairs, response.created ... response.completed"}}}


def add_responses_routes(app: FastAPI, state: ServerState, errors: dict[int | str, dict[str, Any]]) -> None:
    """Register POST /v1/responses on `app`; `errors` are the OpenAPI error entries it may answer."""

    @app.post("/v1/responses", responses={
        200: {"model": ResponseObject, "content": EVENT_STREAM,
              "description": "the response; with stream=true, server-sent events (response.created ... "
                             "response.completed)"},
        **errors})
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(state, body, raw)


async def create_response(state: ServerState, body: ResponsesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    _refuse_stateful(body)
    chat = to_chat_request(body)
    response_id = item_id("resp")
    try:
        started = await start_chat(state, chat, raw, response_id, arrival)
    except APIError as exc:
        raise _renamed(exc) from exc
    base = response_base(state, body, response_id)
    tokenizer = started.engine.tokenizer
    if body.stream:
        return event_stream(response_events(started, body, base, tokenizer), started.candidates)
    [results] = await run_all(started.candidates.groups, raw)
    result = results[0]
    raise_if_failed(result)
    reasoning, content, calls = started.reading.split(result.text, chat.tools)
    complete = result.finish_reason != "length"
    items = output_items(reasoning, content, calls or [], complete)
    return JSONResponse(finished(base, items, complete, results, reasoning_tokens(tokenizer, reasoning)))


def _refuse_stateful(body: ResponsesRequest) -> None:
    """400 for what would need a stored response: this server keeps none."""
    for param, value in (("previous_response_id", body.previous_response_id),
                         ("conversation", body.conversation), ("background", body.background or None)):
        if value is not None:
            raise APIError(400, f"{param}: not supported: vkrt's /v1/responses is stateless (nothing is "
                           "stored); send the whole conversation in 'input'", param=param,
                           code="unsupported_parameter")


def _renamed(exc: APIError) -> APIError:
    """`exc` with the chat field it names renamed to this route's field."""
    if exc.param is None:
        return exc
    head, dot, rest = exc.param.partition(".")
    head = head.split("[")[0]
    if head not in _PARAMS:
        return exc
    param = _PARAMS[head] + exc.param[len(head):]
    message = exc.message.replace(exc.param, param, 1) if exc.message.startswith(exc.param) else exc.message
    return APIError(exc.status, message, param=param, code=exc.code, details=exc.details)


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates what `body` asks for."""
    # A new turn always: input ending in an assistant message is history, never a prefill.
    fields: dict[str, Any] = {"messages": to_messages(body), "stream": body.stream,
                              "parallel_tool_calls": body.parallel_tool_calls, "add_generation_prompt": True}
    for name, value in (("model", body.model), ("max_completion_tokens", body.max_output_tokens),
                        ("temperature", body.temperature), ("top_p", body.top_p), ("user", body.user)):
        if value is not None:
            fields[name] = value
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {k: v for k, v in spec.items() if v is not None}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # e.g. an empty input list: no message to answer
        first = exc.errors()[0]
        param = _PARAMS.get(str(first["loc"][0]), str(first["loc"][0])) if first["loc"] else None
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from exc


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def to_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """Chat messages for `body`'s instructions and input: consecutive function_call items become
    one assistant message's tool_calls, each output a tool message."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    names: dict[str, str] = {}
    for item in body.input:
        if isinstance(item, InputMessage):
            # Chat templates know no "developer": it is OpenAI's newer name for system.
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallInput):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            tool = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            if item.call_id in names:
                tool["name"] = names[item.call_id]
            messages.append(tool)
    return messages


def response_base(state: ServerState, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object's fields that echo the request, as OpenAI's does."""
    tool_choice: Any = body.tool_choice or "auto"
    if not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    return {"id": response_id, "object": "response", "created_at": now_s(), "model": state.model_name,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [tool.model_dump() for tool in body.tools or []], "tool_choice": tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls, "text": text, "metadata": body.metadata,
            "previous_response_id": None, "store": False, "error": None, "incomplete_details": None}


def output_items(reasoning: str | None, content: str, calls: list[ToolCall], complete: bool) -> list[dict[str, Any]]:
    """The output: the thought, the text (always, when there is no call), then each call."""
    items = [reasoning_item(reasoning, complete)] if reasoning else []
    if content or not calls:
        items.append(message_item(content, complete))
    items += [call_item(f"call_{uuid.uuid4().hex[:24]}", call.name, call.arguments, complete) for call in calls]
    return items


