"""Every bad request gets its documented status and an OpenAI error body; serving goes on."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from vkrt.server import ServerConfig, build_app
from vkrt.server.background import BackgroundServer

GOOD = {"model": "fake", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(r: httpx.Response, status: int, param: str | None = None, says: str = "") -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    # A context-length refusal also says the numbers, as llama-server's does.
    extra = {"n_prompt_tokens", "n_ctx"} if error.get("code") == "context_length_exceeded" else set()
    assert set(error) == {"message", "type", "param", "code"} | extra
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert error["param"] == param
    assert says.lower() in error["message"].lower()
    assert r.headers["x-request-id"]
    return error


def assert_still_serving(live: Live) -> None:
    r = live.client.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


BAD_REQUESTS = [
    # (route, body or raw bytes, status, param, message fragment)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "fake"}, 400, "prompt", "prompt"),
    ("/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens", ""),
    ("/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model", "does not exist"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 64}, 400, "prompt", "context length"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 60, "max_tokens": 10}, 400, "max_tokens", "context length"),
    ("/v1/completions", {**GOOD, "logit_bias": {"100000": 5}}, 400, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", {**GOOD, "logit_bias": {"abc": 5}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature", ""),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", ""),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", ">= 1"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n", ">= 1"),
    ("/v1/completions", {**GOOD, "prompt": ["a", [104]]}, 400, "prompt", "mixes lists of token ids"),
    ("/v1/completions", {**GOOD, "prompt": [104, "a", [105]]}, 400, "prompt", "mixes lists of token ids"),
    ("/v1/completions", {**GOOD, "prompt": [104, [105]]}, 400, "prompt", "mixes lists of token ids"),
    ("/v1/completions", {**GOOD, "prompt": ["a", ""]}, 400, "prompt.1", "empty"),
    ("/v1/completions", {**GOOD, "n": 2, "best_of": 1}, 400, "best_of", ">= n"),
    ("/v1/completions", {**GOOD, "best_of": 2, "stream": True}, 400, "best_of", "cannot stream"),
    ("/v1/completions", {**GOOD, "prompt": [1, 9999]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {**GOOD, "suffix": "x"}, 400, "suffix", "not supported"),
    ("/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs", ""),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {**GOOD, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs", "exactly one"),
    ("/v1/completions", {**GOOD, "json_schema": {}, "grammar": "root ::= \"a\""}, 400, "grammar",
     "only one output constraint"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format", "needs json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "unknown"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content", "only text"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools.0", "each tool must be"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/nothing-here", {}, 404, None, "no route"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "says"), BAD_REQUESTS,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_request(fake: Live, route: str, body: Any, status: int, param: str | None, says: str) -> None:
    if isinstance(body, bytes):
        r = fake.client.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = fake.client.post(route, json=body)
    assert_error(r, status, param, says)
    assert_still_serving(fake)


def test_wrong_method_is_405(fake: Live) -> None:
    assert_error(fake.client.get("/v1/completions"), 405)
    assert_still_serving(fake)


def test_api_key(serve_fake: Any) -> None:
    live = serve_fake(api_key="sekrit")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        error = assert_error(live.client.post("/v1/completions", json=GOOD, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
        assert_error(live.client.get("/v1/models", headers=headers), 401)
    ok = live.client.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    # Every route but the probes needs the key: tokenize, detokenize, metrics, the docs, unknown paths.
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                         ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no-such-route")):
        assert_error(live.client.request(method, path, json={"prompt": "hi", "tokens": [104]}), 401)
    auth = {"Authorization": "Bearer sekrit"}
    assert live.client.post("/tokenize", json={"prompt": "hi"}, headers=auth).json()["count"] == 2
    assert live.client.get("/metrics", headers=auth).status_code == 200
    for path in ("/health", "/version"):
        assert live.client.get(path).status_code == 200


def test_x_api_key_header(serve_fake: Any) -> None:
    live = serve_fake(api_key="sekrit")
    assert live.client.post("/v1/completions", json=GOOD, headers={"X-Api-Key": "sekrit"}).status_code == 200
    assert_error(live.client.post("/v1/completions", json=GOOD, headers={"X-Api-Key": "wrong"}), 401)


def test_cors_preflight_passes_auth(serve_fake: Any) -> None:
    live = serve_fake(api_key="sekrit", allowed_origins=("https://app.example",))
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = live.client.options("/v1/completions", headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    ok = live.client.post("/v1/completions", json=GOOD, headers={"Origin": "https://app.example",
                                                                 "Authorization": "Bearer sekrit"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    # The key is still needed for the request itself, and other origins get no CORS grant.
    assert_error(live.client.post("/v1/completions", json=GOOD, headers={"Origin": "https://app.example"}), 401)
    other = live.client.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_by_default(serve_fake: Any) -> None:
    live = serve_fake()
    r = live.client.post("/v1/completions", json=GOOD, headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_public_metrics_opens_only_metrics(serve_fake: Any) -> None:
    live = serve_fake(api_key="sekrit", public_metrics=True)
    assert live.client.get("/metrics").status_code == 200
    assert_error(live.client.post("/tokenize", json={"prompt": "hi"}), 401)


def test_oversized_body_is_413(serve_fake: Any) -> None:
    live = serve_fake(max_request_body_bytes=1000)
    assert_error(live.client.post("/v1/completions", json={**GOOD, "prompt": "x" * 2000}), 413)

    def chunked() -> Any:  # no content-length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    assert_error(live.client.post("/v1/completions", content=chunked()), 413)
    assert live.client.post("/v1/completions", json=GOOD).status_code == 200


def test_overload_is_429(serve_fake: Any) -> None:
    live = serve_fake(FakeEngine(step_delay=0.05), max_num_seqs=1, max_waiting_requests=0)
    with live.client.stream("POST", "/v1/completions", json={**GOOD, "max_tokens": 20, "stream": True}) as r:
        lines = r.iter_lines()  # keep it: a dropped iterator closes the connection
        next(lines)  # the first request is in flight
        error = assert_error(live.client.post("/v1/completions", json=GOOD), 429, says="overloaded")
        assert error["code"] == "server_overloaded"
        list(lines)
    assert live.client.post("/v1/completions", json=GOOD).status_code == 200


def test_engine_failure_is_500_without_traceback(serve_fake: Any) -> None:
    engine = FakeEngine()
    live = serve_fake(engine)
    engine.fail_with = RuntimeError("kaboom in the kernel")
    error = assert_error(live.client.post("/v1/completions", json=GOOD), 500)
    assert "kaboom" not in error["message"] and error["type"] == "server_error"
    # Mid-stream, the headers are gone already: an error event, then [DONE].
    engine.fail_after = 2
    r = live.client.post("/v1/completions", json={**GOOD, "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    assert '"error"' in r.text and r.text.endswith("data: [DONE]\n\n") and "kaboom" not in r.text
    engine.fail_with = None
    assert_still_serving(live)
    metrics = live.client.get("/metrics").text
    assert 'vkrt_requests_total{finish_reason="error"} 2.0' in metrics


def test_health_is_503_until_the_engine_loads() -> None:
    gate = threading.Event()
    engine = FakeEngine()

    def loader() -> FakeEngine:
        gate.wait(10)
        return engine

    app = build_app(None, ServerConfig(served_model_name="fake"), loader=loader)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url) as client:
        assert_error(client.get("/health"), 503, says="loading")
        assert_error(client.post("/v1/completions", json=GOOD), 503, says="loading")
        assert client.get("/metrics").status_code == 200
        gate.set()
        deadline = time.monotonic() + 5
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_load_failure_keeps_health_503() -> None:
    failures: list[BaseException] = []

    def loader() -> FakeEngine:
        raise RuntimeError("no such model file")

    app = build_app(None, ServerConfig(served_model_name="fake"), loader=loader, on_fatal=failures.append)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url) as client:
        deadline = time.monotonic() + 5
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert_error(client.get("/health"), 503, says="no such model file")
