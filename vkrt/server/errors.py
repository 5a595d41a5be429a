"""OpenAI-shaped error bodies and the exception handlers that produce them.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with the
HTTP status that fits; a handler never lets a traceback reach the client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vkrt.errors import RequestError

log = logging.getLogger("vkrt.server")

# The OpenAI error `type` for each status the server sends.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


# Request values quoted back in an error message are cut to this many characters.
MAX_SHOWN_CHARS = 64


class BodyTooLarge(Exception):
    """A request body (sent without content-length) grew past the limit while being read."""


class BodyReadTimeout(Exception):
    """The request body did not arrive within the read timeout."""


def cut(text: str) -> str:
    """`text` cut to MAX_SHOWN_CHARS for an error message (never echo a megabyte back)."""
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def shown(value: object) -> str:
    """`repr(value)`, cut like `cut`."""
    return cut(repr(value))


class APIError(Exception):
    """An error the server answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 details: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.details = details or {}

    @classmethod
    def from_request_error(cls, exc: RequestError) -> APIError:
        return cls(exc.status, str(exc), param=exc.param, code=exc.code or "invalid_value", details=exc.details)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               details: dict[str, int] | None = None) -> dict[str, Any]:
    """The OpenAI error object; `details` join it (llama-server's n_prompt_tokens and n_ctx)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code, **(details or {})}}


# Anthropic's error `type` for each status (the Messages routes answer in Anthropic's shape).
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error"}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def wants_anthropic_errors(path: str) -> bool:
    """Whether an error on `path` is answered in Anthropic's shape (the Messages routes only)."""
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, details: dict[str, int] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, details), status_code=status, headers=headers)


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


_READ_TIMEOUT = "the request body did not arrive within the read timeout (--timeout-read)"


def read_timeout_response(anthropic: bool = False) -> JSONResponse:
    """408, and the connection closed: the rest of the body may still be on its way."""
    if anthropic:
        return anthropic_error_response(408, _READ_TIMEOUT, {"Connection": "close"})
    return error_response(408, _READ_TIMEOUT, code="request_timeout", headers={"Connection": "close"})


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One readable line for the first pydantic error, the field it names, and a code."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json"
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = cut(".".join(loc)) or None
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "model_attributes_type":
        message = "request body must be a JSON object"
    return (f"{param}: {message}" if param else message), param, "invalid_value"


def _answer(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
            headers: dict[str, str] | None = None, details: dict[str, int] | None = None) -> JSONResponse:
    """The error in the shape the route's API speaks: Anthropic's on the Messages routes."""
    if wants_anthropic_errors(request.url.path):
        return anthropic_error_response(status, message, headers)
    return error_response(status, message, param, code, headers, details)


def install_error_handlers(app: FastAPI) -> None:
    """Map every error class the routes raise onto its status and an OpenAI (or Anthropic) body."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return _answer(request, exc.status, exc.message, exc.param, exc.code, details=exc.details)

    async def on_request_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestError)
        err = APIError.from_request_error(exc)
        return _answer(request, err.status, err.message, err.param, err.code, details=err.details)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        # Validation failures are 400 (as OpenAI and vLLM answer), never FastAPI's 422.
        assert isinstance(exc, RequestValidationError)
        message, param, code = validation_message(exc)
        return _answer(request, 400, message, param, code)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc.__cause__, BodyTooLarge):
            return _answer(request, 413, "request body exceeds the size limit", code="request_too_large")
        if isinstance(exc.__cause__, BodyReadTimeout):
            return read_timeout_response(wants_anthropic_errors(request.url.path))
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {shown(request.url.path)}"
        return _answer(request, exc.status_code, message, headers=getattr(exc, "headers", None))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
