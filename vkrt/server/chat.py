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
from vkrt.server.responses import check_model, event_stream, now_s, sse, start_generation, usage
from vkrt.server.sampling import chat_prompt, check_request_text, check_unsupported


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    check_request_text(body, state.config.max_prompt_chars)
    prompt, prompt_ids = await state.run_cpu(chat_prompt, engine, body.messages, body.add_generation_prompt,
                                             body.continue_final_message, body.chat_template_kwargs, state.config)
    generation = start_generation(state, raw, body, prompt_ids, prompt, "messages", "chatcmpl", arrival)
    base: dict[str, Any] = {"id": generation.request_id, "created": now_s(), "model": state.model_name}

    if body.stream:
        return event_stream(_stream(state, generation, body, base), generation)

    result = await generation.run(raw)
    logprobs = chat_logprobs(engine.tokenizer, result.logprobs) if result.logprobs is not None else None
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
    response: dict[str, Any] = {**base, "object": "chat.completion", "choices": [choice],
                                "usage": usage(result), "system_fingerprint": None}
    if result.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(engine.tokenizer, result.prompt_logprobs)
    return JSONResponse(response)


async def _stream(state: ServerState, generation: Generation, body: ChatCompletionRequest,
                  base: dict[str, Any]) -> AsyncIterator[bytes]:
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
    async for update in generation.updates():
        logprobs = chat_logprobs(tokenizer, update.logprobs) if update.logprobs is not None else None
        delta = {"content": update.text} if update.text or update.finish_reason is None else {}
        yield chunk(delta, logprobs, update.finish_reason)
    if include_usage:
        yield sse({**chunk_base, "choices": [], "usage": usage(generation.result)})
