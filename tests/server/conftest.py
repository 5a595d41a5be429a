"""Live servers on 127.0.0.1 (a free port) for the server tests; each is stopped afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.server.fake_engine import FakeEngine
from vkrt.server import ServerConfig, build_app
from vkrt.server.background import BackgroundServer


@dataclass
class Live:
    url: str
    engine: Any
    client: httpx.Client


@pytest.fixture
def serve_fake() -> Iterator[Callable[..., Live]]:
    """serve_fake(engine=None, **ServerConfig fields) -> a running server over a FakeEngine."""
    started: list[tuple[BackgroundServer, httpx.Client]] = []

    def start(engine: FakeEngine | None = None, **config: Any) -> Live:
        engine = engine if engine is not None else FakeEngine()
        config.setdefault("served_model_name", "fake")
        server = BackgroundServer(build_app(engine, ServerConfig(**config))).start()
        client = httpx.Client(base_url=server.url, timeout=10.0)
        started.append((server, client))
        return Live(server.url, engine, client)

    yield start
    for server, client in started:
        client.close()
        server.stop()


@pytest.fixture
def fake(serve_fake: Callable[..., Live]) -> Live:
    return serve_fake()
