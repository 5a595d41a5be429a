"""Record once, replay: a recorded step re-run with new inputs equals running it eagerly."""

from __future__ import annotations

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
