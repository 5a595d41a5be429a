"""A request whose logits hold NaN or Inf ends with finish_reason "error" (plain and
streamed), the other requests are served, and /metrics counts it; the routes whose protocol
has no such finish_reason (Messages, Responses) answer 500 or an error event."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from tests.engine.engine_fakes import PoisonedLM, byte_tokenizer
from tests.server.conftest import Live
from tests.server.test_metrics import scrape
from vkrt.engine import AsyncLLM


@pytest.fixture
def poisoned(serve_fake: Callable[..., Live], request: pytest.FixtureRequest) -> Iterator[Live]:
    """A server over a model whose logits after the token `request.param` (default "!") are NaN."""
    poison = ord(getattr(request, "param", "!"))
    engine = AsyncLLM(model=PoisonedLM(poison), tokenizer=byte_tokenizer(), device="reference",
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


CHAT = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("poisoned", [":"], indirect=True)  # the chat template ends "assistant:"
def test_routes_without_an_error_finish_reason_answer_500(poisoned: Live) -> None:
    chat = poisoned.client.post("/v1/chat/completions", json=CHAT)
    assert chat.json()["choices"][0]["finish_reason"] == "error"
    for path, body in (("/v1/messages", CHAT), ("/v1/responses", {"model": "fake", "input": "hi"})):
        plain = poisoned.client.post(path, json=body)
        assert plain.status_code == 500 and "hold NaN or Inf" in plain.text, (path, plain.text)
        with poisoned.client.stream("POST", path, json={**body, "stream": True}) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and "hold NaN or Inf" in text, (path, text)
        assert "response.completed" not in text and "message_stop" not in text  # it did not end as a success
