"""/v1/embeddings with the openai SDK, /v1/rerank and /score with httpx, on live servers over the tiny
Qwen3-Embedding-shaped and Qwen3ForSequenceClassification fixtures (goldens by transformers)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.server import live_model
from vkrt.server import ServerConfig, build_app, load_engine
from vkrt.server.background import BackgroundServer

openai = pytest.importorskip("openai", reason="the openai SDK is a dev extra (pip install -e .[dev])")

FIXTURES = Path(__file__).parents[1] / "fixtures"
EMBED = FIXTURES / "tiny_qwen3_embed"
SEQCLS = FIXTURES / "tiny_qwen3_seqcls"
GOLDEN = json.loads((EMBED / "pooling_golden.json").read_text())
SEQCLS_GOLDEN = json.loads((SEQCLS / "pooling_golden.json").read_text())
TEXTS = [e["text"] for e in GOLDEN["embeddings"]]
TOL = 1e-4  # f32 KV cache: transformers' f32 forward to ~1e-6


@contextmanager
def serve(model: Path, **config: Any) -> Iterator[str]:
    server_config = ServerConfig(model=model, device=live_model.test_device(), served_model_name="tiny", max_model_len=128,
                                 kv_dtype="f32", **config)
    engine = load_engine(server_config)
    try:
        with BackgroundServer(build_app(engine, server_config)) as server:
            yield server.url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def embed_url() -> Iterator[str]:
    with serve(EMBED, reranker="yes-no") as url:
        yield url


@pytest.fixture(scope="module")
def seqcls_url() -> Iterator[str]:
    with serve(SEQCLS) as url:
        yield url


def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def normalised(values: list[float]) -> np.ndarray:
    v = np.asarray(values, np.float64)
    return v / np.linalg.norm(v)


def test_openai_sdk_embeddings_equal_transformers(embed_url: str) -> None:
    reply = client(embed_url).embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    for data, golden in zip(reply.data, GOLDEN["embeddings"], strict=True):
        np.testing.assert_allclose(data.embedding, normalised(golden["last"]), atol=TOL)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(e["ids"]) for e in GOLDEN["embeddings"])


def test_float_format_token_ids_and_dimensions(embed_url: str) -> None:
    golden = GOLDEN["embeddings"][2]
    sdk = client(embed_url)
    for value in (golden["ids"], [golden["ids"]], golden["text"]):
        reply = sdk.embeddings.create(model="tiny", input=value, encoding_format="float")
        np.testing.assert_allclose(reply.data[0].embedding, normalised(golden["last"]), atol=TOL)
    short = sdk.embeddings.create(model="tiny", input=golden["text"], dimensions=8).data[0].embedding
    assert len(short) == 8  # truncated, then normalised (Matryoshka)
    np.testing.assert_allclose(short, normalised(golden["last"][:8]), atol=TOL)


def test_pooling_flag_overrides_the_model() -> None:
    with serve(EMBED, pooling="mean") as url:
        reply = client(url).embeddings.create(model="tiny", input=TEXTS[:2])
    for data, golden in zip(reply.data, GOLDEN["embeddings"][:2], strict=True):
        np.testing.assert_allclose(data.embedding, normalised(golden["mean"]), atol=TOL)


def test_embedding_errors_are_clear_400s(embed_url: str) -> None:
    cases = [({"input": ""}, "empty string"), ({"input": []}, "input is empty"), ({"input": [[]]}, "is empty"),
             ({"input": [list(range(129))]}, "maximum context length"), ({"input": [[5, 999]]}, "outside the vocabulary"),
             ({"input": "x", "dimensions": 33}, r"dimensions must be in \[1, 32\]"),
             ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": 5}, "input")]
    for body, message in cases:
        reply = httpx.post(f"{embed_url}/v1/embeddings", json=body, timeout=60)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and re.search(message, error["message"]), error
    with pytest.raises(openai.BadRequestError, match="dimensions"):  # this model is not Matryoshka
        with serve(SEQCLS) as url:
            client(url).embeddings.create(model="tiny", input="x", dimensions=4)


def test_yes_no_reranker_scores_equal_transformers(embed_url: str) -> None:
    rerank = GOLDEN["rerank"]
    expected = rerank["yes_no_scores"]
    reply = httpx.post(f"{embed_url}/v1/rerank", json={"query": rerank["query"], "documents": rerank["documents"],
                                                       "top_n": 2}, timeout=60).json()
    order = sorted(range(len(expected)), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in reply["results"]] == order
    for result in reply["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=TOL)
        assert result["document"] == {"text": rerank["documents"][result["index"]]}
    assert reply["usage"]["total_tokens"] > 0
    for alias in ("/rerank", "/v2/rerank"):  # vLLM's other paths (Cohere's v2 client calls the latter)
        again = httpx.post(f"{embed_url}{alias}", json={"query": rerank["query"], "documents": rerank["documents"],
                                                        "top_n": 2}, timeout=60).json()
        assert again["results"] == reply["results"]
    scored = httpx.post(f"{embed_url}/score", json={"text_1": rerank["query"], "text_2": rerank["documents"]},
                        timeout=60).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=TOL)


def test_a_qwen3_reranker_by_name_needs_no_flag(tmp_path: Path) -> None:
    model = shutil.copytree(EMBED, tmp_path / "Qwen3-Reranker-tiny")
    rerank = GOLDEN["rerank"]
    with serve(model) as url:
        reply = httpx.post(f"{url}/score", json={"text_1": rerank["query"], "text_2": rerank["documents"]}, timeout=60)
    assert [d["score"] for d in reply.json()["data"]] == pytest.approx(rerank["yes_no_scores"], abs=TOL)


def test_classifier_scores_equal_transformers(seqcls_url: str) -> None:
    query, documents, expected = SEQCLS_GOLDEN["query"], SEQCLS_GOLDEN["documents"], SEQCLS_GOLDEN["scores"]
    reply = httpx.post(f"{seqcls_url}/v1/score", json={"text_1": [query] * 3, "text_2": documents}, timeout=60).json()
    assert [d["score"] for d in reply["data"]] == pytest.approx(expected, abs=TOL)
    reranked = httpx.post(f"{seqcls_url}/v1/rerank", json={"query": query, "documents": [{"text": d} for d in documents],
                                                           "return_documents": False}, timeout=60).json()
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx(sorted(expected, reverse=True), abs=TOL)
    assert all("document" not in r for r in reranked["results"])
    completion = httpx.post(f"{seqcls_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
    assert completion.status_code == 400 and "sequence classifier" in completion.json()["error"]["message"]


def test_a_model_that_cannot_score_answers_400_and_still_embeds() -> None:
    with serve(EMBED) as url:  # no --reranker: a causal LM with embeddings only
        for path, body in (("/v1/rerank", {"query": "q", "documents": ["d"]}), ("/score", {"text_1": "a", "text_2": "b"})):
            reply = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_not_supported", reply.text
        assert len(client(url).embeddings.create(model="tiny", input="a cat").data[0].embedding) == 32


def test_score_and_rerank_shape_errors(embed_url: str) -> None:
    cases = [("/v1/rerank", {"query": "q", "documents": []}, "documents is empty"),
             ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
             ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "as many"),
             ("/score", {"text_1": [], "text_2": "c"}, "at least one"),
             ("/v1/rerank", {"query": "q", "documents": ["d"], "model": "other"}, "does not exist")]
    for path, body, message in cases:
        reply = httpx.post(f"{embed_url}{path}", json=body, timeout=60)
        assert reply.status_code in (400, 404) and message in reply.json()["error"]["message"], (body, reply.text)


def test_embeddings_run_beside_a_generation(embed_url: str) -> None:
    async def both() -> tuple[Any, Any]:
        sdk = openai.AsyncOpenAI(base_url=f"{embed_url}/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(sdk.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=8),
                                    sdk.embeddings.create(model="tiny", input=TEXTS))

    completion, embeddings = asyncio.run(both())
    assert completion.usage.completion_tokens == 8 or completion.choices[0].finish_reason == "stop"
    np.testing.assert_allclose(embeddings.data[3].embedding, normalised(GOLDEN["embeddings"][3]["last"]), atol=TOL)


def test_routes_in_the_openapi_document_and_on_the_fake_engine(fake: Any) -> None:
    paths = fake.client.get("/openapi.json").json()["paths"]
    for path, schema in (("/v1/embeddings", "EmbeddingResponse"), ("/v1/rerank", "RerankResponse"),
                         ("/score", "ScoreResponse"), ("/v1/score", "ScoreResponse")):
        responses = paths[path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{schema}")
        assert {"400", "401", "404", "413", "429", "500", "503"} <= set(responses)
    reply = fake.client.post("/v1/embeddings", json={"input": ["ab", "ba"]}).json()  # the fuzzing lanes' engine
    assert reply["data"][0]["embedding"] == reply["data"][1]["embedding"] and reply["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(("labels", "expected"), [(("yes", "no"), ("yes-no", (0, 1))), (("no", "yes"), ("yes-no", (1, 0))),
                                                  (("a", "b"), ("classifier", None))])
def test_a_two_label_head_labelled_yes_no_scores_as_the_reranker(labels: tuple[str, str], expected: Any) -> None:
    """A GGUF of pooling type rank (llama.cpp's Qwen3-Reranker): its head holds the yes and no rows."""
    from dataclasses import replace

    from tests.server.fake_engine import FakeEngine
    from vkrt.server.generation import ServerState
    from vkrt.server.pooling import pooling_task

    class RankEngine(FakeEngine):
        @property
        def model_config(self) -> Any:
            return replace(super().model_config, num_labels=2, classifier_labels=labels)

    task = pooling_task(ServerState(ServerConfig(), RankEngine()), RankEngine())
    assert (task.scorer, task.yes_no_labels) == expected


def test_vkrt_serve_warms_a_classifier_with_a_pooling_request() -> None:
    """A classifier does not generate, so `vkrt serve`'s warm-up is one pooling request: /ready turns 200."""
    config = ServerConfig(model=SEQCLS, device="reference", served_model_name="tiny", max_model_len=64)
    engines: list[Any] = []

    def loader() -> Any:
        engines.append(load_engine(config))
        return engines[0]

    try:
        with BackgroundServer(build_app(None, config, loader=loader)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            deadline = time.monotonic() + 120
            while http.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, http.get("/ready").text
                time.sleep(0.05)
            assert engines[0].metrics().prompt_tokens == 1  # the warm-up's one token, pooled
    finally:
        for engine in engines:
            engine.shutdown()
