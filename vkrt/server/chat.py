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

from vkrt.engine.config import SamplingParams
from vkrt.errors import RequestError
from vkrt.server import harmony
from vkrt.server.beam_search import beam_results, check_beam_request
from vkrt.server.choices import (
    CandidateSet,
    merged_updates,
    open_candidates,
    run_all,
    start_candidates,
)
from vkrt.server.config import ServerConfig
from vkrt.server.engine_client import EngineClient
from vkrt.server.generation import Result, ServerState, Update
from vkrt.server.logprobs import chat_logprobs, prompt_logprobs_json
from vkrt.server.markers import keep_markers, special_ids
from vkrt.server.middleware import request_id_of
from vkrt.server.prompts import chat_prompt, check_request_text, is_small, truncated, turn_flags
from vkrt.server.protocol import ChatCompletionRequest
from vkrt.server.reasoning import (
    TAGS_BY_PARSER,
    THINK,
    ReasoningSplitter,
    ThinkTags,
    split_reasoning,
    starts_inside,
    template_tags,
)
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
    call_tags,
    check_tools,
    forcing_grammar,
    new_call_id,
    parse_tool_calls,
    pick_parser,
    several_calls,
)
from vkrt.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputReading:
    """How one request's output is read: the tool-call parser (None: no tools offered), whether
    several calls may be answered, the reasoning split (None: off; else whether the output starts
    inside a thought) and its tags, and whether it is harmony, whose channels give all three
    (vkrt/server/harmony.py), with the header of a message its prompt left open."""

    parser: str | None
    parallel: bool
    inside: bool | None
    harmony: bool = False
    harmony_opened: str | None = None
    tags: ThinkTags = THINK

    def split(self, text: str, tools: list[dict[str, Any]] | None) -> tuple[str | None, str, list[ToolCall] | None]:
        """(reasoning, content, the calls or None when it answers none) of a whole output."""
        calls: list[ToolCall] = []
        if self.harmony:
            reasoning, content, named = harmony.parse(text, self.harmony_opened)
            if self.parser is not None:
                calls = [ToolCall(name, arguments) for name, arguments in named]
        else:
            reasoning, content = (split_reasoning(text, self.inside, self.tags) if self.inside is not None
                                  else (None, text))
            if self.parser is not None:
                before, calls = parse_tool_calls(content, self.parser, tools)
                content = before if calls else content
        calls = calls if self.parallel else calls[:1]
        return (reasoning if self.inside is not None else None), content, calls or None


@dataclass
class StartedChat:
    """A chat request rendered, admitted and generating: what a route needs to answer it."""

    engine: EngineClient
    candidates: CandidateSet
    reading: OutputReading


def _reads_harmony(config: ServerConfig, template: str | None) -> bool:
    """Whether outputs are read as harmony: either parser flag says so, or the chat template
    speaks it and neither flag names another format."""
    if "harmony" in (config.reasoning_parser, config.tool_call_parser):
        return True
    return (config.tool_call_parser is None and config.reasoning_parser in ("auto", "none")
            and harmony.template_speaks_harmony(template))


@dataclass
class RenderedChat:
    """A chat request checked and rendered, not yet started."""

    engine: EngineClient
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    reading: OutputReading


async def start_chat(state: ServerState, body: ChatCompletionRequest, raw: Request, response_id: str,
                     arrival: float) -> StartedChat:
    """Check, render and start `body`; shared by /v1/chat/completions and /v1/responses."""
    chat = await render_chat(state, body)
    try:  # off the loop: a constrained request compiles its grammar here (a big schema takes long)
        opened = await open_candidates(state, response_id, [(chat.prompt_ids, chat.prompt)], [chat.params], body.n)
    except RequestError as exc:
        raise field_error(exc, body, "messages") from exc
    candidates = start_candidates(state, response_id, opened, arrival)
    log_request(state, response_id, request_id_of(raw.state), chat.prompt, chat.prompt_ids, chat.params)
    return StartedChat(chat.engine, candidates, chat.reading)


