"""Run the server in a background thread of this process (tests and tools/bench_serving.py)."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from vkrt.errors import VkrtError
from vkrt.server.config import ServerConfig
from vkrt.server.http import uvicorn_config


class BackgroundServer:
    """uvicorn serving `app` on host:port (port 0: a free one) from a daemon thread.

    Use as a context manager; `url` is valid once entered. In-process, so a caller can
    inspect the engine while requests run.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 config: ServerConfig | None = None) -> None:
        # The app's own ServerConfig when it has one: its connection limits apply here too.
        config = config or getattr(getattr(app.state, "server", None), "config", None) or ServerConfig()
        self.server = uvicorn.Server(uvicorn_config(app, config, host=host, port=port, log_level=log_level,
                                                    graceful_shutdown_s=2))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="vkrt-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise VkrtError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        sockets = [sock for server in self.server.servers for sock in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
