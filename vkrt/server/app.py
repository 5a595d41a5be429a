"""The FastAPI app: routes, the engine's load lifecycle, and the shared middleware."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vkrt import __version__
from vkrt.server.chat import create_chat_completion
from vkrt.server.completions import create_completion
from vkrt.server.config import ServerConfig
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError, install_error_handlers
from vkrt.server.generation import ServerState
from vkrt.server.middleware import ServerMiddleware
from vkrt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vkrt.server.responses import check_model
from vkrt.server.sampling import chat_prompt

log = logging.getLogger("vkrt.server")

EngineLoader = Callable[[], EngineClient]


def build_app(engine: EngineClient | None, config: ServerConfig, *, loader: EngineLoader | None = None,
              on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`, or over the engine `loader` builds in the
    background once the server is up (GET /health answers 503 until it is ready)."""
    state = ServerState(config, engine)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(_load(state, loader, on_load_error)) if loader is not None else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await _shutdown(state.engine)

    app = FastAPI(title="vkrt", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(ServerMiddleware, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return Response(status_code=200)
        state.require_engine()  # raises the 503 that says why
        return Response(status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if config.disable_metrics:
            raise APIError(404, "metrics are disabled (--disable-metrics)", code="not_found")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_model_len = state.engine.max_model_len if state.ready and state.engine else None
        card = {"id": state.model_name, "object": "model", "created": created, "owned_by": "vkrt",
                "root": str(config.model or state.model_name), "parent": None, "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(state, body.model)
        engine = state.require_engine()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value")
        tokenizer = require_tokenizer(engine, "prompt")
        if body.messages is not None:
            text = chat_prompt(engine, body.messages, body.add_generation_prompt, body.continue_final_message,
                               body.chat_template_kwargs)
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
        token_strs = [tokenizer.token_text(i) for i in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": token_strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        check_model(state, body.model)
        tokenizer = require_tokenizer(state.require_engine(), "tokens")
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                           param="tokens", code="invalid_value")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    return app


async def _load(state: ServerState, loader: EngineLoader,
                on_error: Callable[[BaseException], None] | None) -> None:
    """Build the engine off the event loop so /health can answer 503 meanwhile."""
    started = time.monotonic()
    try:
        engine = await asyncio.to_thread(loader)
    except Exception as exc:
        state.load_error = str(exc)
        log.error("model failed to load: %s", exc)
        if on_error is not None:
            on_error(exc)
        return
    state.engine = engine
    log.info("model %s ready in %.1f s", state.model_name, time.monotonic() - started)


async def _shutdown(engine: EngineClient | None) -> None:
    close = getattr(engine, "shutdown", None) or getattr(engine, "close", None)
    if close is None:
        return
    result = close()
    if inspect.isawaitable(result):
        await result
