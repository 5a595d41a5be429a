"""Probes and router gauges: /live (the process answers), /health (loaded), /ready (loaded and
warmed up), all without the API key; vLLM's cache_config_info gauge."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from tests.server.test_errors import assert_error
from vkrt.engine.async_llm import AsyncLLM, EngineMetrics
from vkrt.server import ServerConfig, build_app, load_engine
from vkrt.server.background import BackgroundServer


def _wait_for_status(client: httpx.Client, path: str, status: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get(path).status_code != status:
        assert time.monotonic() < deadline, f"{path} never answered {status}"
        time.sleep(0.02)


def test_ready_waits_for_the_warm_up_and_probes_need_no_key() -> None:
    gate = threading.Event()
    engine = FakeEngine(step_delay=0.4)  # the warm-up's 2 tokens take ~0.8 s

    def loader() -> FakeEngine:
        gate.wait(10)
        return engine

    app = build_app(None, ServerConfig(served_model_name="fake", api_key="sekrit"), loader=loader)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url) as client:
        assert client.get("/live").status_code == 200
        assert_error(client.get("/health"), 503, says="loading")
        assert_error(client.get("/ready"), 503, says="loading")
        gate.set()
        _wait_for_status(client, "/health", 200)
        assert_error(client.get("/ready"), 503, says="warming up")  # loaded, the warm-up still running
        _wait_for_status(client, "/ready", 200)
        assert client.get("/ready").content == b""
        assert client.get("/live").status_code == 200
        assert client.get("/v1/models").status_code == 401  # the key still guards everything else
    (warm_up,) = engine.requests
    assert warm_up[1] == [0] and warm_up[2].max_tokens == 2 and warm_up[2].temperature == 0.0


def test_an_engine_given_to_the_app_is_ready(fake: Live) -> None:
    assert fake.client.get("/ready").status_code == 200
    assert fake.engine.requests == []  # no warm-up: whoever built the engine decided


class _LoadedEngine(FakeEngine):
    def metrics(self) -> EngineMetrics:
        stats = super().metrics()
        stats.block_size, stats.kv_cache_dtype, stats.prefix_caching = 16, "f16", True
        return stats


def test_cache_config_info_carries_the_kv_config(serve_fake) -> None:  # type: ignore[no-untyped-def]
    live = serve_fake(_LoadedEngine())
    families = {f.name: f for f in text_string_to_metric_families(live.client.get("/metrics").text)}
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1
    assert sample.labels == {"block_size": "16", "num_gpu_blocks": "8", "cache_dtype": "f16",
                             "enable_prefix_caching": "True"}
    gauges = {s.name: s.value for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                           "vllm:kv_cache_usage_perc") for s in families[name].samples}
    assert gauges == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                      "vllm:kv_cache_usage_perc": 0.0}


def test_vkrt_serve_warms_the_real_engine_before_ready() -> None:
    """The loader path `vkrt serve` takes, on the tiny Llama: /ready turns 200 only after the
    warm-up generation ran in the engine (its two tokens are in the engine's counters)."""
    config = ServerConfig(model=Path(__file__).parents[1] / "fixtures" / "tiny_llama", device="reference",
                          served_model_name="tiny", max_model_len=64, max_num_seqs=2)
    engines: list[AsyncLLM] = []

    def loader() -> AsyncLLM:
        engines.append(load_engine(config))
        return engines[0]

    try:
        with BackgroundServer(build_app(None, config, loader=loader)) as server, \
                httpx.Client(base_url=server.url) as client:
            _wait_for_status(client, "/ready", 200, timeout=120)
            stats = engines[0].metrics()
            assert stats.generation_tokens == 2 and stats.num_running == stats.num_waiting == 0
    finally:
        for engine in engines:
            engine.shutdown()
