"""Pipeline parallelism (vkrt/engine/pipeline.py): a model's layers over stage processes, each with
its own device (two llvmpipe devices here, one per process), equal to one device token for token
and logprob for logprob, one submit per stage per step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.server import live_model
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.pipeline import PipelineModel
from vkrt.errors import DeviceLostError, UnsupportedModelError, VkrtError
from vkrt.loader import load_model
from vkrt.models import split_layers, unsplittable

DEVICE = live_model.test_device()


def _golden(name: str) -> list[dict]:
    return json.loads((FIXTURES / name / "golden.json").read_text())["cases"]


def _run(model: str | Path, stages: int, prompts: list[list[int]], max_tokens: int = 16,
         **config: object) -> tuple[list[list[int]], list[list[float]], dict]:
    llm = LLM(model, device=DEVICE, max_model_len=128, max_num_seqs=4, kv_dtype="f32",
              pipeline_parallel_size=stages, **config)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params)
        ids = [o.token_ids for o in outputs]
        logprobs = [[lp.token.logprob for lp in o.outputs[0].logprobs] for o in outputs]
        return ids, logprobs, llm.stats()
    finally:
        llm.close()


def test_layers_split_evenly_and_the_split_is_checked() -> None:
    assert [(s.start, s.stop) for s in split_layers(30, 4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [(s.first, s.last) for s in split_layers(3, 3)] == [(True, False), (False, False), (False, True)]
    with pytest.raises(VkrtError, match=r"--pipeline-parallel-size must be in \[1, 2\]"):
        split_layers(2, 3)


@pytest.mark.parametrize(("fixture", "why"), [("tiny_qwen3_5", "recurrent layers"),
                                              ("tiny_gemma4", "per-layer embeddings")])
def test_models_whose_layers_share_more_than_the_hidden_state_are_refused(fixture: str, why: str) -> None:
    loaded = load_model(FIXTURES / fixture)
    assert why in (unsplittable(loaded.config) or "")
    with pytest.raises(UnsupportedModelError, match="cannot split this model into pipeline stages"):
        PipelineModel(loaded, None, 2)  # type: ignore[arg-type]  # refused before any stage starts


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe", "tiny_deepseek_v3"])
def test_two_stages_equal_one_device_and_transformers(fixture: str) -> None:
    """Dense, MoE and MLA layers: greedy ids are transformers', and ids and logprobs equal one
    device's bit for bit (the hidden state crosses the host as f32, unchanged)."""
    cases = _golden(fixture)
    prompts = [c["input_ids"] for c in cases]
    one_ids, one_logprobs, _ = _run(FIXTURES / fixture, 1, prompts)
    two_ids, two_logprobs, stats = _run(FIXTURES / fixture, 2, prompts)
    assert two_ids == one_ids == [c["greedy_ids"] for c in cases]
    assert two_logprobs == one_logprobs
    decode = stats["decode_counters_max"]
    # one per stage per micro-batch: a step of several sequences is cut in two
    assert decode["drains"] == 0 and decode["submits"] == 2 * min(2, len(prompts))


def test_micro_batches_cut_a_step_by_sequences_and_give_back_its_logits_rows() -> None:
    from vkrt.engine.pipeline import micro_batches
    from vkrt.models import ForwardBatch

    # 4 sequences of 5, 1, 1 and 3 tokens; logits rows: prompt rows of the first, the last token of
    # each but the third (it is mid-prompt), two rows of the fourth (a speculative verify).
    lengths = [5, 1, 1, 3]
    seq_index = np.repeat(np.arange(4), lengths).astype(np.int32)
    rows = np.array([1, 2, 3, 4, 5, 8, 9], np.int32)
    batch = ForwardBatch(token_ids=np.arange(100, 110, dtype=np.int32), positions=np.arange(10, dtype=np.int32),
                         seq_index=seq_index, slots=np.arange(10, dtype=np.int32)[None],
                         block_tables=np.arange(8, dtype=np.int32).reshape(1, 4, 2), logits_index=rows)
    assert micro_batches(batch, 1) == [(batch, 0)]
    parts = micro_batches(batch, 2)
    assert [p.num_seqs for p, _ in parts] == [1, 3]  # 5 tokens against 5
    for count in (2, 3, 4, 9):
        parts = micro_batches(batch, count)
        assert len(parts) == min(count, 4)
        assert np.concatenate([p.token_ids for p, _ in parts]).tolist() == batch.token_ids.tolist()
        assert np.concatenate([p.slots for p, _ in parts], axis=-1).tolist() == batch.slots.tolist()
        assert np.concatenate([p.block_tables for p, _ in parts], axis=-2).tolist() == batch.block_tables.tolist()
        assert np.concatenate([p.state_slots for p, _ in parts]).tolist() == [0, 1, 2, 3]  # type: ignore[misc]
        starts = np.cumsum([0] + [p.num_tokens for p, _ in parts])
        kept = np.concatenate([p.logits_index[:len(p.logits_index) - drop] + t0
                               for (p, drop), t0 in zip(parts, starts, strict=False)])
        assert kept.tolist() == rows.tolist()
        for p, drop in parts:
            assert p.seq_index.min() == 0 and p.seq_index.max() == p.num_seqs - 1
            assert drop == (1 if p.token_ids.tolist() == [106] else 0)  # the third alone has no row


