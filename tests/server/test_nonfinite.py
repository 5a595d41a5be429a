"""A request whose logits hold NaN or Inf ends with finish_reason "error" (plain and
streamed), the other requests are served, and /metrics counts it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from tests.engine.engine_fakes import PoisonedLM, byte_tokenizer
from tests.server.conftest import Live
from tests.server.test_metrics import scrape
from vkrt.engine import AsyncLLM


@pytest.fixture
def poisoned(serve_fake: Callable[..., Live]) -> Iterator[Live]:
    engine = AsyncLLM(model=PoisonedLM(ord("!")), tokenizer=byte_tokenizer(), device="reference",
                      max_model_len=128, kv_dtype="f32")
    try:
        yield serve_fake(engine=engine)
    finally:
        engine.shutdown()


def test_nonfinite_logits_finish_with_error(poisoned: Live) -> None:
    body = {"model": "fake", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    bad = poisoned.client.post("/v1/completions", json={**body, "prompt": "hi!"})
    assert bad.status_code == 200 and bad.json()["choices"][0]["finish_reason"] == "error"
    good = poisoned.client.post("/v1/completions", json={**body, "prompt": "hello"})
    assert good.json()["choices"][0]["finish_reason"] == "length"
    with poisoned.client.stream("POST", "/v1/completions", json={**body, "prompt": "hi!", "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "error"
    metrics = scrape(poisoned)
    assert metrics[("vkrt_nonfinite_logits_total", ())] == 2
    assert metrics[("vkrt_requests_total", (("finish_reason", "error"),))] == 2
