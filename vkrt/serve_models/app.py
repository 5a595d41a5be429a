"""The multi-model server's own app: it lists the models, loads and unloads them, merges their
metrics, and forwards every other request to the model its body's `model` names.

A forwarded request reaches that model's own `vkrt serve`, so every route, error and stream is the
single-model server's. The middleware (API key, limits, request ids) runs here, in front of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from starlette.background import BackgroundTask

from vkrt import __version__
from vkrt.serve_models.metrics import merged_metrics
from vkrt.serve_models.pool import ModelBusy, ModelPool
from vkrt.serve_models.process import ModelLoadError, ModelProcess, ModelState
from vkrt.server import schemas
from vkrt.server.config import PUBLIC_PATHS, ServerConfig
from vkrt.server.errors import (
    APIError,
    anthropic_error_body,
    error_body,
    install_error_handlers,
    shown,
    wants_anthropic_errors,
)
from vkrt.server.middleware import ServerMiddleware
from vkrt.server.webui import UI_PATHS, add_ui_routes

log = logging.getLogger("vkrt.serve_models")

# Headers that describe one hop's connection, not the request or answer (RFC 9110 7.6.1), and the
# length, which the forwarding re-frames.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                          "transfer-encoding", "upgrade", "host", "content-length"})
_FORWARD_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]


class ModelStatus(BaseModel):
    value: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    error: str | None = None  # why the last load failed, or why the model's process ended


class ModelCard(schemas.ModelCard):
    status: ModelStatus


class ModelCardList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ModelRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str


class LoadAnswer(BaseModel):
    success: bool  # unload: False when the model was not loaded
    model: ModelCard


class HealthAnswer(BaseModel):
    models: dict[str, Literal["unloaded", "loading", "loaded", "unloading", "failed"]]


_COMMON = (401, 431, 500)


def build_models_app(pool: ModelPool, config: ServerConfig) -> FastAPI:
    """The app in front of the pool's models; `config` holds the listening server's own settings
    (API key, limits, page, metrics)."""
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="vkrt (several models)", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    public = PUBLIC_PATHS | ({"/metrics"} if config.public_metrics else set())
    if not config.disable_ui:
        add_ui_routes(app)
        public |= UI_PATHS
    app.add_middleware(ServerMiddleware, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes,
                       max_header_bytes=config.max_header_bytes, read_timeout=config.timeout_read,
                       public_paths=frozenset(public))

    @app.get("/health", response_model=HealthAnswer, responses=schemas.error_responses(500))
    @app.get("/ready", include_in_schema=False)
    @app.get("/live", include_in_schema=False)
    async def health() -> dict[str, Any]:
        """The server answers; each model loads when first asked for (its state in the body)."""
        pool.refresh()
        return {"models": {name: m.state.value for name, m in pool.models.items()}}

    @app.get("/version", response_model=schemas.VersionResponse, responses=schemas.error_responses(500))
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelCardList, responses=schemas.error_responses(*_COMMON))
    @app.get("/models", include_in_schema=False)
    async def models() -> dict[str, Any]:
        pool.refresh()
        return {"object": "list", "data": [_card(m, created) for m in pool.models.values()]}

    @app.get("/v1/models/{name}", response_model=ModelCard, responses=schemas.error_responses(*_COMMON, 404))
    async def model(name: str) -> dict[str, Any]:
        pool.refresh()
        return _card(_lookup(pool, name), created)

    @app.post("/models/load", response_model=LoadAnswer, responses=schemas.error_responses(*_COMMON, 400, 404, 503))
    async def load(body: ModelRequest) -> dict[str, Any]:
        name = _lookup(pool, body.model).name
        await _loaded(pool.load(name), name)
        return {"success": True, "model": _card(pool.models[name], created)}

    @app.post("/models/unload", response_model=LoadAnswer, responses=schemas.error_responses(*_COMMON, 400, 404))
    async def unload(body: ModelRequest) -> dict[str, Any]:
        name = _lookup(pool, body.model).name
        return {"success": await pool.unload(name), "model": _card(pool.models[name], created)}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format: every loaded model's, and the loads"},
                        404: {"model": schemas.ErrorResponse, "description": "--disable-metrics"},
                        **schemas.error_responses(*_COMMON)})
    async def metrics() -> Response:
        if config.disable_metrics:
            raise APIError(404, "metrics are disabled (--disable-metrics)", code="not_found")
        return Response(await merged_metrics(pool), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=_FORWARD_METHODS, include_in_schema=False)
    async def forward(request: Request) -> Response:
        body = await request.body()
        parsed = _parse(body)
        if parsed is None and "model" not in request.query_params and len(pool.models) > 1:
            # Not a request for a model (no JSON body naming one): there is no such route here.
            raise APIError(404, f"no route {request.method} {shown(request.url.path)}", code="not_found")
        name = _named(pool, parsed, request.url.path, query=request.query_params.get("model"))
        return await _forward(pool, await _loaded(pool.acquire(name), name), request, body)

    return app


def _card(model: ModelProcess, created: int) -> dict[str, Any]:
    """vLLM's model card, with llama-server router mode's `status` (and why a load failed)."""
    status: dict[str, Any] = {"value": model.state.value}
    if model.state == ModelState.FAILED and model.error:
        status["error"] = model.error
    return {"id": model.name, "object": "model", "created": created, "owned_by": "vkrt",
            "root": _file_name(model.config.model), "parent": None,
            "max_model_len": model.max_model_len if model.state == ModelState.LOADED else None, "status": status}


def _file_name(path: Any) -> str:
    from pathlib import Path

    return Path(str(path)).name  # never the absolute path: it says too much about the host


def _parse(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _lookup(pool: ModelPool, name: str) -> ModelProcess:
    model = pool.models.get(name)
    if model is None:
        raise APIError(404, f"model {shown(name)} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in pool.models)} (see GET /v1/models)", param="model",
                       code="model_not_found")
    return model


def _named(pool: ModelPool, body: dict[str, Any] | None, path: str, query: str | None = None) -> str:
    """The configured model a request names by its body's `model` (or `?model=`); with one model
    configured a request may leave it out. A name is only ever matched, never used as a path."""
    requested = body.get("model") if body is not None else None
    if requested is None:
        requested = query
    if requested is None or requested == "":
        if len(pool.models) == 1:
            return next(iter(pool.models))
        raise APIError(400, f"name the model: this server serves {', '.join(repr(n) for n in pool.models)} "
                       "(see GET /v1/models)", param="model", code="model_required")
    if not isinstance(requested, str):
        raise APIError(400, "model must be a string", param="model", code="invalid_value")
    return _lookup(pool, requested).name


async def _loaded(loading: Any, name: str) -> ModelProcess:
    try:
        return await loading
    except ModelBusy as exc:
        raise APIError(503, str(exc), param="model", code="model_busy") from exc
    except ModelLoadError as exc:
        raise APIError(503, str(exc), param="model", code="model_load_failed") from exc


async def _forward(pool: ModelPool, model: ModelProcess, request: Request, body: bytes) -> Response:
    """Send the request to the model's server and pass its answer back (a stream as it comes);
    the model counts the request in flight until its answer has been passed on in full."""
    url = httpx.URL(f"{model.url}{request.url.path}", query=request.url.query.encode())
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP_HEADERS]
    streaming = False
    try:
        try:
            answer = await pool.client.send(pool.client.build_request(request.method, url, headers=headers,
                                                                      content=body), stream=True)
        except httpx.HTTPError as exc:
            log.warning("model %r did not take %s: %s", model.name, request.url.path, exc)
            return _error(request.url.path, 503, f"model {model.name!r} stopped before answering; retry",
                          "model_lost")
        headers_out = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            streaming = True

            async def done() -> None:  # after the stream, also when the client left early
                await answer.aclose()
                await pool.release(model)

            return StreamingResponse(_relay(model, answer, request.url.path), status_code=answer.status_code,
                                     headers=headers_out, background=BackgroundTask(done))
        try:
            content = await answer.aread()
        except httpx.HTTPError as exc:
            log.warning("model %r stopped while answering %s: %s", model.name, request.url.path, exc)
            return _error(request.url.path, 503, f"model {model.name!r} stopped while answering; retry",
                          "model_lost")
        finally:
            await answer.aclose()
        return Response(content, status_code=answer.status_code, headers=headers_out)
    finally:
        if not streaming:
            await pool.release(model)


async def _relay(model: ModelProcess, answer: httpx.Response, path: str) -> AsyncIterator[bytes]:
    """A stream's bytes as the model sends them; a model that stops mid-stream ends it with an
    error event in the route's shape. Closing the answer early (the client left) closes the
    connection to the model, which aborts its request."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("model %r stopped while streaming %s: %s", model.name, path, exc)
        message = f"model {model.name!r} stopped; the answer is incomplete"
        if wants_anthropic_errors(path):
            yield b"event: error\ndata: " + json.dumps(anthropic_error_body(503, message)).encode() + b"\n\n"
        else:
            yield b"data: " + json.dumps(error_body(503, message, code="model_lost")).encode() + b"\n\n"


def _error(path: str, status: int, message: str, code: str) -> JSONResponse:
    if wants_anthropic_errors(path):
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    return JSONResponse(error_body(status, message, code=code), status_code=status)
