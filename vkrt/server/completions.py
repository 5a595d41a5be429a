"""POST /v1/completions: one prompt in, text out (streamed as SSE or whole)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vkrt.server.engine_client import require_tokenizer
from vkrt.server.generation import Generation, ServerState
from vkrt.server.logprobs import completion_logprobs, prompt_logprobs_json
from vkrt.server.protocol import CompletionRequest
from vkrt.server.responses import check_model, event_stream, now_s, sse, start_generation, usage
from vkrt.server.sampling import check_request_text, check_unsupported, completion_prompt_ids


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    check_request_text(body, state.config.max_prompt_chars)
    prompt_ids = await state.run_cpu(completion_prompt_ids, engine, body, state.config.max_prompt_chars)
    prompt_text = body.prompt if isinstance(body.prompt, str) else None
    generation = start_generation(state, raw, body, prompt_ids, prompt_text, "prompt", "cmpl", arrival)
    echo_text = ""
    if body.echo and prompt_text is not None:
        echo_text = prompt_text
    elif body.echo:  # token ids, checked against the vocabulary by start_generation
        try:
            echo_text = require_tokenizer(engine, "prompt").decode(prompt_ids)
        except BaseException:
            generation.release()
            raise
    base: dict[str, Any] = {"id": generation.request_id, "object": "text_completion", "created": now_s(),
                            "model": state.model_name}

    if body.stream:
        return event_stream(_stream(state, generation, body, base, echo_text), generation)

    result = await generation.run(raw)
    logprobs = None
    if result.logprobs is not None:
        logprobs = completion_logprobs(engine.tokenizer, result.logprobs, 0)
    choice = {"index": 0, "text": echo_text + result.text, "logprobs": logprobs,
              "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
    if result.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(engine.tokenizer, result.prompt_logprobs)
    return JSONResponse({**base, "choices": [choice], "usage": usage(result), "system_fingerprint": None})


async def _stream(state: ServerState, generation: Generation, body: CompletionRequest,
                  base: dict[str, Any], echo_text: str) -> AsyncIterator[bytes]:
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    tokenizer = state.require_engine().tokenizer
    offset = 0

    def chunk(text: str, logprobs: Any, finish_reason: str | None) -> bytes:
        payload = {**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason}]}
        if include_usage:
            payload["usage"] = usage(generation.result) if continuous_usage else None
        return sse(payload)

    if echo_text:
        yield chunk(echo_text, None, None)
    async for update in generation.updates():
        logprobs = None
        if update.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, update.logprobs, offset)
            offset += sum(len(token) for token in logprobs["tokens"])
        yield chunk(update.text, logprobs, update.finish_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(generation.result)})
