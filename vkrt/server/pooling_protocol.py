"""Bodies of the pooling routes: OpenAI's /v1/embeddings, the Jina / Cohere /v1/rerank and
vLLM's /score, requests (type-checked strictly, unknown fields ignored) and responses (for the
OpenAPI document)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from vkrt.server.protocol import _Body


class EmbeddingRequest(_Body):
    model: str | None = None
    # One text, texts, one prompt as token ids, or prompts as token ids.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # truncate (Matryoshka models only), then normalise
    user: str | None = None


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None  # None: every document
    return_documents: bool = True


class ScoreRequest(_Body):
    model: str | None = None
    # One text against each of the others, or pairs of two lists of one length.
    text_1: str | list[str]
    text_2: str | list[str]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class Score(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: EmbeddingUsage
