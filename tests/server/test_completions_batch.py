"""Several prompts, n choices, best_of, echo with logprobs and cached tokens on /v1/completions.

The real SmolLM2 behind a live server answers the official openai client; the checks run
concurrently because a batched step costs about what one sequence's step does. Streaming
framing (one index per choice) uses the fake engine: it is about the server, not the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from tests.server.live_model import MODEL_NAME, LiveModel, live_model

PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is", "One, two, three,"]
# Over two KV blocks of 16 tokens, so a repeat finds full blocks in the prefix cache.
LONG_PROMPT = ("Paris is the capital and largest city of France. It lies on the river Seine, in the north "
               "of the country, and has been a centre of finance, diplomacy, commerce and science for")
BLOCK_SIZE = 16  # EngineConfig's default, which live_model keeps


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=256, max_num_seqs=16) as server:
        yield server


def _client(live: LiveModel) -> openai.AsyncOpenAI:
    return live.async_client(timeout=600)


def test_prompts_n_best_of_and_echo(live: LiveModel) -> None:
    client = _client(live)

    async def complete(**kwargs: Any) -> Any:
        return await client.completions.create(model=MODEL_NAME, **kwargs)

    async def main() -> list[Any]:
        sampled = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 1.0}
        return await asyncio.gather(
            complete(**sampled, n=3, seed=7, logprobs=0),
            complete(**sampled, n=3, seed=7, logprobs=0),
            complete(**sampled, seed=8),  # choice 1 of seed 7: seed 7 + 1
            complete(**sampled, n=1, best_of=3, seed=7),
            complete(prompt=PROMPTS, max_tokens=3, temperature=0),
            *[complete(prompt=p, max_tokens=3, temperature=0) for p in PROMPTS],
            complete(prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=2),
            complete(prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2),
        )

    n3, n3_again, seed8, best, batch, *rest = asyncio.run(main())
    solos, echoed, plain = rest[:4], rest[4], rest[5]

    # n=3: three choices, indexed, reproducible with the seed; choice k samples with seed + k.
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert [c.text for c in n3.choices] == [c.text for c in n3_again.choices]
    assert n3.choices[1].text == seed8.choices[0].text
    assert n3.usage.prompt_tokens == seed8.usage.prompt_tokens  # the prompt counts once
    assert n3.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in n3.choices)

    # best_of=3 returns the seed-7 candidate with the highest cumulative logprob, without logprobs.
    best_text = max(n3.choices, key=lambda c: sum(c.logprobs.token_logprobs)).text
    assert [c.text for c in best.choices] == [best_text]
    assert best.choices[0].logprobs is None

    # Four prompts: four choices in prompt order, each what that prompt gives alone.
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [solo.choices[0].text for solo in solos]
    assert batch.usage.prompt_tokens == sum(solo.usage.prompt_tokens for solo in solos)

    # echo + logprobs, as vLLM sends it: the prompt's tokens first, the first one unscored.
    lp = echoed.choices[0].logprobs
    num_prompt, num_output = echoed.usage.prompt_tokens, echoed.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == num_prompt + num_output
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # 2 alternatives, plus the token
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False))
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text == "".join(lp.tokens)
    assert lp.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_repeated_prompt_reports_cached_tokens(live: LiveModel) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=600)
    first = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=1, temperature=0)
    num_prompt = again.usage.prompt_tokens
    assert num_prompt > 2 * BLOCK_SIZE
    # Full blocks before the last prompt token (which is always computed) come from the cache.
    assert again.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.choices[0].text == first.choices[0].text


def test_sibling_choices_share_the_prompt_blocks(live: LiveModel) -> None:
    prompt = LONG_PROMPT.replace("Paris", "Lyon").replace("capital", "third city")  # not cached yet
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=600)
    hits_before = live.engine.metrics().prefix_cache_hits
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, n=3, max_tokens=2, seed=1)
    hits = live.engine.metrics().prefix_cache_hits - hits_before
    num_prompt = response.usage.prompt_tokens
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # the first candidate computed it
    # Each of the two siblings finds every full block before its last prompt token cached.
    assert hits == 2 * ((num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE) > 0


def test_tokenize_token_strs_are_vocabulary_pieces(live: LiveModel) -> None:
    r = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True,
                                                 "add_special_tokens": False}, timeout=60)
    strs = r.json()["token_strs"]
    assert "".join(strs).replace("Ġ", " ") == PROMPTS[0]  # byte-level pieces, as vLLM returns them
    assert "Ġcapital" in strs


def _events(text: str) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_choices_carry_their_index(fake: Live) -> None:
    r = fake.client.post("/v1/completions", json={"prompt": ["hi", "yo"], "n": 2, "max_tokens": 3, "stream": True,
                                                  "echo": True, "stream_options": {"include_usage": True}})
    events = _events(r.text)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    # The fake engine writes a, b, c...; index = prompt * n + choice; each echoes its own prompt.
    assert texts == {0: "hiabc", 1: "hiabc", 2: "yoabc", 3: "yoabc"}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    seeds = [params.seed for _, _, params, _ in fake.engine.requests]
    assert seeds == [None] * 4  # unseeded: the engine draws each choice's seed


def test_choice_seeds_follow_the_request_seed(fake: Live) -> None:
    r = fake.client.post("/v1/completions", json={"prompt": [[104, 105], [121, 111]], "n": 2, "seed": 2**63 - 2,
                                                  "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    seeds = sorted(params.seed for _, _, params, _ in fake.engine.requests)
    assert seeds == sorted([2**63 - 2, 2**63 - 1, 0, 1])  # (seed + candidate) mod 2**63
    assert all(params.n == 1 for _, _, params, _ in fake.engine.requests)


def test_dropped_stream_aborts_every_choice(serve_fake: Any) -> None:
    live = serve_fake(FakeEngine(step_delay=0.05), max_num_seqs=4, max_waiting_requests=0)
    body = {"prompt": ["hi", "yo"], "n": 2, "max_tokens": 50, "stream": True}
    with live.client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    # Closed after the first chunk: all four engine requests end and their places come back.
    deadline = time.monotonic() + 10
    while live.engine.active or len(live.engine.requests) < 4:
        assert time.monotonic() < deadline, f"still running: {live.engine.active}"
        time.sleep(0.05)
    assert sorted(live.engine.aborted) == sorted(rid for rid, _, _, _ in live.engine.requests)
    ok = live.client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_failing_choice_fails_the_response(serve_fake: Any) -> None:
    engine = FakeEngine()
    engine.fail_with, engine.fail_after = RuntimeError("device lost"), 1
    live = serve_fake(engine)
    r = live.client.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert not engine.active
