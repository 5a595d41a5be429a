"""Prometheus metrics of one app, in a private registry (two apps in a process never mix).

Per-request counters and latency histograms are observed by the server as it streams
(TTFT and inter-token latency as the client sees them, queueing included); engine state
(running/waiting, KV usage, preemptions, device counters) is read at scrape time from the
engine's metrics snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vkrt.engine.async_llm import EngineMetrics

FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)


# Device counters always exported, even before the first step; others appear once reported.
_STEP_COUNTERS = ("dispatches", "submits", "drains", "fence_waits")


class _EngineCollector(Collector):
    def __init__(self, read_stats: Callable[[], EngineMetrics | None]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats() or EngineMetrics()
        gauges = (
            ("vkrt_num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vkrt_num_requests_waiting", "Requests waiting for admission.", stats.num_waiting),
            ("vkrt_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", stats.kv_usage),
            ("vkrt_num_kv_blocks", "KV-cache blocks in the pool.", stats.num_kv_blocks),
            ("vkrt_num_free_kv_blocks", "KV-cache blocks free (cached prefixes included).",
             stats.num_free_kv_blocks),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("vkrt_num_preemptions", "Requests preempted (recomputed) so far.",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("vkrt_engine_steps", "Engine steps run.", value=stats.steps)
        for key in dict.fromkeys([*_STEP_COUNTERS, *stats.last_step_counters]):
            yield GaugeMetricFamily(f"vkrt_step_{key}", f"Device {key} of the last engine step.",
                                    value=stats.last_step_counters.get(key, 0))
        for key in dict.fromkeys([*_STEP_COUNTERS, *stats.counters]):
            yield CounterMetricFamily(f"vkrt_device_{key}", f"Device {key} over all engine steps.",
                                      value=stats.counters.get(key, 0))


class ServerMetrics:
    """The app's registry and the per-request instruments the routes update."""

    def __init__(self, read_stats: Callable[[], EngineMetrics | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("vkrt_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self.prompt_tokens = Counter("vkrt_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("vkrt_generation_tokens", "Generated tokens of finished requests.",
                                         registry=self.registry)
        self.ttft = Histogram("vkrt_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vkrt_inter_token_latency_seconds", "Time between consecutive output updates.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(read_stats))

    def record_finished(self, finish_reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
