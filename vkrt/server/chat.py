"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated.

With `n` > 1 every choice is its own engine request (vkrt/server/choices.py: per-choice
seeds, the prompt's KV blocks shared through the prefix cache); each choice's output is split
into reasoning, content and tool calls on its own, streamed or not.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vkrt.errors import RequestError
from vkrt.server.choices import (
    CandidateSet,
    merged_updates,
    open_candidates,
    run_all,
    start_candidates,
)
from vkrt.server.engine_client import EngineClient
from vkrt.server.generation import Result, ServerState, Update
from vkrt.server.logprobs import chat_logprobs, prompt_logprobs_json
from vkrt.server.middleware import request_id_of
from vkrt.server.prompts import chat_prompt, check_request_text
from vkrt.server.protocol import ChatCompletionRequest
from vkrt.server.reasoning import ReasoningSplitter, split_reasoning, starts_inside, template_thinks
from vkrt.server.responses import (
    check_model,
    combined_usage,
    event_stream,
    log_request,
    new_response_id,
    now_s,
    sse,
)
from vkrt.server.sampling import check_unsupported, field_error, sampling_params
from vkrt.server.tools import (
    ToolCall,
    ToolCallStream,
    check_tools,
    forcing_grammar,
    parse_tool_calls,
    pick_parser,
    several_calls,
)
from vkrt.tokenizer import Tokenizer


@dataclass
class StartedChat:
    """A chat request rendered, admitted and generating: what a route needs to answer it."""

    engine: EngineClient
    candidates: CandidateSet
    parser: str | None  # the tool-call parser, when tools were offered
    parallel: bool  # several tool calls may be answered
    inside: bool | None  # None: no reasoning split; else whether the output starts inside a thought


async def start_chat(state: ServerState, body: ChatCompletionRequest, raw: Request, response_id: str,
                     arrival: float) -> StartedChat:
    """Check, render and start `body`; shared by /v1/chat/completions and /v1/responses."""
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    check_request_text(body, state.config.max_prompt_chars)
    forced = check_tools(body.tools, body.tool_choice)
    # tool_choice "none": the model is not offered the tools at all, and nothing is parsed.
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    parser = None
    template = engine.tokenizer.chat_template if engine.tokenizer else None
    # A named tool_choice is exactly one call, whatever parallel_tool_calls says.
    parallel = several_calls(forced, body.parallel_tool_calls)
    if tools:
        parser = pick_parser(template, state.config.tool_call_parser)
        if forced:
            body._tool_grammar = forcing_grammar(tools, forced, parser, parallel, state.config.max_digits())
    prompt, prompt_ids = await state.run_cpu(chat_prompt, engine, body.messages, body.add_generation_prompt,
                                             body.continue_final_message, body.chat_template_kwargs, state.config,
                                             tools)
    params = sampling_params(body, state.config.max_digits())
    try:  # off the loop: a constrained request compiles its grammar here (a big schema takes long)
        opened = await open_candidates(state, response_id, [(prompt_ids, prompt)], [params], body.n)
    except RequestError as exc:
        raise field_error(exc, body, "messages") from exc
    candidates = start_candidates(state, response_id, opened, arrival)
    log_request(state, response_id, request_id_of(raw.state), prompt, prompt_ids, params)
    mode = state.config.reasoning_parser
    thinks = mode == "think" or (mode == "auto" and template_thinks(template))
    inside = starts_inside(prompt) if thinks else None
    return StartedChat(engine, candidates, parser, parallel, inside)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    response_id = new_response_id("chatcmpl")
    started = await start_chat(state, body, raw, response_id, arrival)
    engine, candidates, parser, parallel, inside = (started.engine, started.candidates, started.parser,
                                                    started.parallel, started.inside)
    base: dict[str, Any] = {"id": response_id, "created": now_s(), "model": state.model_name}

    if body.stream:
        return event_stream(_stream(state, candidates, body, base, parser, parallel, inside), candidates)

    [results] = await run_all(candidates.groups, raw)
    choices = [chat_choice(engine.tokenizer, body, index, result, parser, parallel, inside)
               for index, result in enumerate(results)]
    response: dict[str, Any] = {**base, "object": "chat.completion", "choices": choices,
                                "usage": combined_usage([results]), "system_fingerprint": None}
    if results[0].prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(engine.tokenizer, results[0].prompt_logprobs)
    return JSONResponse(response)


def chat_choice(tokenizer: Tokenizer | None, body: ChatCompletionRequest, index: int, result: Result,
                parser: str | None, parallel: bool, inside: bool | None) -> dict[str, Any]:
    logprobs = chat_logprobs(tokenizer, result.logprobs) if result.logprobs is not None else None
    reasoning, text = split_reasoning(result.text, inside) if inside is not None else (None, result.text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish_reason = result.finish_reason
    calls = tool_calls_of(text, parser, parallel, body.tools)
    if calls is not None:
        message = {"role": "assistant", "content": calls[0] or None,
                   "tool_calls": [call.to_json() for call in calls[1]]}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    if inside is not None:
        message["reasoning_content"] = reasoning
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": result.stop_reason}


def tool_calls_of(text: str, parser: str | None, parallel: bool,
                tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]] | None:
    """(content, calls) when tools were offered and the output holds calls, else None."""
    if parser is None:
        return None
    content, calls = parse_tool_calls(text, parser, tools)
    if not calls:
        return None
    return content, calls if parallel else calls[:1]


Delta = tuple[dict[str, Any], Any, str | None]  # (delta, logprobs, finish_reason) of one chunk


class ChoiceStream:
    """One choice's stream: its updates turned into deltas of reasoning, content and tool calls."""

    def __init__(self, tokenizer: Tokenizer | None, parser: str | None, parallel: bool,
                 inside: bool | None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.splitter = ReasoningSplitter(inside) if inside is not None else None
        self.calls = ToolCallStream(parser, parallel, tools) if parser is not None else None

    def deltas(self, update: Update) -> Iterator[Delta]:
        logprobs = chat_logprobs(self.tokenizer, update.logprobs) if update.logprobs is not None else None
        final = update.finish_reason is not None
        piece = update.text
        if self.splitter is not None:
            reasoning, piece = self.splitter.feed(piece, final=final)
            if reasoning:
                yield {"reasoning_content": reasoning}, logprobs, None
                logprobs = None
        if self.calls is None:
            delta = {"content": piece} if piece or (not final and self.splitter is None) else {}
            if delta or final or logprobs is not None:
                yield delta, logprobs, update.finish_reason
            return
        content, call_deltas = self.calls.feed(piece, final)
        if content or (logprobs is not None and not call_deltas):
            yield {"content": content}, logprobs, None
            logprobs = None
        if call_deltas:
            yield {"tool_calls": call_deltas}, logprobs, None
        if final:
            called = self.calls.found_calls and update.finish_reason == "stop"
            yield {}, None, "tool_calls" if called else update.finish_reason


async def _stream(state: ServerState, candidates: CandidateSet, body: ChatCompletionRequest, base: dict[str, Any],
                  parser: str | None, parallel: bool, inside: bool | None) -> AsyncIterator[bytes]:
    """Chunks of every choice as they come, each with its index."""
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    tokenizer = state.require_engine().tokenizer
    chunk_base = {**base, "object": "chat.completion.chunk"}
    [generations] = candidates.groups

    def current_usage() -> dict[str, Any]:
        return combined_usage([[generation.result for generation in generations]])

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None) -> bytes:
        payload = {**chunk_base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish_reason}]}
        if include_usage:
            payload["usage"] = current_usage() if continuous_usage else None
        return sse(payload)

    streams = [ChoiceStream(tokenizer, parser, parallel, inside, body.tools) for _ in generations]
    # OpenAI sends each choice's role first, alone, before any content.
    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""}, None, None)
    async for index, update in merged_updates(candidates.groups):
        for delta, logprobs, finish_reason in streams[index].deltas(update):
            yield chunk(index, delta, logprobs, finish_reason)
    if include_usage:
        yield sse({**chunk_base, "choices": [], "usage": current_usage()})