def test_stages_one_after_another_equal_micro_batches() -> None:
    """--pipeline-micro-batches 1 against the default (2 for 2 stages): the same bits, half the
    submits per decode step."""
    prompts = [c["input_ids"] for c in _golden("tiny_llama")][:3]
    one, one_logprobs, one_stats = _run(FIXTURES / "tiny_llama", 2, prompts, pipeline_micro_batches=1)
    two, two_logprobs, two_stats = _run(FIXTURES / "tiny_llama", 2, prompts)
    assert one == two and one_logprobs == two_logprobs
    assert one_stats["decode_counters_max"]["submits"] == 2
    assert two_stats["decode_counters_max"]["submits"] == 4


def test_each_stage_holds_only_its_layers() -> None:
    """The stages' weights add up to one device's (each layer, the embedding and the head once:
    tiny_llama's head is its own matrix) and their K/V to the engine's whole cache."""
    from vkrt.backend import get_backend

    loaded = load_model(FIXTURES / "tiny_llama")
    # One stage is the whole model in a fresh process: this process's device also holds the weights
    # of every model other tests loaded, so its counters cannot serve as the reference.
    whole = PipelineModel(loaded, get_backend("reference"), 1, DEVICE)
    model = PipelineModel(loaded, get_backend("reference"), 2, DEVICE)
    try:
        # Before the caches: each stage then also builds its own RoPE tables for the positions.
        (everything,) = [s["weights_bytes"] for s in whole.memory_stats()]
        weights = [s["weights_bytes"] for s in model.memory_stats()]
        assert all(0 < w < everything for w in weights)
        assert sum(weights) == everything
        c = loaded.config
        kv = model.allocate_kv_cache(8, 16, "f32")
        assert kv.nbytes == 2 * 8 * 16 * c.num_kv_heads * c.head_dim * 4 * c.num_layers
        assert [s["kv_bytes"] for s in model.memory_stats()] == [kv.nbytes // 2] * 2
    finally:
        model.close()
        whole.close()


def test_pooling_requests_over_two_stages_equal_one_device_and_transformers() -> None:
    """Embeddings (last, mean, first token) beside a generating request: the last stage sends back
    the rows' final-norm hidden states with the logits."""
    from vkrt.engine.pooling import PoolingParams

    model = FIXTURES / "tiny_qwen3_embed"
    golden = json.loads((model / "pooling_golden.json").read_text())["embeddings"]

    def embed(stages: int) -> list[np.ndarray]:
        llm = LLM(model, device=DEVICE, max_model_len=128, max_num_seqs=4, kv_dtype="f32",
                  pipeline_parallel_size=stages)
        try:
            return [r.embedding for method in ("last", "mean", "cls")
                    for r in llm.embed([e["ids"] for e in golden], PoolingParams(method))]
        finally:
            llm.close()

    one, two = embed(1), embed(2)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)
    expected = [e[method] for method in ("last", "mean", "cls") for e in golden]
    for got, want in zip(two, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_the_default_model_over_two_stages_equals_one_device(smollm2_path: Path) -> None:
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 22, 23, 24]]
    one_ids, one_logprobs, _ = _run(smollm2_path, 1, prompts, max_tokens=24)
    two_ids, two_logprobs, _ = _run(smollm2_path, 2, prompts, max_tokens=24)
    assert two_ids == one_ids and two_logprobs == one_logprobs


def test_a_stage_that_stops_is_a_lost_device_naming_it() -> None:
    llm = LLM(FIXTURES / "tiny_llama", device=DEVICE, max_model_len=64, pipeline_parallel_size=2)
    try:
        model = llm.engine.model
        assert isinstance(model, PipelineModel)
        os.kill(model.stages[1]._process.pid, signal.SIGKILL)
        model.stages[1]._process.wait()
        with pytest.raises(DeviceLostError, match=r"pipeline stage 1 \(layers 1-1\) stopped"):
            llm.engine.model.forward(_step(), llm.engine.runner.kv)
    finally:
        llm.close()


def _step():  # type: ignore[no-untyped-def]
    from vkrt.backend import get_backend
    from vkrt.models import ForwardBatch, StepTensors

    batch = ForwardBatch(token_ids=np.array([1], np.int32), positions=np.array([0], np.int32),
                         seq_index=np.array([0], np.int32), slots=np.array([0], np.int32),
                         block_tables=np.zeros((1, 1), np.int32), logits_index=np.array([0], np.int32))
    return StepTensors.upload(get_backend("reference"), batch)


def test_pipeline_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from vkrt.cli import main

    assert main(["generate", "hi", "--model", str(FIXTURES / "tiny_llama"), "--pipeline-parallel-size", "0"]) == 1
    assert "--pipeline-parallel-size must be >= 1" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(FIXTURES / "tiny_llama"), "-pp", "2",
                 "--pipeline-devices", "0,1,2"]) == 1
    assert "names 3 devices for --pipeline-parallel-size 2" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(FIXTURES / "tiny_llama"), "-pp", "2",
                 "--pipeline-micro-batches", "0"]) == 1
    assert "--pipeline-micro-batches must be >= 1" in capsys.readouterr().err


def test_mtp_speculation_over_stages_is_refused_and_the_stages_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MTP head runs on one device: with two stages the engine refuses it with a message,
    and the pipeline the load started is closed (its stage processes do not outlive the error)."""
    from vkrt.engine.speculative import SpeculativeConfig

    closed: list[PipelineModel] = []
    close = PipelineModel.close

    def recorded(self: PipelineModel) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(PipelineModel, "close", recorded)
    with pytest.raises(VkrtError, match="does not combine with --pipeline-parallel-size"):
        LLM(FIXTURES / "tiny_glm4_moe_mtp", device=DEVICE, max_model_len=64, pipeline_parallel_size=2,
            speculative=SpeculativeConfig("mtp", 2))
    assert len(closed) == 1 and all(stage._process.poll() is not None for stage in closed[0].stages)
