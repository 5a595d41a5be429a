"""The device fails under a running server: a lost device ends every request with
finish_reason "error" (plain and streamed), turns /health and /ready 503 and stops `vkrt serve`
with the error (so the process exits non-zero); out of device memory ends only the step's
requests and the server goes on. Injected through a fake model that raises the backend's
typed error on its N-th forward (tests/engine/engine_fakes.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.engine.engine_fakes import FaultyLM, byte_tokenizer
from tests.server.test_errors import assert_error
from vkrt.engine import AsyncLLM
from vkrt.errors import DeviceLostError, OutOfDeviceMemory
from vkrt.server import ServerConfig, build_app, serve
from vkrt.server.background import BackgroundServer

LOST = DeviceLostError("vkWaitForFences returned VK_ERROR_DEVICE_LOST: the device stopped running work")
BODY = {"model": "fake", "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
WARM_UP_FORWARDS = 2  # the server's warm-up generates 2 tokens: one prefill and one decode step


def _engine(error: Exception, nth: int) -> AsyncLLM:
    return AsyncLLM(model=FaultyLM(error, nth=WARM_UP_FORWARDS + nth), tokenizer=byte_tokenizer(),
                    device="reference", max_model_len=128, kv_dtype="f32")


@pytest.fixture
def lost() -> Iterator[tuple[httpx.Client, list[BaseException]]]:
    """A server whose device is lost on the 3rd forward after its warm-up; on_fatal's calls."""
    engine = _engine(LOST, 3)
    fatal: list[BaseException] = []
    app = build_app(None, ServerConfig(served_model_name="fake"), loader=lambda: engine, on_fatal=fatal.append)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        deadline = time.monotonic() + 10
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the server never warmed up"
            time.sleep(0.02)
        yield client, fatal
    engine.shutdown()


def test_device_lost_ends_the_stream_and_turns_health_503(lost: tuple[httpx.Client, list[BaseException]]) -> None:
    client, fatal = lost
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert choices[-1]["finish_reason"] == "error" and len(choices) < 8, choices
    assert fatal == [LOST]  # `vkrt serve` stops on this and re-raises it
    for path in ("/health", "/ready"):
        assert assert_error(client.get(path), 503, says="VK_ERROR_DEVICE_LOST")["code"] == "device_lost"
    assert_error(client.post("/v1/completions", json=BODY), 503, says="the device failed")
    assert client.get("/live").status_code == 200  # the process still answers until it exits
    assert 'vkrt_requests_total{finish_reason="error"} 1.0' in client.get("/metrics").text


def test_out_of_memory_fails_the_request_and_the_server_goes_on() -> None:
    engine = _engine(OutOfDeviceMemory("vkQueueSubmit ran out of device memory (VkResult -2)"), 2)
    app = build_app(engine, ServerConfig(served_model_name="fake"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        failed = client.post("/v1/completions", json=BODY)
        assert failed.status_code == 200 and failed.json()["choices"][0]["finish_reason"] == "error"
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json=BODY)
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        assert "vkrt_out_of_memory_steps_total 1.0" in client.get("/metrics").text
    engine.shutdown()


def test_serve_stops_with_the_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(LOST, 1)
    monkeypatch.setattr("vkrt.server.load_engine", lambda config: engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raised: list[BaseException] = []

    def run() -> None:
        try:
            serve(ServerConfig(served_model_name="fake", host="127.0.0.1", port=port, disable_ui=True,
                               uvicorn_log_level="warning"))
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.get("/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never warmed up"
            time.sleep(0.05)
        out = client.post("/v1/completions", json=BODY).json()
        assert out["choices"][0]["finish_reason"] == "error"
    thread.join(20)
    assert not thread.is_alive() and raised == [LOST]
    engine.shutdown()
