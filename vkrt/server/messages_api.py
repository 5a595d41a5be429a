"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

A Messages request is translated into a chat-completions request and run through chat.py's
own machinery (its checks, prompt, tool grammar, reasoning split and tool-call parsing), so the
two APIs cannot drift; only the reply is written in Anthropic's shape: content blocks, a
stop_reason, and for a stream the named events the anthropic SDK's helpers consume. Errors on
these routes are Anthropic-shaped (errors.py picks the shape by path).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vkrt.server import schemas
from vkrt.server.chat import chat_choice, start_chat
from vkrt.server.choices import run_all
from vkrt.server.errors import APIError
from vkrt.server.generation import ServerState
from vkrt.server.messages_protocol import (
    SSE_EVENTS,
    AnthropicErrorResponse,
    ContentBlockParam,
    CountTokensRequest,
    CountTokensResponse,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    ToolResultBlockParam,
)
from vkrt.server.messages_stream import message_events, sse_error, stop_of, tool_use_id
from vkrt.server.prompts import chat_prompt, check_request_text
from vkrt.server.protocol import ChatCompletionRequest
from vkrt.server.responses import check_model, event_stream, new_response_id
from vkrt.server.tools import UNDECODABLE, check_tools

_ERRORS = (400, 401, 404, 408, 413, 431, 500, 503)


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    """Register the Messages routes on `app` (called once by build_app)."""

    @app.post("/v1/messages", responses={
        200: {"model": MessageResponse, "content": SSE_EVENTS,
              "description": "the message; with stream=true, server-sent events"},
        **schemas.error_responses(*_ERRORS, 429, model=AnthropicErrorResponse)})
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(state, body, raw)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
              responses=schemas.error_responses(*_ERRORS, model=AnthropicErrorResponse))
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        return JSONResponse({"input_tokens": await count_input_tokens(state, body)})


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


# Request translation


def _tool_result_text(block: ToolResultBlockParam, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for part in block.content:
        if part.type != "text":
            raise _bad(param, "image content is not supported: the served model reads text only")
        texts.append(part.text)  # type: ignore[union-attr]
    return "\n".join(texts)


def _turn(message: MessageParam, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: its tool results become `tool` messages
    (in order, before the text that follows them), its tool_use blocks `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(message.content):
        out.extend(_block(block, f"{param}.content.{i}", message.role, texts, calls))
    if texts or calls or not out:
        entry: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        out.append(entry)
    return out


def _block(block: ContentBlockParam, param: str, role: str, texts: list[str],
           calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds `block` to the turn's texts or calls; returns the `tool` messages it stands for."""
    if block.type == "text":
        texts.append(block.text)
    elif block.type == "image":
        raise _bad(param, "image content is not supported: the served model reads text only")
    elif block.type == "tool_use":
        if role != "assistant":
            raise _bad(param, "tool_use blocks belong in assistant messages")
        calls.append({"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input)}})
    elif block.type == "tool_result":
        if role != "user":
            raise _bad(param, "tool_result blocks belong in user messages")
        return [{"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block, param)}]
    return []  # thinking blocks: old thoughts are not shown to the model again


def _system_text(system: str | list[Any] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(block.text for block in system) or None


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    """tools and tool_choice in the chat-completions form check_tools and the grammar read."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type != "none":
            raise _bad("tool_choice", "needs tools")
        return {}
    tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                               "parameters": tool.input_schema}} for tool in body.tools]
    fields: dict[str, Any] = {"tools": tools}
    choice = body.tool_choice
    if choice is None:
        return fields
    if choice.type == "tool":
        if choice.name is None:
            raise _bad("tool_choice.name", "a tool choice of type 'tool' names the tool")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat-completions request that `body` means (400 for what the route refuses)."""
    dicts: list[dict[str, Any]] = []
    system = _system_text(body.system)
    if system is not None:
        dicts.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        dicts.extend(_turn(message, f"messages.{i}"))
    fields: dict[str, Any] = {"model": body.model, "messages": dicts,
                              **_tool_fields(body)}
    if body.thinking is not None and body.thinking.type != "adaptive":
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    if body.messages[-1].role == "assistant":  # Anthropic's prefill: the reply continues that turn
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise _bad("max_tokens", f"must be at least 1, got {body.max_tokens}")
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream)
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


async def count_input_tokens(state: ServerState, body: CountTokensRequest) -> int:
    """The prompt's length in tokens, rendered as /v1/messages would render it."""
    check_model(state, body.model)
    engine = state.require_engine()
    chat = chat_request(body)
    check_request_text(chat, state.config.max_prompt_chars)
    check_tools(chat.tools, chat.tool_choice)
    tools = chat.tools if chat.tools and chat.tool_choice != "none" else None
    _, ids = await state.run_cpu(chat_prompt, engine, chat.messages, chat.add_generation_prompt,
                                 chat.continue_final_message, chat.chat_template_kwargs, state.config, tools)
    return len(ids)


# Replies


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.partition("-")[2]


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments or "{}")
    except UNDECODABLE:
        return None
    return value if isinstance(value, dict) else None


def _content(message: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The content blocks of chat_choice's message, and whether it holds tool calls."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    called = False
    for call in message.get("tool_calls") or []:
        function = call["function"]
        arguments = _tool_input(function["arguments"])
        if arguments is None:  # not an object: shown as the text it is rather than lost
            blocks.append({"type": "text", "text": function["arguments"]})
            continue
        blocks.append({"type": "tool_use", "id": tool_use_id(), "name": function["name"], "input": arguments})
        called = True
    return blocks, called


async def create_message(state: ServerState, body: MessagesRequest, raw: Request) -> Response:
    chat = chat_request(body)
    response_id = new_response_id("msg")
    run = await start_chat(state, chat, raw, response_id, time.monotonic())
    if body.stream:
        return event_stream(message_events(state, run, chat, _message_id(response_id)), run.candidates,
                            error_event=sse_error, done=b"")
    [[result]] = await run_all(run.candidates.groups, raw)
    choice = chat_choice(run.engine.tokenizer, chat, 0, result, run.reading)
    blocks, called = _content(choice["message"])
    stop_reason, stop_sequence = stop_of(result, called)
    return JSONResponse({"id": _message_id(response_id), "type": "message", "role": "assistant", "content": blocks,
                         "model": state.model_name, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": {"input_tokens": len(result.prompt_token_ids),
                                   "output_tokens": len(result.token_ids)}})
