"""One ASGI middleware for what every request shares: request id, API key, body size, 500s.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched and a
client disconnect still reaches the route.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vkrt.server.errors import BodyTooLarge, error_response

log = logging.getLogger("vkrt.server")

REQUEST_ID_HEADER = "x-request-id"
_MAX_REQUEST_ID_LEN = 128


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


class ServerMiddleware:
    """Tags every response with x-request-id, checks the API key on /v1/*, limits bodies,
    and turns an unhandled exception into a 500 error body without a traceback."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

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

        async def reply(status: int, text: str, code: str, headers: dict[str, str] | None = None) -> None:
            await error_response(status, text, code=code, headers=headers)(scope, receive, send_with_id)

        if not self._authorized(scope):
            await reply(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await reply(413, f"request body of {length} bytes exceeds the limit of "
                        f"{self.max_body_bytes} bytes", "request_too_large")
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send_with_id)
        except Exception as exc:  # the last line of defence: log it, answer 500, keep serving
            too_large = isinstance(exc, BodyTooLarge) or isinstance(exc.__cause__, BodyTooLarge)
            if not too_large:
                log.exception("request %s failed", request_id)
            if started:
                return  # mid-response: nothing more can be said to the client
            if too_large:
                await reply(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                            "request_too_large")
            else:
                await reply(500, f"internal server error (request id {request_id})", "internal_error")

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or not str(scope.get("path", "")).startswith("/v1"):
            return True
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


def request_id_of(state: Any) -> str:
    """The x-request-id the middleware assigned to this request."""
    return str(getattr(state, "request_id", "") or uuid.uuid4().hex)
