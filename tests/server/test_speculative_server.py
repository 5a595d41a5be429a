"""`vkrt serve --speculative-config` over the real SmolLM2: vLLM's spec_decode counters move as
proposals are verified, a request's `"speculative": false` opts it out, and its text equals
the server's plain answer; with SmolLM2 as its own draft model too."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.live_model import MODEL_NAME, LiveModel, live_model
from vkrt.engine.speculative import SpeculativeConfig

CODE = ("Here is some Python code.\n\n```python\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
        "    return a - b\n```\n\nThe same code again:\n\n```python\n")
NAMES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    with live_model(smollm2_path, max_model_len=256, max_num_seqs=2, speculative_config=config) as server:
        yield server


def _counters(client: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    values = {}
    for family in families:
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode") and sample.name.endswith("_total"):
                key = sample.name.removesuffix("_total")
                if "position" in sample.labels:
                    key += f"[{sample.labels['position']}]"
                values[key] = sample.value
    return values


def test_spec_decode_metrics_move_and_opt_out(live: LiveModel) -> None:
    body = {"model": MODEL_NAME, "prompt": CODE, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=600) as client:
        start = _counters(client)
        assert {name: start[name] for name in NAMES} == dict.fromkeys(NAMES, 0.0)
        off = client.post("/v1/completions", json={**body, "speculative": False})
        assert off.status_code == 200, off.text
        assert _counters(client) == start  # opted out: nothing proposed
        on = client.post("/v1/completions", json=body)
        assert on.status_code == 200, on.text
        after = _counters(client)
    assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
    drafts, proposed, accepted = (after[name] for name in NAMES)
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    per_pos = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos[{i}]"] for i in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


@pytest.fixture(scope="module")
def live_draft(smollm2_path: Path) -> Iterator[LiveModel]:
    config = SpeculativeConfig.parse({"model": str(smollm2_path), "num_speculative_tokens": 3})
    with live_model(smollm2_path, max_model_len=256, max_num_seqs=2, speculative_config=config) as server:
        yield server


def test_a_draft_model_serves_the_same_text_in_one_batch_with_an_opted_out_request(live_draft: LiveModel) -> None:
    """SmolLM2 as its own draft: two concurrent requests, one opted out, answer as one alone does;
    every proposal is accepted (the draft is the target) and the counters say so."""
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=live_draft.url, timeout=600) as client:
        alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        start = _counters(client)

        def post(extra: dict) -> str:
            with httpx.Client(base_url=live_draft.url, timeout=600) as c:
                response = c.post("/v1/completions", json={**body, **extra})
                assert response.status_code == 200, response.text
                return str(response.json()["choices"][0]["text"])

        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(post, [{}, {"speculative": False}]))
        after = _counters(client)
    assert texts == [alone, alone]
    drafts, proposed, accepted = (after[name] - start[name] for name in NAMES)
    assert drafts > 0 and accepted == proposed > 0
