"""The serving engine: requests, continuous-batching scheduler, paged KV blocks, sampler,
output processing, and the LLM (offline) and AsyncLLM (server) facades."""

from __future__ import annotations

from vkrt.engine.async_llm import AsyncLLM, EngineMetrics
from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.engine.engine import EngineCore, IterationStats
from vkrt.engine.guided import GuidedDecoding
from vkrt.engine.llm import LLM
from vkrt.engine.request import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    TokenLogprobs,
)

__all__ = [
    "LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "EngineCore", "EngineMetrics", "GuidedDecoding",
    "IterationStats",
    "Logprob", "RequestMetrics", "RequestOutput", "RequestOutputKind", "RequestStatus", "SamplingParams", "TokenLogprobs",
]
