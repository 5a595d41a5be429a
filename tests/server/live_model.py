"""The real SmolLM2 behind a live server on 127.0.0.1, for the openai-client tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkrt.backend import vulkan_unavailable_reason
from vkrt.engine import AsyncLLM
from vkrt.server import ServerConfig, build_app, load_engine
from vkrt.server.background import BackgroundServer

MODEL_NAME = "smollm2"


def test_device() -> str:
    """Vulkan when the machine has it (llvmpipe in CI), else the numpy reference."""
    return "vulkan" if vulkan_unavailable_reason() is None else "reference"


@dataclass
class LiveModel:
    url: str
    engine: AsyncLLM
    config: ServerConfig

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def async_client(self, timeout: float = 900) -> Any:
        """The official openai client on this server (no retries: a failure shows at once)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=timeout)


@contextmanager
def live_model(model: Path, **config: Any) -> Iterator[LiveModel]:
    server_config = ServerConfig(model=model, device=test_device(), served_model_name=MODEL_NAME, **config)
    engine = load_engine(server_config)
    try:
        with BackgroundServer(build_app(engine, server_config)) as server:
            yield LiveModel(server.url, engine, server_config)
    finally:
        engine.shutdown()
