"""Prometheus metrics of one app, in a private registry (two apps in a process never mix).

Per-request counters and latency histograms are observed by the server as it streams
(TTFT and inter-token latency as the client sees them, queueing included); engine state
(running/waiting, KV usage, preemptions, device counters) is read at scrape time from the
engine's metrics snapshot.

Every measurement vkrt shares with vLLM is also exported under vLLM's own name and type
(`vllm:...`, labelled `model_name`), so dashboards and tools written for vLLM read vkrt
unchanged; the `vkrt_` names stay for what vLLM does not measure (device counters). The
mapping is in docs/USAGE.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vkrt.engine.async_llm import EngineMetrics
from vkrt.engine.engine import STEP_TOKEN_BUCKETS
from vkrt.engine.request import RequestMetrics
from vkrt.engine.speculative import SpecStats

FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
# vLLM's buckets for request-level durations.
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for vllm:request_params_n


# Device counters always exported, even before the first step; others appear once reported.
_STEP_COUNTERS = ("dispatches", "submits", "drains", "fence_waits")


class _EngineCollector(Collector):
    def __init__(self, read_stats: Callable[[], EngineMetrics | None], model_name: str) -> None:
        self._read_stats = read_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats() or EngineMetrics()
        gauges = (
            ("vkrt_num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vkrt_num_requests_waiting", "Requests waiting for admission.", stats.num_waiting),
            ("vkrt_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", stats.kv_usage),
            ("vkrt_num_kv_blocks", "KV-cache blocks in the pool.", stats.num_kv_blocks),
            ("vkrt_num_free_kv_blocks", "KV-cache blocks free (cached prefixes included).",
             stats.num_free_kv_blocks),
            ("vkrt_prefix_caching_enabled", "1 when prompts can be served from the prefix cache; 0 when it is "
             "off (configured off, or a hybrid model given no memory for state snapshots).",
             int(stats.prefix_caching)),
            ("vkrt_num_state_slots", "Recurrent-state slots of a hybrid model (0: none).", stats.num_state_slots),
            ("vkrt_num_free_state_slots", "Recurrent-state slots free.", stats.num_free_state_slots),
            ("vkrt_num_state_snapshots", "Recurrent-state snapshot slots of a hybrid's prefix cache (0: none).",
             stats.num_state_snapshots),
            ("vkrt_num_cached_state_snapshots", "State snapshots holding the state after a cached prefix.",
             stats.num_cached_state_snapshots),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("vkrt_num_preemptions", "Requests preempted (recomputed) so far.",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("vkrt_engine_steps", "Engine steps run.", value=stats.steps)
        yield CounterMetricFamily("vkrt_nonfinite_logits", "Requests ended with finish_reason error because their "
                                  "logits held NaN or Inf.", value=stats.nonfinite_logits)
        yield CounterMetricFamily("vkrt_out_of_memory_steps", "Engine steps the device refused for lack of memory; "
                                  "their requests ended with finish_reason error.", value=stats.out_of_memory_steps)
        # Counted as each step generates them, so a rate moves while a long request streams
        # (vkrt_generation_tokens_total counts a request's tokens when it finishes).
        yield CounterMetricFamily("vkrt_engine_generation_tokens", "Tokens generated, counted at every engine step.",
                                  value=stats.generation_tokens)
        info = GaugeMetricFamily("vkrt_device_info", "The device the model runs on (1; the labels say which).",
                                 labels=["device", "backend"])
        if stats.backend:  # empty until the model has loaded
            info.add_metric([stats.device, stats.backend], 1)
        yield info
        yield GaugeMetricFamily("vkrt_device_memory_bytes", "The device's memory (its largest device-local heap; "
                                "0: the backend does not say).", value=stats.device_memory_bytes)
        yield GaugeMetricFamily("vkrt_device_memory_reserved_bytes", "Device memory vkrt has reserved: weights, "
                                "KV cache, recurrent state, scratch.", value=stats.device_memory_reserved_bytes)
        for key in dict.fromkeys([*_STEP_COUNTERS, *stats.last_step_counters]):
            yield GaugeMetricFamily(f"vkrt_step_{key}", f"Device {key} of the last engine step.",
                                    value=stats.last_step_counters.get(key, 0))
        for key in dict.fromkeys([*_STEP_COUNTERS, *stats.counters]):
            yield CounterMetricFamily(f"vkrt_device_{key}", f"Device {key} over all engine steps.",
                                      value=stats.counters.get(key, 0))
        yield from self._vllm(stats)

    def _vllm(self, stats: EngineMetrics) -> Iterator[Metric]:
        """The engine state under vLLM's names; prefix-cache counters count prompt tokens."""
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch.", labels=["model_name"]),
            GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for admission.", labels=["model_name"]),
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage (0..1).", labels=["model_name"]),
            CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                labels=["model_name"]),
            CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                labels=["model_name"]),
            CounterMetricFamily("vllm:num_preemptions", "Requests preempted so far.", labels=["model_name"]),
        ]
        values = (stats.num_running, stats.num_waiting, stats.kv_usage, stats.prefix_cache_queries,
                  stats.prefix_cache_hits, stats.num_preemptions)
        for family, value in zip(families, values, strict=True):
            family.add_metric([self._model_name], value)
            yield family
        # vLLM's info gauge of its cache config (value 1, the config in labels); routers read
        # block_size and num_gpu_blocks from it. Empty until the model has loaded.
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (1; the labels say it).",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"])
        if stats.block_size:
            info.add_metric([str(stats.block_size), str(stats.num_kv_blocks), stats.kv_cache_dtype,
                             str(stats.prefix_caching)], 1)
        yield info
        yield self._iteration_tokens(stats)
        if stats.spec is not None:  # only when the engine speculates (--speculative-config)
            yield from self._spec_decode(stats.spec)

    def _iteration_tokens(self, stats: EngineMetrics) -> HistogramMetricFamily:
        """vLLM's histogram of tokens per engine step (a histogram despite its _total name)."""
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens run per engine step.",
                                       labels=["model_name"])
        per_bucket = stats.steps_by_tokens or (0,) * (len(STEP_TOKEN_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(floatToGoString, STEP_TOKEN_BUCKETS), "+Inf"), per_bucket, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([self._model_name], buckets, sum_value=stats.step_tokens)
        return family

    def _spec_decode(self, spec: SpecStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters: a draft is one request's proposals in one step."""
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Proposals verified (one per request per verify step).",
                 spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted proposed tokens by their position in the proposal.",
                                      labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self._model_name, str(position)], value)
        yield per_pos


