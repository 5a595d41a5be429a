"""The application's HTTP ingress: forwards each request to an engine replica, answers /health.

The ingress reads a request whole, keys it by its prompt's prefix blocks and sends it through the
engine deployment's handle (the PrefixAffinityRouter picks the replica). A replica that dies
before it has begun to answer costs nothing: the request goes to another one. One that dies while
answering ends a stream with an error event (in the route's own error shape) and a whole answer
with a 503, never a hang. /health and /ready are the application's: 200 while at least one replica
is ready, with the count in `x-vkrt-ready-replicas` and the body; /live is the ingress's own 200.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.schema import ReplicaState
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from vkrt.errors import VkrtError
from vkrt.serve_ray.forward import ForwardedRequest, ResponseStart, block_hashes, prompt_token_ids
from vkrt.server import ServerConfig
from vkrt.server.errors import anthropic_error_body, error_body, wants_anthropic_errors
from vkrt.tokenizer import Tokenizer

log = logging.getLogger("vkrt.serve_ray")

ENGINE_DEPLOYMENT = "vkrt-engine"
INGRESS_DEPLOYMENT = "vkrt-ingress"
HEALTH_PATHS = frozenset({"/health", "/ready"})  # ready: loaded and warmed, as a replica is once RUNNING
READY_HEADER = "x-vkrt-ready-replicas"
# A request a dead replica never began to answer is sent again, to another replica, this many times.
_ATTEMPTS = 3


class Ingress:
    """A Ray Serve deployment class: the one HTTP entry of the application."""

    def __init__(self, engine: DeploymentHandle, config: ServerConfig) -> None:
        self.engine = engine.options(stream=True)
        self.config = config
        self.block_size = config.engine_config().block_size
        self.tokenizer = _tokenizer(config)

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/live":
            return Response(status_code=200)  # the ingress answers, whatever the replicas do
        if request.url.path in HEALTH_PATHS:
            return await self._health()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_request_body_bytes:
                return _error(request.url.path, 413, f"the request body is over {self.config.max_request_body_bytes} "
                              "bytes", "request_too_large")
        ids = prompt_token_ids(request.url.path, bytes(body), self.tokenizer)
        forwarded = ForwardedRequest(
            method=request.method, path=request.url.path, query_string=request.url.query.encode(),
            headers=tuple(request.headers.raw), body=bytes(body),
            block_hashes=block_hashes(ids, self.block_size) if ids else ())
        return await self._forward(forwarded)

    async def _forward(self, request: ForwardedRequest) -> Response:
        for attempt in range(1, _ATTEMPTS + 1):
            parts = cast(DeploymentResponseGenerator, self.engine.handle.remote(request))
            try:
                start = await parts.__anext__()
            except RayActorError as exc:
                log.warning("a replica died before answering %s (attempt %d of %d): %s", request.path, attempt,
                            _ATTEMPTS, exc)
                continue
            except StopAsyncIteration:
                return _error(request.path, 502, "the replica ended the request without an answer", "replica_error")
            if not isinstance(start, ResponseStart):
                return _error(request.path, 502, "the replica answered out of order", "replica_error")
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers}
            if headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(_stream(parts, request.path), status_code=start.status, headers=headers)
            try:
                body = b"".join([part async for part in parts])
            except RayActorError as exc:
                log.warning("the replica answering %s died mid-answer: %s", request.path, exc)
                return _error(request.path, 503, "the replica answering this request stopped; retry it",
                              "replica_lost")
            return Response(body, status_code=start.status, headers=headers)
        return _error(request.path, 503, f"no replica could take the request ({_ATTEMPTS} died before answering); "
                      "retry it", "replica_lost")

    async def _health(self) -> Response:
        ready, states = await asyncio.to_thread(_replica_states)
        body = {"ready_replicas": ready, "replicas": states}
        return JSONResponse(body, status_code=200 if ready else 503, headers={READY_HEADER: str(ready)})


async def _stream(parts: DeploymentResponseGenerator, path: str) -> AsyncIterator[bytes]:
    ended = False
    try:
        async for part in parts:
            yield part
        ended = True
    except RayActorError as exc:
        ended = True
        log.warning("the replica streaming %s died: %s", path, exc)
        message = "the replica serving this stream stopped; the answer is incomplete"
        if wants_anthropic_errors(path):
            yield b"event: error\ndata: " + _json(anthropic_error_body(503, message)) + b"\n\n"
        else:
            yield b"data: " + _json(error_body(503, message, code="replica_lost")) + b"\n\n"
    finally:
        if not ended:  # the client left: cancelling the call is the disconnect the replica's app sees
            parts.cancel()


def _replica_states() -> tuple[int, dict[str, int]]:
    """Ready (RUNNING) replicas of the engine deployment, and the count in each state."""
    context = serve.get_replica_context()
    application = serve.status().applications.get(context.app_name)
    deployment = application.deployments.get(ENGINE_DEPLOYMENT) if application is not None else None
    states = dict(deployment.replica_states) if deployment is not None else {}
    return states.get(ReplicaState.RUNNING, 0), {str(state): n for state, n in states.items()}


def _tokenizer(config: ServerConfig) -> Tokenizer | None:
    """The model's tokenizer for routing keys, or None (the prompts then route by load alone)."""
    if not config.model:
        return None
    try:
        return Tokenizer.from_model(Path(config.model))
    except (VkrtError, OSError) as exc:
        log.info("no tokenizer for prefix routing (%s): text prompts route by load", exc)
        return None


def _error(path: str, status: int, message: str, code: str) -> JSONResponse:
    body = anthropic_error_body(status, message) if wants_anthropic_errors(path) else error_body(status, message,
                                                                                                  code=code)
    return JSONResponse(body, status_code=status)


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()
