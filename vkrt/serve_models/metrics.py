"""GET /metrics of a multi-model server: every loaded model's metrics in one exposition, each sample
labelled with its `model_name` (vLLM's metrics carry it already), and the server's own counts of
loads and unloads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vkrt.serve_models.pool import ModelPool
from vkrt.serve_models.process import ModelProcess, ModelState

_METRICS_TIMEOUT_S = 5.0


async def merged_metrics(pool: ModelPool) -> bytes:
    loaded = [m for m in pool.models.values() if m.state == ModelState.LOADED]
    texts = await asyncio.gather(*(_scrape(pool.client, m) for m in loaded))
    families: dict[str, Metric] = {}
    for model, text in zip(loaded, texts, strict=True):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                        family.unit)
            merged.samples += [Sample(s.name, {"model_name": model.name, **s.labels}, s.value, s.timestamp,
                                      s.exemplar) for s in family.samples]
    for family in _own(pool):
        families[family.name] = family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


async def _scrape(client: httpx.AsyncClient, model: ModelProcess) -> str:
    """A model's exposition, or nothing if it does not answer (it may be stopping)."""
    with contextlib.suppress(httpx.HTTPError):
        answer = await client.get(f"{model.url}/metrics", timeout=_METRICS_TIMEOUT_S)
        if answer.status_code == 200:
            return answer.text
    return ""


def _own(pool: ModelPool) -> list[Metric]:
    loaded = Metric("vkrt_models_loaded", "Models loaded now (their processes running).", "gauge")
    loaded.add_sample("vkrt_models_loaded", {}, sum(m.state == ModelState.LOADED for m in pool.models.values()))
    loads = Metric("vkrt_model_loads", "Times each model was loaded.", "counter")
    unloads = Metric("vkrt_model_unloads", "Times each model was unloaded (to make room, or asked to).", "counter")
    failures = Metric("vkrt_model_load_failures", "Loads of each model that failed.", "counter")
    for name, model in pool.models.items():
        loads.add_sample("vkrt_model_loads_total", {"model_name": name}, model.loads)
        unloads.add_sample("vkrt_model_unloads_total", {"model_name": name}, pool.unloads[name])
        failures.add_sample("vkrt_model_load_failures_total", {"model_name": name}, pool.load_failures[name])
    return [loaded, loads, unloads, failures]


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families
