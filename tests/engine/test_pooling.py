"""Pooling requests against transformers: the final-norm hidden states pooled last / mean / cls
equal the goldens on the reference backend and on Vulkan, chunked or whole, beside generation,
and a classifier's or a yes/no reranker's last logits give transformers' scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vkrt.backend import vulkan_unavailable_reason
from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.engine.engine import EngineCore
from vkrt.engine.pooling import PoolingParams, PoolingResult
from vkrt.errors import RequestError

FIXTURES = Path(__file__).parents[1] / "fixtures"
EMBED = FIXTURES / "tiny_qwen3_embed"
SEQCLS = FIXTURES / "tiny_qwen3_seqcls"


def device(name: str) -> str:
    if name == "vulkan" and vulkan_unavailable_reason() is not None:
        pytest.skip(f"Vulkan unavailable: {vulkan_unavailable_reason()}")
    return name


def engine(model: Path, device_name: str, **kwargs: object) -> EngineCore:
    # f32 KV: the goldens are transformers' f32 forward (the default f16 KV rounds K/V once).
    config = {"max_model_len": 128, "kv_dtype": "f32", **kwargs}
    return EngineCore.from_config(EngineConfig(model=str(model), device=device(device_name), **config))  # type: ignore[arg-type]


def run(core: EngineCore, prompts: dict[str, tuple[list[int], PoolingParams]]) -> dict[str, PoolingResult]:
    for name, (ids, params) in prompts.items():
        core.add(core.make_pooling_request(name, ids, params))
    results: dict[str, PoolingResult] = {}
    while core.has_unfinished():
        for output in core.step():
            if output.pooling is not None:
                results[output.request_id] = output.pooling
    assert results.keys() == prompts.keys()
    return results


@pytest.mark.parametrize("device_name", ["reference", "vulkan"])
@pytest.mark.parametrize("chunk", [512, 5], ids=["whole", "chunked"])
def test_pooled_states_equal_transformers(device_name: str, chunk: int) -> None:
    golden = json.loads((EMBED / "pooling_golden.json").read_text())["embeddings"]
    core = engine(EMBED, device_name, max_num_batched_tokens=chunk)
    prompts = {f"{i}-{m}": (e["ids"], PoolingParams(m)) for i, e in enumerate(golden) for m in ("last", "mean", "cls")}
    core.add_request("generation", golden[0]["ids"], SamplingParams(max_tokens=3, temperature=0.0))
    results = run(core, prompts)
    for i, e in enumerate(golden):
        for method in ("last", "mean", "cls"):
            result = results[f"{i}-{method}"]
            assert result.num_prompt_tokens == len(e["ids"])
            np.testing.assert_allclose(result.embedding, e[method], atol=2e-5, rtol=1e-5, err_msg=f"{i} {method}")


def test_a_prompt_pools_the_same_alone_and_in_a_batch() -> None:
    golden = json.loads((EMBED / "pooling_golden.json").read_text())["embeddings"]
    core = engine(EMBED, "vulkan" if vulkan_unavailable_reason() is None else "reference")
    alone = run(core, {"alone": (golden[1]["ids"], PoolingParams("mean"))})["alone"]
    batch = run(core, {str(i): (e["ids"], PoolingParams("mean")) for i, e in enumerate(golden)})
    np.testing.assert_array_equal(alone.embedding, batch["1"].embedding)


@pytest.mark.parametrize("device_name", ["reference", "vulkan"])
def test_classifier_logits_equal_transformers(device_name: str) -> None:
    golden = json.loads((SEQCLS / "pooling_golden.json").read_text())
    core = engine(SEQCLS, device_name)
    assert core.model.config.num_labels == 1
    assert core.tokenizer is not None
    prompts = {str(i): (core.tokenizer.encode_pair(golden["query"], d), PoolingParams("last", logits=True))
               for i, d in enumerate(golden["documents"])}
    results = run(core, prompts)
    for i, expected in enumerate(golden["scores"]):
        logits = results[str(i)].logits
        assert logits is not None and logits.shape == (1,)
        assert 1 / (1 + np.exp(-logits[0])) == pytest.approx(expected, abs=2e-5)


def test_a_classifier_refuses_generation_and_pools_a_full_context() -> None:
    core = engine(SEQCLS, "reference", max_model_len=16)
    with pytest.raises(RequestError, match="sequence classifier"):
        core.make_request("g", [5, 6], SamplingParams(max_tokens=2))
    run(core, {"full": ([7] * 16, PoolingParams("last"))})  # nothing is generated: the whole context is the prompt
    with pytest.raises(RequestError, match="maximum context length"):
        core.make_pooling_request("long", [7] * 17, PoolingParams("last"))
    with pytest.raises(RequestError, match="pooling method"):
        core.make_pooling_request("bad", [7], PoolingParams("max"))


def test_pooling_computes_every_position_despite_the_prefix_cache() -> None:
    golden = json.loads((EMBED / "pooling_golden.json").read_text())["embeddings"][3]
    core = engine(EMBED, "reference", enable_prefix_caching=True, block_size=4)
    core.add_request("warm", golden["ids"], SamplingParams(max_tokens=1, temperature=0.0))
    while core.has_unfinished():
        core.step()
    mean = run(core, {"mean": (golden["ids"], PoolingParams("mean"))})["mean"]
    np.testing.assert_allclose(mean.embedding, golden["mean"], atol=2e-5, rtol=1e-5)


def test_llm_embed_batches_prompts() -> None:
    from vkrt.engine import LLM

    golden = json.loads((EMBED / "pooling_golden.json").read_text())["embeddings"]
    llm = LLM(EMBED, device="reference", max_model_len=64, kv_dtype="f32")
    results = llm.embed([e["text"] for e in golden], PoolingParams("cls"))
    for result, e in zip(results, golden, strict=True):
        np.testing.assert_allclose(result.embedding, e["cls"], atol=2e-5, rtol=1e-5)
    with pytest.raises(RequestError, match="empty"):
        llm.embed([[]])
