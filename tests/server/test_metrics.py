"""/metrics (prometheus text format, counters that move) and aborting on client disconnect."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine


def scrape(live: Live) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = live.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_parse_and_move(fake: Live) -> None:
    before = scrape(fake)
    for name in ("vkrt_num_requests_running", "vkrt_num_requests_waiting", "vkrt_kv_cache_usage_ratio",
                 "vkrt_num_preemptions_total", "vkrt_step_dispatches", "vkrt_step_submits", "vkrt_step_drains",
                 "vkrt_prompt_tokens_total", "vkrt_generation_tokens_total",
                 "vkrt_time_to_first_token_seconds_count", "vkrt_inter_token_latency_seconds_count"):
        assert (name, ()) in before, name
    assert before[("vkrt_step_dispatches", ())] == 7
    assert before[("vkrt_requests_total", (("finish_reason", "length"),))] == 0
    fake.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    fake.client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 5, "stop": "c"})
    after = scrape(fake)
    assert after[("vkrt_requests_total", (("finish_reason", "length"),))] == 1
    assert after[("vkrt_requests_total", (("finish_reason", "stop"),))] == 1
    assert after[("vkrt_prompt_tokens_total", ())] == 5
    assert after[("vkrt_generation_tokens_total", ())] == 6
    assert after[("vkrt_time_to_first_token_seconds_count", ())] == 2
    assert after[("vkrt_inter_token_latency_seconds_count", ())] == 4
    fake.engine.num_preemptions = 3
    assert scrape(fake)[("vkrt_num_preemptions_total", ())] == 3


def test_metrics_can_be_disabled(serve_fake: Any) -> None:
    live = serve_fake(disable_metrics=True)
    assert live.client.get("/metrics").status_code == 404


def test_private_registry_per_app(serve_fake: Any) -> None:
    a, b = serve_fake(), serve_fake()
    a.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert scrape(a)[("vkrt_requests_total", (("finish_reason", "length"),))] == 1
    assert scrape(b)[("vkrt_requests_total", (("finish_reason", "length"),))] == 0


def _wait_for(condition: Any, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_stream_disconnect_aborts(serve_fake: Any) -> None:
    live = serve_fake(FakeEngine(step_delay=0.05))
    with live.client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "stream": True}) as r:
        lines = r.iter_lines()
        while '"content": "a"' not in next(lines):  # past the role chunk, into generation
            pass
        assert live.engine.active
    # Leaving the block closes the connection mid-stream.
    _wait_for(lambda: not live.engine.active and live.engine.aborted)
    metrics = scrape(live)
    assert metrics[("vkrt_requests_total", (("finish_reason", "abort"),))] == 1
    assert live.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_non_streaming_disconnect_aborts(serve_fake: Any) -> None:
    import httpx

    live = serve_fake(FakeEngine(step_delay=0.05))
    try:
        httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 40}, timeout=0.3)
    except httpx.ReadTimeout:
        pass
    _wait_for(lambda: not live.engine.active and live.engine.aborted)


def test_prefix_caching_and_state_slots_are_gauges() -> None:
    """A hybrid's server shows its state slots (in use = slots - free) and its prefix cache's state
    snapshots; without snapshot slots it says prefix caching is off."""
    from prometheus_client.parser import text_string_to_metric_families as parse

    from vkrt.engine.async_llm import EngineMetrics
    from vkrt.server.metrics import ServerMetrics

    def gauges(stats: EngineMetrics) -> dict[str, float]:
        text = ServerMetrics(lambda: stats, "m").render().decode()
        return {s.name: s.value for f in parse(text) for s in f.samples}

    hybrid = gauges(EngineMetrics(prefix_caching=True, num_state_slots=6, num_free_state_slots=4,
                                  num_state_snapshots=16, num_cached_state_snapshots=3))
    assert (hybrid["vkrt_prefix_caching_enabled"], hybrid["vkrt_num_state_slots"],
            hybrid["vkrt_num_free_state_slots"], hybrid["vkrt_num_state_snapshots"],
            hybrid["vkrt_num_cached_state_snapshots"]) == (1, 6, 4, 16, 3)
    no_snapshots = gauges(EngineMetrics(prefix_caching=False, num_state_slots=6, num_free_state_slots=6))
    assert (no_snapshots["vkrt_prefix_caching_enabled"], no_snapshots["vkrt_num_state_snapshots"]) == (0, 0)
    dense = gauges(EngineMetrics(prefix_caching=True))
    assert (dense["vkrt_prefix_caching_enabled"], dense["vkrt_num_state_slots"],
            dense["vkrt_num_state_snapshots"]) == (1, 0, 0)


def test_vllm_request_params_histograms(fake: Live) -> None:
    """vllm:request_params_n once per prompt, with its choices; vllm:request_params_max_tokens per
    request, what the context left where max_tokens was not given (the fake's context is 64)."""
    fake.client.post("/v1/completions", json={"prompt": ["hi", "yo"], "n": 3, "max_tokens": 2})
    fake.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 7})
    fake.client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": None})
    after = scrape(fake)
    label = (("model_name", "fake"),)
    assert after[("vllm:request_params_n_count", label)] == 4  # two prompts, then one, then one
    assert after[("vllm:request_params_n_sum", label)] == 3 + 3 + 1 + 1
    assert after[("vllm:request_params_n_bucket", (("le", "2.0"), *label))] == 2
    assert after[("vllm:request_params_n_bucket", (("le", "5.0"), *label))] == 4
    assert after[("vllm:request_params_max_tokens_count", label)] == 6 + 1 + 1
    assert after[("vllm:request_params_max_tokens_sum", label)] == 6 * 2 + 7 + 16  # completions default to 16
    fake.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    prompt = len(fake.engine.requests[-1][1])
    assert scrape(fake)[("vllm:request_params_max_tokens_sum", label)] == 6 * 2 + 7 + 16 + 64 - prompt


def test_iteration_tokens_histogram_counts_steps_by_tokens() -> None:
    """vllm:iteration_tokens_total under vLLM's buckets, from the engine's steps-by-tokens counts."""
    from vkrt.engine.async_llm import EngineMetrics
    from vkrt.engine.engine import STEP_TOKEN_BUCKETS
    from vkrt.server.metrics import ServerMetrics

    per_bucket = [3, 2] + [0] * (len(STEP_TOKEN_BUCKETS) - 2) + [1]  # 3 steps of 1 token, 2 of 2..8, 1 huge
    text = ServerMetrics(lambda: EngineMetrics(steps_by_tokens=tuple(per_bucket), step_tokens=20003),
                         "m").render().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:iteration_tokens_total"]
    assert family.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("vllm:iteration_tokens_total_bucket", "1.0")] == 3
    assert samples[("vllm:iteration_tokens_total_bucket", "8.0")] == 5
    assert samples[("vllm:iteration_tokens_total_bucket", "16384.0")] == 5
    assert samples[("vllm:iteration_tokens_total_bucket", "+Inf")] == 6
    assert samples[("vllm:iteration_tokens_total_count", None)] == 6
    assert samples[("vllm:iteration_tokens_total_sum", None)] == 20003
