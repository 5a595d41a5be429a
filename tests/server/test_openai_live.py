"""The official openai client against a live server over the real SmolLM2.

The device is slow (llvmpipe or numpy), so generations are short and independent checks run
concurrently: a batched step costs about what a single sequence's step does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.live_model import MODEL_NAME, LiveModel, live_model

API_KEY = "test-key"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=256, max_num_seqs=16, api_key=API_KEY) as server:
        yield server


def _client_kwargs(live: LiveModel) -> dict[str, Any]:
    return {"base_url": live.base_url, "api_key": live.config.api_key or "unused", "max_retries": 0,
            "timeout": 600}


def async_client(live: LiveModel) -> openai.AsyncOpenAI:
    """Make one per asyncio.run: its connection pool belongs to the loop that first uses it."""
    return openai.AsyncOpenAI(**_client_kwargs(live))


def prompt_tokens(live: LiveModel, prompt: str) -> int:
    tokenizer = live.engine.tokenizer
    assert tokenizer is not None
    return len(tokenizer.encode(prompt))


def chat_prompt_tokens(live: LiveModel, messages: list[dict[str, Any]]) -> int:
    tokenizer = live.engine.tokenizer
    assert tokenizer is not None
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))


def test_openai_client_endpoints(live: LiveModel) -> None:
    """Completions and chat, streamed and not, stop, max_tokens, logprobs, seeds: one batch."""
    assert [m.id for m in openai.OpenAI(**_client_kwargs(live)).models.list().data] == [MODEL_NAME]
    client = async_client(live)

    async def stream_completion(**kwargs: Any) -> tuple[str, Any, Any]:
        text, finish, usage = "", None, None
        async for chunk in await client.completions.create(stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage

    async def stream_chat(**kwargs: Any) -> tuple[str, Any, Any]:
        text, finish, usage = "", None, None
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage

    async def run_all() -> list[Any]:
        greedy = {"model": MODEL_NAME, "temperature": 0}
        sampled = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
        return await asyncio.gather(
            client.completions.create(prompt=PROMPT, max_tokens=8, n=1, **greedy),
            stream_completion(prompt=PROMPT, max_tokens=8, stream_options={"include_usage": True}, **greedy),
            client.completions.create(prompt=PROMPT, max_tokens=8, stop=["."], **greedy),
            client.completions.create(prompt=PROMPT, max_tokens=4, logprobs=3, **greedy),
            client.chat.completions.create(messages=MESSAGES, max_tokens=8, **greedy),
            stream_chat(messages=MESSAGES, max_completion_tokens=8, stream_options={"include_usage": True},
                        **greedy),
            client.chat.completions.create(messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2,
                                           **greedy),
            client.completions.create(seed=11, **sampled),
            client.completions.create(seed=11, **sampled),
            client.completions.create(seed=12, **sampled),
        )

    (plain, streamed, stopped, with_logprobs, chat, chat_streamed, chat_logprobs,
     seed_a, seed_b, seed_c) = asyncio.run(run_all())

    n_prompt = prompt_tokens(live, PROMPT)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (n_prompt, 8)
    assert plain.choices[0].text.startswith(" Paris")
    text, finish, usage = streamed
    assert (text, finish) == (plain.choices[0].text, "length")
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n_prompt, 8, n_prompt + 8)

    assert stopped.choices[0].text == plain.choices[0].text.split(".")[0]
    assert stopped.choices[0].finish_reason == "stop"

    lp = with_logprobs.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == with_logprobs.choices[0].text == plain.choices[0].text[: len("".join(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) >= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the argmax
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset[0] == 0

    n_chat_prompt = chat_prompt_tokens(live, MESSAGES)
    assert chat.usage is not None and chat.usage.prompt_tokens == n_chat_prompt
    assert chat.choices[0].message.role == "assistant"
    text, finish, usage = chat_streamed
    assert text == chat.choices[0].message.content and finish == chat.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_chat_prompt, chat.usage.completion_tokens)
    content = chat_logprobs.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat_logprobs.choices[0].message.content
    assert chat.choices[0].message.content.startswith(chat_logprobs.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []).decode() == entry.token

    assert seed_a.choices[0].text == seed_b.choices[0].text
    assert seed_a.choices[0].text != seed_c.choices[0].text


def test_bad_input_then_serving_continues(live: LiveModel) -> None:
    """Each bad request gets its status and an OpenAI error body; the next good one succeeds."""
    client = openai.OpenAI(**_client_kwargs(live))
    base = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    cases: list[tuple[type[openai.APIStatusError], dict[str, Any], str | None]] = [
        (openai.NotFoundError, {**base, "model": "gpt-4o"}, "model"),
        (openai.BadRequestError, {**base, "max_tokens": 0}, "max_tokens"),
        (openai.BadRequestError, {**base, "prompt": "word " * 300}, "prompt"),
        (openai.BadRequestError, {**base, "logit_bias": {"49152": 10}}, "logit_bias"),
        (openai.BadRequestError, {**base, "extra_body": {"structured_outputs": {"regex": "("}}},
         "structured_outputs"),
    ]
    for error_class, kwargs, param in cases:
        with pytest.raises(error_class) as caught:
            client.completions.create(**kwargs)
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == param and body["message"], body
        assert client.completions.create(**base).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(**{**_client_kwargs(live), "api_key": "wrong"}).models.list()
    r = httpx.post(f"{live.base_url}/completions", content=b"{oops", headers={
        "Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert client.completions.create(**base).usage.completion_tokens == 2


def test_concurrent_greedy_equals_solo(live: LiveModel) -> None:
    """16 concurrent greedy requests of different lengths each equal the same request alone."""
    prompts = [" ".join(["one two three"] * (i + 1)) + f" and {i}" for i in range(16)]

    async def complete(client: openai.AsyncOpenAI, i: int) -> str:
        r = await client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=4 + i % 3,
                                            temperature=0)
        return r.choices[0].text

    async def concurrent() -> list[str]:
        client = async_client(live)
        return list(await asyncio.gather(*(complete(client, i) for i in range(len(prompts)))))

    async def solo() -> list[str]:
        client = async_client(live)
        return [await complete(client, i) for i in range(len(prompts))]

    together = asyncio.run(concurrent())
    alone = asyncio.run(solo())
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        assert a == b, f"prompt {i}: batched {a!r} != solo {b!r}"
    assert len(set(together)) > 1


def test_dropped_stream_frees_blocks(live: LiveModel) -> None:
    """A client that goes away mid-stream: its request is aborted and its blocks are freed."""
    initial_free = live.engine.metrics().num_free_kv_blocks
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=live.url, timeout=600, headers=headers) as http, http.stream(
            "POST", "/v1/completions",
            json={"model": MODEL_NAME, "prompt": PROMPT * 20, "max_tokens": 64, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        started = time.monotonic()
        next(lines), next(lines)
        step_seconds = (time.monotonic() - started) / 2  # one blank line, one more token
        assert live.engine.metrics().num_free_kv_blocks < initial_free
    dropped = time.monotonic()
    # The abort lands between engine steps: allow the step in flight to finish.
    deadline = dropped + 1.0 + step_seconds
    while live.engine.metrics().num_free_kv_blocks != initial_free:
        assert time.monotonic() < deadline, "blocks not freed after the client disconnected"
        time.sleep(0.02)
    assert live.engine.metrics().num_running == 0


def test_kv_pressure_preempts_and_completes(live: LiveModel, smollm2_path: Path) -> None:
    """A pool too small for the batch: preemption happens, results stay exact, blocks come back."""
    bytes_per_block = live.engine.engine.model.kv_bytes_per_block(16, live.engine.config.kv_dtype)
    tokenizer = live.engine.tokenizer
    assert tokenizer is not None
    # Each prompt fits one 16-token block and its 8 new tokens cross into a second, so ten
    # requests admitted into a 10-block pool must preempt each other to finish.
    prompts = [f"Here is a list of {i + 2} fruits, one per line, starting with" for i in range(10)]
    assert all(8 < len(tokenizer.encode(p)) <= 16 < len(tokenizer.encode(p)) + 8 for p in prompts)
    with live_model(smollm2_path, max_model_len=128, max_num_seqs=16,
                    kv_cache_memory=10 * bytes_per_block) as tight:
        initial_free = tight.engine.metrics().num_free_kv_blocks

        async def run(server: LiveModel) -> list[str]:
            client = async_client(server)
            outs = await asyncio.gather(*(client.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0) for p in prompts))
            return [o.choices[0].text for o in outs]

        squeezed = asyncio.run(run(tight))
        metrics = httpx.get(f"{tight.url}/metrics").text
        preemptions = [line for line in metrics.splitlines() if line.startswith("vkrt_num_preemptions_total ")]
        assert float(preemptions[0].split()[1]) > 0
        assert tight.engine.metrics().num_free_kv_blocks == initial_free
    roomy = asyncio.run(run(live))
    assert squeezed == roomy
