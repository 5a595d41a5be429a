"""One ASGI middleware for what every request shares: request id, API key, header and body
limits, the body read timeout, and 500s.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched and a
client disconnect still reaches the route.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vkrt.server.config import PUBLIC_PATHS
from vkrt.server.errors import (
    BodyReadTimeout,
    BodyTooLarge,
    anthropic_error_response,
    error_response,
    read_timeout_response,
    wants_anthropic_errors,
)

log = logging.getLogger("vkrt.server")

REQUEST_ID_HEADER = "x-request-id"
_MAX_REQUEST_ID_LEN = 128
_CLOSE = {"Connection": "close"}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _incoming_request_id(scope: Scope) -> str:
    value = _header(scope, b"x-request-id")
    if value and len(value) <= _MAX_REQUEST_ID_LEN and value.isprintable():
        return value
    return uuid.uuid4().hex


def _head_bytes(scope: Scope) -> int:
    """Roughly the request line and headers as they came on the wire."""
    size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
    return size + sum(len(key) + len(value) + 4 for key, value in scope.get("headers", ()))


class ServerMiddleware:
    """Tags every response with x-request-id, checks the API key, limits headers and bodies,
    times out slow bodies, and turns an unhandled exception into a 500 without a traceback."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 max_header_bytes: int = 16 * 1024, read_timeout: float = 30.0,
                 public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.read_timeout = read_timeout
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        anthropic = wants_anthropic_errors(str(scope.get("path", "")))

        async def reply(status: int, text: str, code: str, headers: dict[str, str] | None = None) -> None:
            response = (anthropic_error_response(status, text, headers) if anthropic
                        else error_response(status, text, code=code, headers=headers))
            await response(scope, receive, send_with_id)

        rejection = self._reject(scope)
        if rejection is not None:
            await reply(*rejection)
            return

        received = 0
        body_done = False
        deadline = time.monotonic() + self.read_timeout

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect can come: wait as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise BodyReadTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, limited_receive, send_with_id)
        except Exception as exc:  # the last line of defence: log it, answer, keep serving
            cause = exc if isinstance(exc, (BodyTooLarge, BodyReadTimeout)) else exc.__cause__
            if not isinstance(cause, (BodyTooLarge, BodyReadTimeout)):
                log.exception("request %s failed", request_id)
            if started:
                return  # mid-response: nothing more can be said to the client
            if isinstance(cause, BodyTooLarge):
                await reply(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                            "request_too_large", _CLOSE)
            elif isinstance(cause, BodyReadTimeout):
                await read_timeout_response(anthropic)(scope, receive, send_with_id)
            else:
                await reply(500, f"internal server error (request id {request_id})", "internal_error")

    def _reject(self, scope: Scope) -> tuple[int, str, str, dict[str, str] | None] | None:
        """(status, message, code, headers) for a request refused before the app sees it."""
        if _head_bytes(scope) > self.max_header_bytes:
            return (431, f"request line and headers exceed the limit of {self.max_header_bytes} bytes "
                    "(--max-header-bytes)", "headers_too_large", _CLOSE)
        length = _header(scope, b"content-length")
        if length is not None and _header(scope, b"transfer-encoding") is not None:
            # RFC 9112 6.1: a request with both is a smuggling vector; refuse it and close.
            return (400, "a request may not carry both Content-Length and Transfer-Encoding",
                    "invalid_framing", _CLOSE)
        if not self._authorized(scope):
            return (401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'", "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return (413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} bytes",
                    "request_too_large", _CLOSE)
        return None

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or str(scope.get("path", "")) in self.public_paths:
            return True
        key = self.api_key.encode()
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return True
        # Anthropic-style clients and some gateways send the key in X-Api-Key instead.
        x_api_key = _header(scope, b"x-api-key")
        return x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), key)


def request_id_of(state: Any) -> str:
    """The x-request-id the middleware assigned to this request."""
    return str(getattr(state, "request_id", "") or uuid.uuid4().hex)
