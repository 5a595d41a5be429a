"""POST /v1/rerank (Jina's and Cohere's shape) and vLLM's /score and /v1/score, for scoring models
(vkrt/server/pooling.py says which those are); any other model answers 400."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from vkrt.server.errors import APIError
from vkrt.server.generation import ServerState
from vkrt.server.pooling import score_pairs
from vkrt.server.pooling_protocol import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from vkrt.server.responses import check_model


def add_rerank_routes(app: FastAPI, state: ServerState, responses: dict[int | str, dict[str, Any]]) -> None:
    """Register /v1/rerank (also /rerank and /v2/rerank, as vLLM: Cohere's v2 client calls the
    latter), /score and /v1/score on `app` (called once by build_app)."""

    @app.post("/v1/rerank", response_model=RerankResponse, responses=responses)
    @app.post("/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    async def rerank(body: RerankRequest) -> JSONResponse:
        return JSONResponse(await create_rerank(state, body))

    for path in ("/score", "/v1/score"):
        @app.post(path, response_model=ScoreResponse, responses=responses)
        async def score(body: ScoreRequest) -> JSONResponse:
            return JSONResponse(await create_score(state, body))


async def create_rerank(state: ServerState, body: RerankRequest) -> dict[str, Any]:
    check_model(state, body.model)
    if not body.documents:
        raise APIError(400, "documents is empty; send at least one", param="documents", code="invalid_value")
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be >= 1, got {body.top_n}", param="top_n", code="invalid_value")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = await score_pairs(state, [(body.query, text) for text in texts], "documents")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                             if body.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "usage": {"total_tokens": tokens},
            "results": results}


async def create_score(state: ServerState, body: ScoreRequest) -> dict[str, Any]:
    check_model(state, body.model)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not firsts or not seconds:
        raise APIError(400, "text_1 and text_2 need at least one text each", param="text_1", code="invalid_value")
    if len(firsts) == 1:  # one text against each of the others
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(400, f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many "
                       "as text_2", param="text_2", code="invalid_value")
    scores, tokens = await score_pairs(state, list(zip(firsts, seconds, strict=True)), "text_2")
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