async def render_chat(state: ServerState, body: ChatCompletionRequest) -> RenderedChat:
    """Check `body`, render its prompt with the chat template, map its sampling fields."""
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    check_request_text(body, state.config.max_prompt_chars)
    forced = check_tools(body.tools, body.tool_choice)
    # tool_choice "none": the model is not offered the tools at all, and nothing is parsed.
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    parser = None
    template = engine.tokenizer.chat_template if engine.tokenizer else None
    speaks_harmony = _reads_harmony(state.config, template)
    mode = state.config.reasoning_parser
    tags = TAGS_BY_PARSER.get(mode) or (template_tags(template) if mode == "auto" else None)
    # A named tool_choice is exactly one call, whatever parallel_tool_calls says.
    parallel = several_calls(forced, body.parallel_tool_calls)
    if tools:
        parser = "harmony" if speaks_harmony else pick_parser(template, state.config.tool_call_parser)
    special = {} if speaks_harmony else special_ids(engine.tokenizer, _markers(tags, parser))
    if tools and forced and parser is not None:
        body._tool_grammar = forcing_grammar(tools, forced, parser, parallel, state.config.max_digits(), special)
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:
        template_kwargs = {"reasoning_effort": body.reasoning_effort, **(template_kwargs or {})}
    add_generation_prompt, continue_final = turn_flags(body)
    prompt, prompt_ids = await state.run_cpu(chat_prompt, engine, body.messages, add_generation_prompt,
                                             continue_final, template_kwargs, state.config, tools,
                                             inline=is_small(body))
    prompt_ids = truncated(prompt_ids, body, engine.max_model_len)
    params = sampling_params(body, state.config.max_digits())
    params = harmony.sampling_params(params, engine.tokenizer) if speaks_harmony else keep_markers(params, special)
    if speaks_harmony:
        inside = None if mode == "none" else False  # the analysis channel is the thought
        reading = OutputReading(parser, parallel, inside, True, harmony.open_header(prompt))
    else:
        inside = starts_inside(prompt, tags) if tags is not None else None
        reading = OutputReading(parser, parallel, inside, tags=tags or THINK)
    return RenderedChat(engine, prompt, prompt_ids, params, reading)


def _markers(tags: ThinkTags | None, parser: str | None) -> list[str]:
    """The tags the output is read by: its thought's and its tool calls'."""
    return ([tags.open, tags.close] if tags else []) + list(call_tags(parser))


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    response_id = new_response_id("chatcmpl")
    base: dict[str, Any] = {"id": response_id, "created": now_s(), "model": state.model_name}
    if body.use_beam_search:
        return await _beam_chat(state, body, raw, base, arrival)
    started = await start_chat(state, body, raw, response_id, arrival)
    engine, candidates, reading = started.engine, started.candidates, started.reading

    if body.stream:
        return event_stream(_stream(state, candidates, body, base, reading), candidates)

    [results] = await run_all(candidates.groups, raw)
    choices = [chat_choice(engine.tokenizer, body, index, result, reading) for index, result in enumerate(results)]
    response: dict[str, Any] = {**base, "object": "chat.completion", "choices": choices,
                                "usage": combined_usage([results]), "system_fingerprint": None}
    if results[0].prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(engine.tokenizer, results[0].prompt_logprobs)
    if body.return_token_ids:  # vLLM's: the prompt's top-level, each choice's in it
        response["prompt_token_ids"] = results[0].prompt_token_ids
    return JSONResponse(response)


async def _beam_chat(state: ServerState, body: ChatCompletionRequest, raw: Request, base: dict[str, Any],
                     arrival: float) -> Response:
    """The n best beams as the choices (vkrt/server/beam_search.py)."""
    check_beam_request(body)
    chat = await render_chat(state, body)
    log_request(state, base["id"], request_id_of(raw.state), chat.prompt, chat.prompt_ids, chat.params)
    try:
        results = await beam_results(state, base["id"], chat.prompt_ids, body, chat.params, arrival, raw)
    except RequestError as exc:
        raise field_error(exc, body, "messages") from exc
    choices = [chat_choice(chat.engine.tokenizer, body, index, result, chat.reading)
               for index, result in enumerate(results)]
    response: dict[str, Any] = {**base, "object": "chat.completion", "choices": choices,
                                "usage": combined_usage([results]), "system_fingerprint": None}
    if body.return_token_ids:
        response["prompt_token_ids"] = chat.prompt_ids
    return JSONResponse(response)


def chat_choice(tokenizer: Tokenizer | None, body: ChatCompletionRequest, index: int, result: Result,
                reading: OutputReading) -> dict[str, Any]:
    logprobs = (chat_logprobs(tokenizer, result.logprobs, body.return_tokens_as_token_ids)
                if result.logprobs is not None else None)
    reasoning, content, calls = reading.split(result.text, body.tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    finish_reason = result.finish_reason
    if calls is not None:
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [call.to_json() for call in calls]}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    if reading.inside is not None:
        message["reasoning_content"] = reasoning
    choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": result.stop_reason}
    if body.return_token_ids:
        choice["token_ids"] = result.token_ids
    return choice


Delta = tuple[dict[str, Any], Any, str | None]  # (delta, logprobs, finish_reason) of one chunk