class ServerMetrics:
    """The app's registry and the per-request instruments the routes update."""

    def __init__(self, read_stats: Callable[[], EngineMetrics | None], model_name: str = "") -> None:
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
        self.registry.register(_EngineCollector(read_stats, model_name))
        self._vllm = _VllmRequestMetrics(self.registry, model_name)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self._vllm.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self._vllm.itl.observe(seconds)

    def record_finished(self, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                        arrival_time: float | None = None, stamps: RequestMetrics | None = None,
                        max_tokens: int | None = None) -> None:
        """Count a finished request; `arrival_time` (the server's) and the engine's `stamps`
        give its end-to-end, queue, prefill, decode and inference times; `max_tokens` is the
        most it could generate (its parameter, or what the context left)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self._vllm.record(finish_reason, prompt_tokens, generation_tokens, arrival_time, stamps)
        if max_tokens is not None:
            self._vllm.max_tokens.observe(max_tokens)

    def observe_choices(self, num_choices: int) -> None:
        """A prompt's choices (its n, or best_of candidates), once per prompt as it starts."""
        self._vllm.n.observe(num_choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmRequestMetrics:
    """Per-request instruments under vLLM's names (vllm/v1/metrics/loggers.py)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry)
            return metric.labels(model_name=model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name=model_name)

        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=registry)
        for reason in FINISH_REASONS:
            self.success.labels(model_name=model_name, finished_reason=reason)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output updates.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last output.", _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                _REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                   _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request.", _TOKEN_BUCKETS)
        self.n = histogram("vllm:request_params_n", "Choices asked for per prompt (n, or best_of).", _N_BUCKETS)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "max_tokens per request (what the context "
                                    "left, where it was not given).", _TOKEN_BUCKETS)

    def record(self, finish_reason: str, prompt_tokens: int, generation_tokens: int,
               arrival_time: float | None, stamps: RequestMetrics | None) -> None:
        self.success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if stamps is None:
            return
        end = stamps.last_token_time
        if arrival_time is not None and end is not None:
            self.e2e.observe(max(end - arrival_time, 0.0))
        scheduled, first = stamps.first_scheduled_time, stamps.first_token_time
        if scheduled is not None:
            self.queue.observe(max(scheduled - stamps.arrival_time, 0.0))
        if scheduled is not None and first is not None:
            self.prefill.observe(max(first - scheduled, 0.0))
        if first is not None and end is not None:
            self.decode.observe(max(end - first, 0.0))
        if scheduled is not None and end is not None:
            self.inference.observe(max(end - scheduled, 0.0))
