"""/metrics under vLLM's names and types, scraped from a live server over the real SmolLM2.

The real engine is needed: the request histograms come from its timestamps (scheduled, first
token, last token) and the prefix-cache counters from its block manager, which the fake
engine does not have.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.live_model import MODEL_NAME, LiveModel, live_model

# Over two KV blocks of 16 tokens, so the repeat hits the prefix cache.
PROMPT = ("Paris is the capital and largest city of France. It lies on the river Seine, in the north "
          "of the country, and has been a centre of finance, diplomacy, commerce and science for")

# vLLM's name (without a counter's _total) -> its Prometheus type.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=256, max_num_seqs=4) as server:
        yield server


def test_vllm_metric_names_and_types(live: LiveModel) -> None:
    with httpx.Client(base_url=live.url, timeout=600) as client:
        usages = []
        for _ in range(2):
            r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        text = client.get("/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in VLLM_METRICS if name in families} == VLLM_METRICS

    def value(name: str, suffix: str = "", **labels: str) -> float:
        wanted = {"model_name": MODEL_NAME, **labels}
        (sample,) = [s for s in families[name].samples if s.name == name + suffix and s.labels == wanted]
        return float(sample.value)

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert value("vllm:prompt_tokens", "_total") == prompt_tokens
    assert value("vllm:generation_tokens", "_total") == 6
    assert value("vllm:request_success", "_total", finished_reason="length") == 2
    assert value("vllm:prefix_cache_queries", "_total") == prompt_tokens
    assert value("vllm:prefix_cache_hits", "_total") == usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_prompt_tokens"):
        assert value(name, "_count") == 2, name
    assert value("vllm:inter_token_latency_seconds", "_count") == 4  # 2 gaps in each of 3 tokens
    assert value("vllm:request_generation_tokens", "_sum") == 6
    assert value("vllm:request_params_n", "_sum") == 2 and value("vllm:request_params_max_tokens", "_sum") == 6
    # A prefill and two decode steps each, and the warm-up's; the repeat's prefill runs only what
    # the prefix cache did not hold.
    totals = live.engine.engine.totals
    assert value("vllm:iteration_tokens_total", "_count") == totals.steps >= 6
    assert value("vllm:iteration_tokens_total", "_sum") == totals.step_tokens >= usages[0]["prompt_tokens"] + 4
    assert value("vllm:num_requests_running") == 0
    (info,) = families["vllm:cache_config_info"].samples
    blocks = live.engine.engine.block_manager
    assert info.value == 1 and info.labels == {"block_size": str(blocks.block_size),
                                               "num_gpu_blocks": str(blocks.num_blocks),
                                               "cache_dtype": "f16", "enable_prefix_caching": "True"}
