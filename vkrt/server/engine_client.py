"""What the server needs from the engine: vkrt.engine.AsyncLLM, or a test double.

The server talks to the engine only through this Protocol, so a fake engine in tests and
the real AsyncLLM are interchangeable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from vkrt.engine.async_llm import EngineMetrics
from vkrt.engine.config import SamplingParams
from vkrt.engine.pooling import PoolingParams, PoolingResult
from vkrt.engine.request import RequestOutput
from vkrt.loader.config import ModelConfig
from vkrt.server.errors import APIError
from vkrt.tokenizer import Tokenizer


class EngineClient(Protocol):
    @property
    def is_ready(self) -> bool: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_config(self) -> ModelConfig: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 *, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Make (validate) the request now, raising RequestError for a bad one, and return its
        stream of delta updates (each holds only what its step added); iterating it starts the
        request, leaving the iteration early aborts it. CPU work (a grammar compiles here):
        call it off the event loop."""

    async def pool(self, prompt_token_ids: list[int], params: PoolingParams,
                   request_id: str | None = None) -> PoolingResult:
        """Run a pooling request (embeddings, scores) beside the generation requests; RequestError
        for a bad prompt."""

    def abort(self, request_id: str) -> None: ...

    def metrics(self) -> EngineMetrics: ...


def require_tokenizer(engine: EngineClient, param: str) -> Tokenizer:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send prompts as token ids", param=param,
                       code="no_tokenizer")
    return tokenizer
