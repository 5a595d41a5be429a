"""The HTTP/1.1 layer under the app: uvicorn over h11, with the limits a public port needs.

uvicorn closes idle keep-alive connections but sets no deadline for a request head: a
client that opens a connection and sends nothing (or one byte a minute) holds it forever.
`_HeadDeadlineProtocol` closes a connection whose next request head has not arrived within
`timeout_read` seconds; the middleware bounds the body the same way. `limit_concurrency`
caps connections plus requests in progress: uvicorn answers 503 to a request over it, and
a connection over it gets the same 503 at once and is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from vkrt.server.config import ServerConfig

_OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"connection: close\r\ncontent-length: 27\r\n\r\nExceeded concurrency limit.")


class _HeadDeadlineProtocol(H11Protocol):
    head_timeout = 30.0  # set per server by `protocol_class`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            # Over the cap before a byte is read: uvicorn would only answer once a head arrives,
            # so a flood of silent connections would hold a descriptor each until the deadline.
            transport.write(_OVER_CAPACITY)
            transport.close()
            return
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def protocol_class(head_timeout: float) -> type[H11Protocol]:
    return type("VkrtH11Protocol", (_HeadDeadlineProtocol,), {"head_timeout": head_timeout})


def uvicorn_config(app: Any, config: ServerConfig, *, host: str, port: int, log_level: str,
                   graceful_shutdown_s: int = 5) -> uvicorn.Config:
    """uvicorn settings for `app` under `config`'s connection limits."""
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s,
        # The asyncio loop always: uvicorn would take uvloop and httptools where they are installed
        # (Ray Serve brings them), and the server's behaviour would depend on what else is installed.
        loop="asyncio", http=protocol_class(config.timeout_read), ws="none", lifespan="on",
        timeout_keep_alive=config.timeout_keep_alive,  # type: ignore[arg-type]  # any float: it goes to call_later
        limit_concurrency=config.limit_concurrency,
        h11_max_incomplete_event_size=config.max_header_bytes,
    )
