"""POST /v1/embeddings (OpenAI's shape): texts or token ids in, pooled hidden states out.

Any served model embeds: pooling and normalisation follow its files (sentence-transformers'
modules, GGUF's pooling_type) or `--pooling`; a model that declares none, such as a plain
generative one, gets last-token pooling, L2-normalised. `dimensions` truncates (then
normalises) where the model is trained for it (Matryoshka: Qwen3-Embedding), else 400.
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from vkrt.engine.pooling import PoolingParams
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError
from vkrt.server.generation import ServerState
from vkrt.server.pooling import PoolingTask, embedding_vector, pool_all, pooling_task
from vkrt.server.pooling_protocol import EmbeddingRequest, EmbeddingResponse
from vkrt.server.prompts import check_prompt_chars
from vkrt.server.responses import check_model


def add_embedding_routes(app: FastAPI, state: ServerState, responses: dict[int | str, dict[str, Any]]) -> None:
    """Register POST /v1/embeddings on `app` (called once by build_app)."""

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=responses)
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        return JSONResponse(await create_embeddings(state, body))


def _prompts(engine: EngineClient, body: EmbeddingRequest, max_chars: int) -> list[list[int]]:
    """The inputs as token ids. CPU work: call it off the event loop."""
    value = body.input
    if isinstance(value, str):
        value = [value]
    if not value:
        raise APIError(400, "input is empty; send a string, a list of strings or token ids", param="input",
                       code="invalid_value")
    if all(isinstance(item, int) for item in value):
        return [[item for item in value if isinstance(item, int)]]
    if all(isinstance(item, list) for item in value):
        return [item for item in value if isinstance(item, list)]
    tokenizer = require_tokenizer(engine, "input")
    prompts = []
    for i, text in enumerate(value):
        assert isinstance(text, str)
        if not text:
            where = "input" if isinstance(body.input, str) else f"input[{i}]"
            raise APIError(400, f"{where} is an empty string; every input needs text", param="input",
                           code="invalid_value")
        check_prompt_chars(len(text), max_chars, "input")
        prompts.append(tokenizer.encode(text))
    return prompts


def _check_dimensions(task: PoolingTask, dimensions: int | None) -> None:
    if dimensions is None:
        return
    if not task.matryoshka:
        raise APIError(400, "this model does not support truncated embeddings (dimensions): it is not trained for "
                       "them (Matryoshka); leave dimensions out", param="dimensions", code="invalid_value")
    if not 1 <= dimensions <= task.hidden_size:
        raise APIError(400, f"dimensions must be in [1, {task.hidden_size}], got {dimensions}", param="dimensions",
                       code="invalid_value")


async def create_embeddings(state: ServerState, body: EmbeddingRequest) -> dict[str, Any]:
    check_model(state, body.model)
    engine = state.require_engine()
    task = pooling_task(state, engine)
    _check_dimensions(task, body.dimensions)
    prompts = await state.run_cpu(_prompts, engine, body, state.config.max_prompt_chars)
    results = await pool_all(state, engine, prompts, PoolingParams(task.method), "input")
    data = []
    for index, result in enumerate(results):
        vector = embedding_vector(task, result, body.dimensions)
        embedding: list[float] | str = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                                        if body.encoding_format == "base64" else vector.tolist())
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(len(p) for p in prompts)
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
