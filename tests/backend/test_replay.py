"""Record once, replay: a recorded step re-run with new inputs equals running it eagerly."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.conftest import FIXTURES
from vkrt import ops
from vkrt.errors import VkrtError
from vkrt.loader import load_model
from vkrt.models import ForwardBatch, StepTensors, build_model


def _decode_batch(token: int, position: int, blocks: int) -> ForwardBatch:
    return ForwardBatch(np.array([token], np.int32), np.array([position], np.int32), np.zeros(1, np.int32),
                        np.array([position], np.int32), np.arange(blocks, dtype=np.int32)[None, :],
                        np.zeros(1, np.int32))


def _write(backend, step: StepTensors, batch: ForwardBatch) -> None:
    for name in ("token_ids", "positions", "seq_index", "slots", "block_tables", "logits_index"):
        backend.write(getattr(step, name), getattr(batch, name))


def test_replayed_decode_equals_eager_decode(vk) -> None:
    model = build_model(load_model(FIXTURES / "tiny_llama"), vk)
    prompt = [5, 9, 11, 200]
    prefill = ForwardBatch(np.array(prompt, np.int32), np.arange(4, dtype=np.int32), np.zeros(4, np.int32),
                           np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32)[None, :],
                           np.array([3], np.int32))
    runs = []
    for replay in (False, True):
        kv = model.allocate_kv_cache(4, 16)
        logits = model.forward(StepTensors.upload(vk, prefill), kv).numpy()
        tokens = [int(logits[0].argmax())]
        seen = []
        step = StepTensors.upload(vk, _decode_batch(tokens[0], 4, 4))
        if replay:
            with vk.capture() as graph:
                out = model.forward(step, kv)
            assert graph.dispatches > 0
        for i in range(8):
            batch = _decode_batch(tokens[-1], 4 + i, 4)
            before = vk.counters.snapshot()
            if replay:
                _write(vk, step, batch)
                graph.replay()
                logits = out.numpy()
                delta = vk.counters.since(before)
                assert (delta["submits"], delta["fence_waits"], delta["drains"]) == (1, 1, 0)
                assert delta["dispatches"] == graph.dispatches
            else:
                logits = model.forward(StepTensors.upload(vk, batch), kv).numpy()
            seen.append(logits)
            tokens.append(int(logits[0].argmax()))
        runs.append((tokens, seen))
    (eager_tokens, eager_logits), (replay_tokens, replay_logits) = runs
    assert replay_tokens == eager_tokens
    for a, b in zip(eager_logits, replay_logits, strict=True):
        assert np.array_equal(a, b)  # same kernels, same order: bit-identical


def test_capture_refuses_host_reads_and_fallbacks(vk_default) -> None:
    x = vk_default.upload(np.ones((2, 8), np.float32))
    with pytest.raises(VkrtError, match="recorded"):
        with vk_default.capture():
            ops.add(x, x).numpy()
    # After a failed capture the backend records and runs eagerly again.
    assert np.array_equal(ops.add(x, x).numpy(), np.full((2, 8), 2.0, np.float32))


def test_reference_backend_cannot_replay(ref) -> None:
    assert not ref.supports_replay
    with pytest.raises(NotImplementedError):
        ref.capture()


def _one_token_masks(rows: int, vocab: int, tokens: list[int]) -> np.ndarray:
    """u32 masks whose row r allows only tokens[r]."""
    masks = np.zeros((rows, -(-vocab // 32)), np.uint32)
    for r, token in enumerate(tokens):
        masks[r, token // 32] = np.uint32(1 << (token % 32))
    return masks


def test_late_input_is_written_after_the_submit_and_waited_for(vk_default, monkeypatch, rng) -> None:
    """The host writes a late input (token masks) after the recorded step is submitted; the
    sampling dispatch waits on the device for the host's event and reads what the host wrote.
    A device that ignored the wait would sample with the previous masks (or finish before the
    host's write); one that never saw the host set the event fails at the fence timeout."""
    from vkrt.backend.vulkan import batch as vkbatch

    monkeypatch.setattr(vkbatch, "FENCE_TIMEOUT_NS", 60_000_000_000)  # fail, not hang
    vk = vk_default
    rows, vocab = 3, 300
    logits = vk.upload(rng.standard_normal((rows, vocab)).astype(np.float32))
    params = vk.upload(np.tile(np.array([1.0, 1.0, 0.0, 1.0], np.float32), (rows, 1)), "f32")  # greedy
    uniforms = vk.upload(np.zeros(rows, np.float32), "f32")
    masks = vk.upload(_one_token_masks(rows, vocab, [0, 0, 0]), "u32", purpose="inputs")
    with vk.capture() as graph:
        graph.wait_for_host(masks)
        ids = ops.sample_top_k(ops.add(logits, logits), params, uniforms, masks)
    lib, device, fence = vk.vk.lib, vk.device, vk.batch.fence
    seen: list[tuple[int, int]] = []
    for tokens in ([7, 100, 299], [31, 32, 250], [5, 5, 5]):
        def write(tokens: list[int] = tokens) -> None:
            c = vk.counters
            seen.append((c.submits - c.fence_waits, lib.vkGetEventStatus(device, graph.recorded.gate[0])))
            time.sleep(0.2)  # an unblocked device would have finished this tiny step by now
            assert lib.vkGetFenceStatus(device, fence) == vk.vk.VK_NOT_READY
            vk.write(masks, _one_token_masks(rows, vocab, tokens))

        before = vk.counters.snapshot()
        graph.replay(during=write)
        delta = vk.counters.since(before)
        assert (delta["submits"], delta["fence_waits"], delta["drains"], delta["host_overlaps"]) == (1, 1, 0, 1)
        assert ids.numpy().tolist() == tokens
    assert seen == [(1, vk.vk.VK_EVENT_RESET)] * 3  # submitted, not waited for, event reset
    # Without host work the event stays set: the same graph replays without waiting.
    before = vk.counters.snapshot()
    graph.replay()
    assert ids.numpy().tolist() == [5, 5, 5]
    assert vk.counters.since(before)["host_overlaps"] == 0


def test_failed_host_work_still_releases_the_device(vk_default, monkeypatch) -> None:
    """An exception while the host computes a late input sets the event anyway: the step
    completes, the exception reaches the caller, and the graph replays normally afterwards.
    Writing anything but a late input, or reading, while the step runs is refused."""
    from vkrt.backend.vulkan import batch as vkbatch

    monkeypatch.setattr(vkbatch, "FENCE_TIMEOUT_NS", 60_000_000_000)
    vk = vk_default
    x = vk.upload(np.arange(8, dtype=np.float32), purpose="inputs")
    other = vk.upload(np.zeros(8, np.float32))
    with vk.capture() as graph:
        graph.wait_for_host(x)
        y = ops.add(x, x)

    def fail() -> None:
        vk.write(x, np.ones(8, np.float32))
        raise RuntimeError("the grammar broke")

    with pytest.raises(RuntimeError, match="the grammar broke"):
        graph.replay(during=fail)
    c = vk.counters
    assert c.submits == c.fence_waits  # nothing left in flight
    assert np.array_equal(y.numpy(), np.full(8, 2.0, np.float32))  # the host's write was waited for
    for misuse in (lambda: vk.write(other, np.ones(8, np.float32)), lambda: vk.read(y)):
        with pytest.raises(VkrtError, match="replayed step"):
            graph.replay(during=misuse)
    graph.replay(during=lambda: vk.write(x, np.full(8, 3.0, np.float32)))
    assert np.array_equal(y.numpy(), np.full(8, 6.0, np.float32))
    with pytest.raises(VkrtError, match="recorded"):
        graph.wait_for_host(x)  # late inputs are declared only while recording


def test_released_pipelines_make_recorded_graphs_stale(vk) -> None:
    """release_pipelines destroys every pipeline: a graph recorded before refuses to replay
    (its command buffer binds them), eager dispatches create them again with the same results,
    and the engine's runner records its decode step again."""
    from vkrt.engine import LLM, EngineConfig, SamplingParams

    x = vk.upload(np.arange(12, dtype=np.float32).reshape(3, 4))
    with vk.capture() as graph:
        y = ops.add(x, x)
    graph.replay()
    first = y.numpy().copy()
    assert vk.release_pipelines() > 0 and graph.stale
    with pytest.raises(VkrtError, match="released its pipelines"):
        graph.replay()
    np.testing.assert_array_equal(ops.add(x, x).numpy(), first)
    graph.release()
    llm = LLM(EngineConfig(model=str(FIXTURES / "tiny_llama"), device="vulkan", max_num_seqs=1, num_kv_blocks=8,
                           max_model_len=64, block_size=16))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    expected = llm.generate([[5, 9, 11, 200]], greedy)[0].token_ids
    vk.release_pipelines()
    before = vk.counters.snapshot()
    assert llm.generate([[5, 9, 11, 200]], greedy)[0].token_ids == expected
    assert vk.counters.since(before)["drains"] == 0
    graphs = llm.engine.runner._graphs.values()
    assert graphs and not any(g.graph.stale for g in graphs)  # recorded again, not run eagerly
