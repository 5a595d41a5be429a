"""Pieces both OpenAI routes share: response ids, usage, SSE framing, request logging."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vkrt.engine.config import SamplingParams
from vkrt.server.errors import APIError, error_body, shown
from vkrt.server.generation import Result, ServerState

log = logging.getLogger("vkrt.server")

SSE_DONE = b"data: [DONE]\n\n"


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def combined_usage(groups: list[list[Result]]) -> dict[str, Any]:
    """Usage of several prompts (groups), each with its candidates: a prompt counts once and its
    cached tokens are its first candidate's (the siblings reuse what that one computed)."""
    prompt = sum(len(group[0].prompt_token_ids) for group in groups)
    completion = sum(len(result.token_ids) for group in groups for result in group)
    cached = sum(group[0].num_cached_tokens for group in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, allow_nan=False).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends: a stream whose client left
    before the first chunk never starts its generator, so the generator cannot be relied on."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Releasable(Protocol):
    request_id: str

    def release(self) -> None: ...


def _openai_error_event(status: int, message: str, param: str | None, code: str | None) -> bytes:
    return sse(error_body(status, message, param, code))


ErrorEvent = Callable[[int, str, str | None, str | None], bytes]  # (status, message, param, code)


def event_stream(chunks: AsyncIterator[bytes], generation: _Releasable, *,
                 error_event: ErrorEvent = _openai_error_event, done: bytes = SSE_DONE) -> StreamingResponse:
    """An SSE response; an error after the headers went out becomes an error event, then
    `done` ([DONE]; the Anthropic route ends without one)."""
    request_id = generation.request_id

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as exc:
            yield error_event(exc.status, exc.message, exc.param, exc.code)
        except Exception:
            log.exception("request %s failed mid-stream", request_id)
            yield error_event(500, f"internal server error (request id {request_id})", None, "internal_error")
        if done:
            yield done

    return _EventStream(guarded(), generation.release, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def check_model(state: ServerState, requested: str | None) -> None:
    """404 for a model name this server does not serve (no name: the served model)."""
    if requested and requested != state.model_name:
        raise APIError(404, f"model {shown(requested)} does not exist; this server serves {state.model_name!r} "
                       "(see GET /v1/models)", param="model", code="model_not_found")


def log_request(state: ServerState, response_id: str, header_id: str, prompt: str | None,
                prompt_ids: list[int], params: SamplingParams) -> None:
    if not state.config.enable_log_requests:
        return
    limit = state.config.max_log_len
    shown_prompt = prompt if prompt is None or limit is None else prompt[:limit]
    shown_ids = prompt_ids if limit is None else prompt_ids[:limit]
    log.info("request %s (x-request-id %s): prompt=%r, prompt_token_ids=%s (%d), params=%s",
             response_id, header_id, shown_prompt, shown_ids, len(prompt_ids), params)
