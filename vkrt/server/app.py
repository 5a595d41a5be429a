"""The FastAPI app: routes, the engine's load lifecycle, and the shared middleware."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from vkrt import __version__
from vkrt.engine.config import SamplingParams
from vkrt.server import schemas
from vkrt.server.chat import create_chat_completion
from vkrt.server.completions import create_completion
from vkrt.server.config import PUBLIC_PATHS, ServerConfig
from vkrt.server.embeddings import add_embedding_routes
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError, install_error_handlers, shown
from vkrt.server.generation import ServerState
from vkrt.server.infill import create_infill
from vkrt.server.messages_api import add_messages_routes
from vkrt.server.middleware import ServerMiddleware
from vkrt.server.pooling import warm_up_pooling
from vkrt.server.prompts import chat_prompt, check_prompt_chars, check_request_text, turn_flags
from vkrt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InfillRequest,
    TokenizeRequest,
)
from vkrt.server.rerank import add_rerank_routes
from vkrt.server.responses import check_model
from vkrt.server.responses_api import add_responses_routes
from vkrt.server.webui import UI_PATHS, add_ui_routes
from vkrt.tokenizer import Tokenizer

log = logging.getLogger("vkrt.server")

EngineLoader = Callable[[], EngineClient]

# Errors any route behind the middleware can answer, and those of the POST routes.
_COMMON = (401, 431, 500)
_POST = (*_COMMON, 400, 404, 408, 413, 503)


def build_app(engine: EngineClient | None, config: ServerConfig, *, loader: EngineLoader | None = None,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`, or over the engine `loader` builds in the
    background once the server is up (GET /health answers 503 until it is ready).
    `on_fatal(error)` is called when the engine cannot serve: its load failed, or its device was lost."""
    state = ServerState(config, engine)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(_load(state, loader, on_fatal)) if loader is not None else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            state.close()
            await _shutdown(state.engine)

    # One schema per model for requests and responses: the routes' JSON leaves optional
    # fields out, which a separate output schema would mark required.
    app = FastAPI(title="vkrt", version=__version__, lifespan=lifespan, separate_input_output_schemas=False)
    app.state.server = state
    install_error_handlers(app)
    public = PUBLIC_PATHS | ({"/metrics"} if config.public_metrics else set())
    if not config.disable_ui:
        add_ui_routes(app)  # the page is public; what it calls needs the key
        public |= UI_PATHS
    app.add_middleware(ServerMiddleware, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes,
                       max_header_bytes=config.max_header_bytes, read_timeout=config.timeout_read,
                       public_paths=frozenset(public))
    if config.allowed_origins:
        # Added last, so outside the auth middleware: a browser's preflight carries no key.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health", response_class=Response, responses={
        200: {"description": "the model is loaded: an empty body"},
        503: {"model": schemas.ErrorResponse, "description": "still loading, or the load failed"}})
    async def health() -> Response:
        if state.ready:
            return Response(status_code=200)
        state.require_engine()  # raises the 503 that says why
        return Response(status_code=503)

    @app.get("/ready", response_class=Response, responses={
        200: {"description": "loaded and warmed up: an empty body"},
        503: {"model": schemas.ErrorResponse, "description": "still loading or warming up, or the load failed"}})
    async def ready() -> Response:
        state.require_engine()  # raises the 503 that says why
        if not state.warm:
            raise APIError(503, "the model is warming up; retry when GET /ready answers 200", code="model_not_ready")
        return Response(status_code=200)

    @app.get("/live", response_class=Response, responses={200: {"description": "the server answers: an empty body"}})
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/version", response_model=schemas.VersionResponse, responses=schemas.error_responses(500))
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"},
                        404: {"model": schemas.ErrorResponse, "description": "--disable-metrics"},
                        **schemas.error_responses(*_COMMON)})
    async def metrics() -> Response:
        if config.disable_metrics:
            raise APIError(404, "metrics are disabled (--disable-metrics)", code="not_found")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # The OpenAI routes also answer under the root path (llama-server's; the openai SDK with a
    # base URL without /v1): the same operations, so the document lists each once.
    @app.get("/v1/models", response_model=schemas.ModelList, responses=schemas.error_responses(*_COMMON))
    @app.get("/models", include_in_schema=False)
    async def models() -> dict[str, Any]:
        max_model_len = state.engine.max_model_len if state.ready and state.engine else None
        # The file or directory name only: the absolute path says too much about the host.
        root = Path(config.model).name if config.model else state.model_name
        card = {"id": state.model_name, "object": "model", "created": created, "owned_by": "vkrt",
                "root": root, "parent": None, "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", responses={
        200: {"model": schemas.CompletionResponse, "content": schemas.SSE,
              "description": "the completion; with stream=true, server-sent events"},
        **schemas.error_responses(*_POST, 429)})
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, body, raw)

    @app.post("/v1/chat/completions", responses={
        200: {"model": schemas.ChatCompletionResponse, "content": schemas.SSE,
              "description": "the chat completion; with stream=true, server-sent events"},
        **schemas.error_responses(*_POST, 429)})
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, body, raw)

    @app.post("/invocations", openapi_extra=schemas.INVOCATIONS_BODY, responses={
        200: {"model": schemas.InvocationResponse, "content": schemas.SSE,
              "description": "a chat completion for a body with `messages`, else a completion for one with `prompt`"},
        **schemas.error_responses(*_POST, 429)})
    async def invocations(raw: Request) -> Response:
        body = await invocation_body(raw)
        if isinstance(body, ChatCompletionRequest):
            return await create_chat_completion(state, body, raw)
        return await create_completion(state, body, raw)

    @app.post("/infill", responses={
        200: {"model": schemas.InfillResponse, "content": schemas.SSE,
              "description": "the code between prefix and suffix; with stream=true, server-sent events"},
        **schemas.error_responses(*_POST, 429)})
    async def infill(body: InfillRequest, raw: Request) -> Response:
        return await create_infill(state, body, raw)

    add_responses_routes(app, state, schemas.error_responses(*_POST, 429))
    add_messages_routes(app, state)  # the Anthropic Messages API
    add_embedding_routes(app, state, schemas.error_responses(*_POST, 429))
    add_rerank_routes(app, state, schemas.error_responses(*_POST, 429))

    @app.post("/tokenize", response_model=schemas.TokenizeResponse, responses=schemas.error_responses(*_POST))
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(state, body.model)
        engine = state.require_engine()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value")
        check_request_text(body, config.max_prompt_chars)
        return JSONResponse(await state.run_cpu(_tokenize, engine, body, config))

    @app.post("/detokenize", response_model=schemas.DetokenizeResponse,
              responses=schemas.error_responses(*_POST))
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        check_model(state, body.model)
        tokenizer = require_tokenizer(state.require_engine(), "tokens")
        return JSONResponse({"prompt": await state.run_cpu(_detokenize, tokenizer, body.tokens)})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def invocation_body(raw: Request) -> ChatCompletionRequest | CompletionRequest:
    """POST /invocations's body as the request its shape names, as vLLM dispatches it (SageMaker
    calls this one route): a chat request when it has `messages`, a completion with `prompt`."""
    try:
        payload = json.loads(await raw.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    kind: type[ChatCompletionRequest | CompletionRequest] | None = None
    if isinstance(payload, dict):
        kind = ChatCompletionRequest if "messages" in payload else CompletionRequest if "prompt" in payload else None
    if kind is None:
        raise APIError(400, "send a chat request (with 'messages') or a completion request (with 'prompt')",
                       code="invalid_value")
    try:
        return kind.model_validate(payload)
    except ValidationError as exc:  # answered as the routes answer theirs: a 400 naming the field
        raise RequestValidationError(exc.errors()) from None


def _tokenize(engine: EngineClient, body: TokenizeRequest, config: ServerConfig) -> dict[str, Any]:
    tokenizer = require_tokenizer(engine, "prompt")
    if body.messages is not None:
        text, ids = chat_prompt(engine, body.messages, *turn_flags(body), body.chat_template_kwargs, config)
        if body.add_special_tokens:  # off by default: the template writes its own BOS
            ids = tokenizer.encode(text, add_special_tokens=True)
    else:
        text = body.prompt or ""
        check_prompt_chars(len(text), config.max_prompt_chars, "prompt")
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode(text, add_special_tokens=add_special)
    # vLLM's: the vocabulary's pieces ("Ġis"), not how each token decodes alone
    token_strs = [tokenizer.token_piece(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": token_strs}


def _detokenize(tokenizer: Tokenizer, tokens: list[int]) -> str:
    bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: id {shown(bad)} is outside the vocabulary [0, {tokenizer.vocab_size})",
                       param="tokens", code="invalid_value")
    return tokenizer.decode(tokens)


def _openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without its automatic 422: validation errors are answered 400."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           separate_input_output_schemas=False)
    for path in document.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    schemas_ = document.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas_.pop(unused, None)
    return document


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
    add_fatal_listener = getattr(engine, "add_fatal_listener", None)  # AsyncLLM has one; test doubles may not
    if on_error is not None and add_fatal_listener is not None:
        add_fatal_listener(on_error)
    try:
        await warm_up(engine)
    except Exception as exc:
        state.load_error = f"the warm-up generation failed: {exc}"
        log.error("model failed to warm up: %s", exc)
        if on_error is not None:
            on_error(exc)
        return
    state.warm = True
    log.info("model %s ready in %.1f s", state.model_name, time.monotonic() - started)


async def warm_up(engine: EngineClient) -> None:
    """One greedy generation of 2 tokens from 1 prompt token (1 where max_model_len is 2): creates
    the pipelines and records the decode step, so the first client does not wait for them (GET
    /ready waits for this)."""
    if engine.model_config.num_labels:  # a classifier does not generate
        await warm_up_pooling(engine)
        return
    params = SamplingParams(max_tokens=min(2, engine.max_model_len - 1), temperature=0.0, ignore_eos=True)
    async for _ in engine.generate([0], params, request_id="vkrt-warm-up"):
        pass


async def _shutdown(engine: EngineClient | None) -> None:
    close = getattr(engine, "shutdown", None) or getattr(engine, "close", None)
    if close is None:
        return
    result = close()
    if inspect.isawaitable(result):
        await result
