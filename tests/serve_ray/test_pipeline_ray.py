"""Pipeline stages as Ray actors (`--distributed-executor-backend ray`): on a local Ray instance here
(one node; on a cluster the placement group spreads the stages over nodes), the same bits as one
device and as local stage processes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.server import live_model
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.pipeline import PipelineModel
from vkrt.errors import DeviceLostError

ray = pytest.importorskip("ray", reason="the ray extra (tests install it): pip install 'vkrt[ray]'")

DEVICE = live_model.test_device()
MODEL = FIXTURES / "tiny_qwen3_moe"


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _generate(**config: object) -> tuple[list[list[int]], list[list[float]], dict, list[str]]:
    prompts = [c["input_ids"] for c in json.loads((MODEL / "golden.json").read_text())["cases"]]
    llm = LLM(MODEL, device=DEVICE, max_model_len=128, max_num_seqs=4, kv_dtype="f32", **config)
    try:
        model = llm.engine.model
        where = model.nodes() if isinstance(model, PipelineModel) else []
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2))
        return ([o.token_ids for o in outputs], [[lp.token.logprob for lp in o.outputs[0].logprobs] for o in outputs],
                llm.stats(), where)
    finally:
        llm.close()


def test_ray_stages_equal_one_device_and_local_stages() -> None:
    one_ids, one_logprobs, _, _ = _generate()
    ids, logprobs, stats, where = _generate(pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert ids == one_ids and logprobs == one_logprobs
    assert len(where) == 2 and all(f"pid {os.getpid()}" not in w for w in where)  # actors, not this process
    assert len(set(where)) == 2
    assert stats["decode_counters_max"]["drains"] == 0


def _step():  # type: ignore[no-untyped-def]
    from vkrt.backend import get_backend
    from vkrt.models import ForwardBatch, StepTensors

    batch = ForwardBatch(token_ids=np.array([1], np.int32), positions=np.array([0], np.int32),
                         seq_index=np.array([0], np.int32), slots=np.array([0], np.int32),
                         block_tables=np.zeros((1, 1), np.int32), logits_index=np.array([0], np.int32))
    return StepTensors.upload(get_backend("reference"), batch)


def test_a_ray_stage_that_dies_is_a_lost_device_naming_it() -> None:
    llm = LLM(FIXTURES / "tiny_llama", device=DEVICE, max_model_len=64, pipeline_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        model = llm.engine.model
        assert isinstance(model, PipelineModel)
        ray.kill(model.stages[1].actor)  # type: ignore[attr-defined]
        with pytest.raises(DeviceLostError, match=r"pipeline stage 1 \(layers 1-1\) stopped"):
            model.forward(_step(), llm.engine.runner.kv)
    finally:
        llm.close()
