"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vkrt.server.generation import Generation, ServerState
from vkrt.server.logprobs import chat_logprobs, prompt_logprobs_json
from vkrt.server.protocol import ChatCompletionRequest
from vkrt.server.reasoning import ReasoningSplitter, split_reasoning, starts_inside, template_thinks
from vkrt.server.responses import check_model, event_stream, now_s, sse, start_generation, usage
from vkrt.server.sampling import chat_prompt, check_request_text, check_unsupported
from vkrt.server.tools import (
    ToolCall,
    call_opener,
    check_tools,
    forcing_grammar,
    parse_tool_calls,
    pick_parser,
)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    check_request_text(body, state.config.max_prompt_chars)
    forced = check_tools(body.tools, body.tool_choice)
    # tool_choice "none": the model is not offered the tools at all, and nothing is parsed.
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    parser = None
    template = engine.tokenizer.chat_template if engine.tokenizer else None
    if tools:
        parser = pick_parser(template, state.config.tool_call_parser)
        if forced:
            body._tool_grammar = forcing_grammar(tools, forced, parser, body.parallel_tool_calls)
    prompt, prompt_ids = await state.run_cpu(chat_prompt, engine, body.messages, body.add_generation_prompt,
                                             body.continue_final_message, body.chat_template_kwargs, state.config,
                                             tools)
    generation = start_generation(state, raw, body, prompt_ids, prompt, "messages", "chatcmpl", arrival)
    mode = state.config.reasoning_parser
    thinks = mode == "think" or (mode == "auto" and template_thinks(template))
    # None: no reasoning split; else whether the output starts inside an open thought.
    inside = starts_inside(prompt) if thinks else None
    base: dict[str, Any] = {"id": generation.request_id, "created": now_s(), "model": state.model_name}

    if body.stream:
        return event_stream(_stream(state, generation, body, base, parser, inside), generation)

    result = await generation.run(raw)
    logprobs = chat_logprobs(engine.tokenizer, result.logprobs) if result.logprobs is not None else None
    reasoning, text = split_reasoning(result.text, inside) if inside is not None else (None, result.text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish_reason = result.finish_reason
    calls = _tool_calls(text, parser, body.parallel_tool_calls)
    if calls is not None:
        message = {"role": "assistant", "content": calls[0] or None,
                   "tool_calls": [call.to_json() for call in calls[1]]}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    if inside is not None:
        message["reasoning_content"] = reasoning
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": result.stop_reason,
    }
    response: dict[str, Any] = {**base, "object": "chat.completion", "choices": [choice],
                                "usage": usage(result), "system_fingerprint": None}
    if result.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(engine.tokenizer, result.prompt_logprobs)
    return JSONResponse(response)


def _tool_calls(text: str, parser: str | None, parallel: bool) -> tuple[str, list[ToolCall]] | None:
    """(content, calls) when tools were offered and the output holds calls, else None."""
    if parser is None:
        return None
    content, calls = parse_tool_calls(text, parser)
    if not calls:
        return None
    return content, calls if parallel else calls[:1]


def _sendable(text: str, parser: str) -> int:
    """How much of the output so far is surely content: everything before a tool call's
    opener, less any tail that may be the opener's beginning."""
    if parser == "llama3_json":  # a call is the whole output, a JSON object
        stripped = text.lstrip()
        return len(text) if stripped and not stripped.startswith("{") else 0
    opener = call_opener(parser)
    cut = text.find(opener)
    if cut >= 0:
        return cut
    for k in range(min(len(opener) - 1, len(text)), 0, -1):
        if text.endswith(opener[:k]):
            return len(text) - k
    return len(text)


async def _stream(state: ServerState, generation: Generation, body: ChatCompletionRequest,
                  base: dict[str, Any], parser: str | None, inside: bool | None) -> AsyncIterator[bytes]:
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    tokenizer = state.require_engine().tokenizer
    chunk_base = {**base, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], logprobs: Any, finish_reason: str | None) -> bytes:
        payload = {**chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish_reason}]}
        if include_usage:
            payload["usage"] = usage(generation.result) if continuous_usage else None
        return sse(payload)

    # OpenAI sends the role first, alone, before any content.
    yield chunk({"role": "assistant", "content": ""}, None, None)
    text, sent = "", 0  # with tools: the output so far, and how much of it went out as content
    splitter = ReasoningSplitter(inside) if inside is not None else None
    async for update in generation.updates():
        logprobs = chat_logprobs(tokenizer, update.logprobs) if update.logprobs is not None else None
        piece = update.text
        if splitter is not None:
            reasoning, piece = splitter.feed(piece, final=update.finish_reason is not None)
            if reasoning:
                yield chunk({"reasoning_content": reasoning}, logprobs, None)
                logprobs = None
        if parser is None:
            delta = {"content": piece} if piece or (update.finish_reason is None and splitter is None) else {}
            if delta or update.finish_reason is not None or logprobs is not None:
                yield chunk(delta, logprobs, update.finish_reason)
            continue
        text += piece
        if update.finish_reason is None:
            safe = max(sent, _sendable(text, parser))
            yield chunk({"content": text[sent:safe]}, logprobs, None)
            sent = safe
            continue
        calls = _tool_calls(text, parser, body.parallel_tool_calls)
        if calls is None:
            yield chunk({"content": text[sent:]} if text[sent:] else {}, logprobs, update.finish_reason)
            continue
        content, found = calls
        if content[sent:]:
            yield chunk({"content": content[sent:]}, logprobs, None)
            logprobs = None
        for i, call in enumerate(found):
            yield chunk({"tool_calls": [call.to_json(i)]}, logprobs, None)
            logprobs = None
        yield chunk({}, None, "tool_calls" if update.finish_reason == "stop" else update.finish_reason)
    if include_usage:
        yield sse({**chunk_base, "choices": [], "usage": usage(generation.result)})