class ChoiceStream:
    """One choice's stream: its updates turned into deltas of reasoning, content and tool calls."""

    def __init__(self, tokenizer: Tokenizer | None, reading: OutputReading,
                 tools: list[dict[str, Any]] | None = None, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids
        self.reading = reading
        self.harmony = harmony.HarmonyParser(reading.harmony_opened) if reading.harmony else None
        self.splitter = (ReasoningSplitter(reading.inside, reading.tags)
                         if reading.inside is not None and not reading.harmony
                         else None)
        self.calls = (ToolCallStream(reading.parser, reading.parallel, tools)
                      if reading.parser is not None and not reading.harmony else None)
        self.harmony_call_ids: list[str] = []

    @property
    def called(self) -> bool:
        """Whether the output streamed so far answered with tool calls."""
        return bool(self.harmony_call_ids) or (self.calls is not None and self.calls.found_calls)

    def deltas(self, update: Update) -> Iterator[Delta]:
        logprobs = (chat_logprobs(self.tokenizer, update.logprobs, self.tokens_as_ids)
                    if update.logprobs is not None else None)
        final = update.finish_reason is not None
        if self.harmony is not None:
            yield from self._harmony_deltas(self.harmony, update, logprobs)
            return
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
        yield from self._ordered(content, call_deltas, logprobs, update.finish_reason)

    def _harmony_deltas(self, parser: harmony.HarmonyParser, update: Update, logprobs: Any) -> Iterator[Delta]:
        pieces = parser.feed(update.text, final=update.finish_reason is not None)
        if pieces.reasoning and self.reading.inside is not None:
            yield {"reasoning_content": pieces.reasoning}, logprobs, None
            logprobs = None
        call_deltas: list[dict[str, Any]] = []
        for index, name, fragment in pieces.calls if self.reading.parser is not None else ():
            if index > 0 and not self.reading.parallel:
                continue
            if name is not None:
                self.harmony_call_ids.append(new_call_id())
                call_deltas.append({"index": index, "id": self.harmony_call_ids[index], "type": "function",
                                    "function": {"name": name, "arguments": ""}})
            elif call_deltas and call_deltas[-1]["index"] == index:
                call_deltas[-1]["function"]["arguments"] += fragment
            else:
                call_deltas.append({"index": index, "function": {"arguments": fragment}})
        yield from self._ordered(pieces.content, call_deltas, logprobs, update.finish_reason)

    def _ordered(self, content: str, call_deltas: list[dict[str, Any]], logprobs: Any,
                 finish_reason: str | None) -> Iterator[Delta]:
        """Content, then calls, then (at the end) the finish reason: "tool_calls" when it called."""
        if content or (logprobs is not None and not call_deltas):
            yield {"content": content}, logprobs, None
            logprobs = None
        if call_deltas:
            yield {"tool_calls": call_deltas}, logprobs, None
        if finish_reason is not None:
            yield {}, None, "tool_calls" if self.called and finish_reason == "stop" else finish_reason


async def _stream(state: ServerState, candidates: CandidateSet, body: ChatCompletionRequest, base: dict[str, Any],
                  reading: OutputReading) -> AsyncIterator[bytes]:
    """Chunks of every choice as they come, each with its index."""
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    tokenizer = state.require_engine().tokenizer
    chunk_base = {**base, "object": "chat.completion.chunk"}
    [generations] = candidates.groups

    def current_usage() -> dict[str, Any]:
        return combined_usage([[generation.result for generation in generations]])

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None,
              token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        if body.return_token_ids:
            choice["token_ids"] = token_ids or []
        payload = {**chunk_base, "choices": [choice]}
        if body.return_token_ids and "role" in delta:  # as vLLM streams it: with each choice's first chunk
            payload["prompt_token_ids"] = generations[index].result.prompt_token_ids
        if include_usage:
            payload["usage"] = current_usage() if continuous_usage else None
        return sse(payload)

    streams = [ChoiceStream(tokenizer, reading, body.tools, body.return_tokens_as_token_ids) for _ in generations]
    # OpenAI sends each choice's role first, alone, before any content.
    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""}, None, None)
    # A choice's ids not sent yet: they go with its next chunk (a delta held back, say a tool
    # call's text being parsed, holds them back too), so the chunks' ids join to the whole.
    pending: list[list[int]] = [[] for _ in generations]
    async for index, update in merged_updates(candidates.groups):
        pending[index] += update.token_ids
        for delta, logprobs, finish_reason in streams[index].deltas(update):
            yield chunk(index, delta, logprobs, finish_reason, pending[index])
            pending[index] = []
    if include_usage:
        yield sse({**chunk_base, "choices": [], "usage": current_usage()})
