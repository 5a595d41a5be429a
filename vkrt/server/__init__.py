"""OpenAI-compatible HTTP server over the engine (`vkrt serve`)."""

from __future__ import annotations

import logging
import socket
import sys

from vkrt.engine.async_llm import AsyncLLM
from vkrt.server.app import build_app
from vkrt.server.config import ServerConfig
from vkrt.server.http import uvicorn_config
from vkrt.server.webui import page_url

__all__ = ["ServerConfig", "build_app", "load_engine", "serve"]

log = logging.getLogger("vkrt.server")


def load_engine(config: ServerConfig) -> AsyncLLM:
    """Build the AsyncLLM `config` describes (the default model when none is named)."""
    return AsyncLLM(config.engine_config())  # an empty model means the default, pulled if needed


def serve(config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Listen on config.host:config.port (or on `sock`, already bound) at once and load the model
    in the background; returns when the server stops. Raises the error that stopped it if the model
    cannot be loaded or its device was lost (then the process exits non-zero, for a supervisor to
    restart)."""
    import uvicorn

    config.validate()
    failure: list[BaseException] = []

    def stop(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    app = build_app(None, config, loader=lambda: load_engine(config), on_fatal=stop)
    server = uvicorn.Server(uvicorn_config(app, config, host=config.host, port=config.port,
                                           log_level=config.uvicorn_log_level))
    log.info("serving %s on http://%s:%d", config.model_name(), config.host, config.port)
    if not config.disable_ui:
        print(f"vkrt: chat and status page at {page_url(config.host, config.port)}", file=sys.stderr, flush=True)
    server.run(sockets=[sock] if sock is not None else None)
    if failure:
        raise failure[0]
