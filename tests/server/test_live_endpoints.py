"""The real SmolLM2 behind a live server: the endpoints and fields the openai client tests
do not reach. Expected values come from the transformers golden (tests/fixtures/
smollm2_golden.json: token ids, rendered chats, greedy text) or from another endpoint's
independent path (the sampler's logprobs vs a prefill's prompt_logprobs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import FIXTURES
from tests.server.live_model import MODEL_NAME, LiveModel, live_model

GOLDEN = json.loads((FIXTURES / "smollm2_golden.json").read_text())
FRANCE = GOLDEN["text_prompts"][0]  # "The capital of France is" -> " Paris.\n\nThe answer is: ..."


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=256, max_num_seqs=8) as server:
        yield server


def post(live: LiveModel, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{live.url}{path}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def stream(live: LiveModel, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{live.url}{path}", json={**body, "stream": True}, timeout=600) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_health(live: LiveModel) -> None:
    assert httpx.get(f"{live.url}/health", timeout=60).status_code == 200


def test_tokenize_every_golden_case(live: LiveModel) -> None:
    for case in GOLDEN["text_prompts"]:
        got = post(live, "/tokenize", {"prompt": case["prompt"]})
        assert got["tokens"] == case["prompt_ids"] and got["count"] == len(case["prompt_ids"]), case["prompt"]
        got = post(live, "/tokenize", {"prompt": case["prompt"], "add_special_tokens": False})
        assert got["tokens"] == case["prompt_ids_no_special"]
    for case in GOLDEN["chats"]:
        got = post(live, "/tokenize", {"messages": case["messages"], "add_generation_prompt": True})
        assert got["tokens"] == case["prompt_ids"]


def test_detokenize_round_trips_every_golden_prompt(live: LiveModel) -> None:
    """SmolLM2 adds no special tokens to a plain prompt, so its ids decode to the prompt."""
    for case in GOLDEN["text_prompts"]:
        assert case["prompt_ids"] == case["prompt_ids_no_special"]
        assert post(live, "/detokenize", {"tokens": case["prompt_ids"]})["prompt"] == case["prompt"]


def _stop_cases() -> list[tuple[str, str]]:
    """(stop string, text before it) from the golden's greedy text: one inside a token, one
    spanning tokens."""
    text = FRANCE["greedy_text"]
    return [(stop, text[: text.index(stop)]) for stop in (".", "\n\nThe")]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_stop_strings(live: LiveModel, streamed: bool) -> None:
    for stop, before in _stop_cases():
        body = {"model": MODEL_NAME, "prompt": FRANCE["prompt"], "max_tokens": 12, "temperature": 0,
                "stop": [stop]}
        if streamed:
            chunks = stream(live, "/v1/completions", body)
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            final = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
            assert len(final) == 1
            choice = final[0]
        else:
            choice = post(live, "/v1/completions", body)["choices"][0]
            text = choice["text"]
        assert text == before, f"stop {stop!r}"
        assert choice["finish_reason"] == "stop"
        if not streamed:  # stream chunks carry no stop_reason yet (vLLM's do)
            assert choice["stop_reason"] == stop


def test_continuous_usage_stats(live: LiveModel) -> None:
    body = {"model": MODEL_NAME, "prompt": FRANCE["prompt"], "max_tokens": 5, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream(live, "/v1/completions", body)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    assert all(u["prompt_tokens"] == len(FRANCE["prompt_ids"]) for u in usages)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 5


def test_prompt_logprobs_agree_with_the_sampler(live: LiveModel) -> None:
    """prompt_logprobs of (prompt + greedy token) at its last position equals, bit for bit,
    the logprob the sampler reported for that token (the same logits row from prefills of
    different lengths: batch invariance), and names every prompt token."""
    first = FRANCE["greedy_ids"][0]
    sampled = post(live, "/v1/completions", {"model": MODEL_NAME, "prompt": FRANCE["prompt_ids"], "max_tokens": 1,
                                             "temperature": 0, "logprobs": 1})["choices"][0]["logprobs"]
    ids = FRANCE["prompt_ids"] + [first]
    choice = post(live, "/v1/completions", {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                            "prompt_logprobs": 1})["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry, entry  # the prompt token itself is always listed
        assert all(v["logprob"] <= 0.0 for v in entry.values())
    got = entries[-1][str(first)]["logprob"]
    assert got == sampled["token_logprobs"][0]
    assert entries[-1][str(first)]["rank"] == 1  # the greedy token is the top one


def test_continue_final_message(live: LiveModel) -> None:
    """A partial assistant message is continued, not closed: the prompt is the golden's
    rendered chat plus the partial text, and the reply equals a completion of that text."""
    case = GOLDEN["chats"][0]
    partial = "The capital of France"
    messages = [*case["messages"], {"role": "assistant", "content": partial}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    want_text = case["rendered"] + partial
    assert post(live, "/tokenize", {"prompt": want_text, "add_special_tokens": False})["tokens"] == \
        post(live, "/tokenize", body)["tokens"]
    chat = post(live, "/v1/chat/completions", {"model": MODEL_NAME, **body, "max_tokens": 6, "temperature": 0})
    completion = post(live, "/v1/completions", {"model": MODEL_NAME, "prompt": want_text, "max_tokens": 6,
                                                "temperature": 0, "add_special_tokens": False})
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
