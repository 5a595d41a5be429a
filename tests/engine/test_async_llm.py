"""AsyncLLM: concurrent streams, aborts from disconnecting consumers, errors, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from engine_fakes import FakeLM, byte_tokenizer

from vkrt.engine import LLM, AsyncLLM, IterationStats, RequestOutput, SamplingParams
from vkrt.errors import RequestError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine() -> Iterator[AsyncLLM]:
    llm = AsyncLLM(model=FakeLM(), tokenizer=byte_tokenizer(), max_model_len=128, block_size=4)
    yield llm
    llm.shutdown()


async def collect(llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str | None = None
                  ) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_concurrent_streams_equal_solo_runs(engine: AsyncLLM) -> None:
    texts = [f"prompt {i} " * (i + 1) for i in range(8)]

    async def main() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(collect(engine, t, GREEDY) for t in texts)))

    streams = asyncio.run(main())
    model = engine.engine.model
    assert isinstance(model, FakeLM)
    assert max(seqs for _, seqs in model.steps) > 1  # they really were batched
    solo = LLM(model=FakeLM(), tokenizer=byte_tokenizer(), max_model_len=128, block_size=4)
    for text, updates in zip(texts, streams, strict=True):
        assert updates[-1].finished and len(updates) == 10
        ids = [t for u in updates for t in u.token_ids]  # deltas: one new token each
        assert ids == model.reference_greedy(list(text.encode()), 10)
        assert "".join(u.text for u in updates) == solo.generate(text, GREEDY)[0].text


def test_leaving_a_stream_aborts_and_frees_blocks(engine: AsyncLLM) -> None:
    async def main() -> None:
        stream = engine.generate("a long one", SamplingParams(max_tokens=100, ignore_eos=True), "gone")
        received = 0
        async for out in stream:
            received += len(out.token_ids)
            if received == 3:
                break
        await stream.aclose()  # what a server does when the client disconnects

    asyncio.run(main())
    # A generous deadline: this catches blocks that are never freed, not a slow step (other
    # test processes share the cores).
    deadline = time.monotonic() + 10.0
    while engine.metrics().num_free_kv_blocks != engine.metrics().num_kv_blocks:
        assert time.monotonic() < deadline, "blocks still held ten seconds after the abort"
        time.sleep(0.01)
    metrics = engine.metrics()
    assert metrics.num_running == 0 and metrics.kv_usage == 0.0


def test_bad_request_raises_and_the_engine_keeps_serving(engine: AsyncLLM) -> None:
    async def main() -> list[RequestOutput]:
        with pytest.raises(RequestError) as info:
            await collect(engine, "x", SamplingParams(max_tokens=0))
        assert info.value.param == "max_tokens"
        with pytest.raises(RequestError, match="context length") as info:
            await collect(engine, "y" * 200, GREEDY)
        assert info.value.code == "context_length_exceeded"
        return await collect(engine, "still here", GREEDY)

    assert asyncio.run(main())[-1].finished


def test_a_bad_request_raises_from_generate_itself_before_any_stream(engine: AsyncLLM) -> None:
    """The server calls generate before it sends a response, so its errors must come from the
    call, not from the first iteration; and a stream never iterated queues nothing."""
    with pytest.raises(RequestError) as info:
        engine.generate("z" * 120, GREEDY)  # 120 + 10 > 128
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    unstarted = engine.generate("fine", GREEDY, "never-iterated")
    assert not engine.engine.has_unfinished() and engine.metrics().num_waiting == 0
    del unstarted
    assert asyncio.run(collect(engine, "fine", GREEDY, "never-iterated"))[-1].finished  # the id was never taken


def test_duplicate_request_id_is_rejected(engine: AsyncLLM) -> None:
    async def main() -> None:
        first = engine.generate("one", SamplingParams(max_tokens=50, ignore_eos=True), "same")
        await first.__anext__()
        with pytest.raises(RequestError) as info:
            await collect(engine, "two", GREEDY, "same")
        assert info.value.status == 409
        await first.aclose()

    asyncio.run(main())


def test_metrics_and_stats_listener(engine: AsyncLLM) -> None:
    seen: list[IterationStats] = []
    engine.add_stats_listener(seen.append)

    async def main() -> None:
        await asyncio.gather(collect(engine, "abc", GREEDY), collect(engine, "de", GREEDY))

    asyncio.run(main())
    metrics = engine.metrics()
    assert metrics.prompt_tokens == 5 and metrics.generation_tokens == 20
    assert metrics.num_running == metrics.num_waiting == 0 and metrics.steps == len(seen)
    assert sum(len(s.ttfts) for s in seen) == 2 and sum(len(s.inter_token_latencies) for s in seen) == 18
    assert sum(len(s.finished) for s in seen) == 2
    assert {"dispatches", "submits", "drains"} <= set(metrics.counters)


def test_background_load_reports_readiness() -> None:
    llm = AsyncLLM(model=FakeLM(), tokenizer=byte_tokenizer(), max_model_len=64, load_in_background=True)
    try:
        assert llm.wait_ready(timeout=10) and llm.is_ready
        assert asyncio.run(collect(llm, "hi", GREEDY))[-1].finished
    finally:
        llm.shutdown()


def test_shutdown_lets_the_model_go_while_the_caller_keeps_the_engine() -> None:
    """A server's routes (and a web framework's caches of them) may outlive the server; the
    weights and KV cache must not, or every reload in one process leaks device memory."""
    import gc
    import weakref

    model = FakeLM()
    gone = weakref.ref(model)
    llm = AsyncLLM(model=model, tokenizer=byte_tokenizer(), max_model_len=64)
    del model
    assert asyncio.run(collect(llm, "hi", GREEDY))[-1].finished
    llm.shutdown()
    gc.collect()
    assert gone() is None
    with pytest.raises(Exception, match="shut down"):
        llm.engine  # noqa: B018


def test_metrics_name_the_device_and_count_tokens_per_step(engine: AsyncLLM) -> None:
    """What /metrics' vkrt_device_* and vkrt_engine_generation_tokens_total read: the model's
    backend, known from the load on, and the tokens of unfinished requests too."""
    backend = engine.engine.model.backend
    before = engine.metrics()
    assert before.backend == backend.name and before.device and before.generation_tokens == 0

    async def main() -> None:
        stream = engine.generate("abc", SamplingParams(max_tokens=50, ignore_eos=True), "partial")
        received = 0
        async for out in stream:
            received += len(out.token_ids)
            if received == 4:
                assert engine.metrics().generation_tokens >= 4  # counted before the request ends
                break
        await stream.aclose()

    asyncio.run(main())
