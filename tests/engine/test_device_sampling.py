"""Sampling inside the replayed decode step: reproducible per seed whatever the batch or the
path (replayed on the device, eager, host sampler, reference backend), one draw per sampled
token, and only token ids read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vkrt.backend import vulkan_unavailable_reason
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.request import Request
from vkrt.engine.runner import StepStats
from vkrt.engine.sampler import is_device_samplable, is_plain_greedy, sample_inputs

TINY = Path(__file__).parents[1] / "fixtures" / "tiny_llama"
PROMPTS = [[5, 9, 11, 200], [1, 2, 3], [77] * 9, [250, 3, 40, 41, 42, 7]]


def vulkan() -> str:
    reason = vulkan_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Vulkan unavailable: {reason}")
    return "vulkan"


def tiny(device: str, **kwargs: Any) -> LLM:
    # f32 KV: draws are compared across backends, whose f16 roundings of K/V could differ.
    return LLM(TINY, device=device, max_model_len=128, **{"kv_dtype": "f32", **kwargs})


def sampled(seed: int | None, max_tokens: int = 24, **kwargs: Any) -> SamplingParams:
    kwargs = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, **kwargs}
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kwargs)


def record_steps(llm: LLM) -> list[StepStats]:
    steps: list[StepStats] = []
    llm.engine.stats_listeners.append(lambda stats: steps.append(stats.step))
    return steps


def test_device_samplable_mirrors_plain_greedy() -> None:
    def request(**kwargs: Any) -> Request:
        return Request("r", [1], SamplingParams(**kwargs))

    assert is_device_samplable(request(temperature=0.7, top_k=64))
    assert is_plain_greedy(request(temperature=0.0))
    for params in ({"top_k": 0}, {"top_k": -1}, {"top_k": 65}, {"temperature": 0.0, "top_k": 5},
                   {"top_k": 5, "repetition_penalty": 1.1}, {"top_k": 5, "presence_penalty": 0.5},
                   {"top_k": 5, "frequency_penalty": 0.5}, {"top_k": 5, "logit_bias": {3: 1.0}},
                   {"top_k": 5, "logprobs": 0}, {"top_k": 5, "logprob_token_ids": [1]},
                   {"top_k": 5, "min_tokens": 1}):
        assert not is_device_samplable(request(**params)), params
    host_only = request(top_k=0, seed=1)
    state = host_only.generator.bit_generator.state
    assert sample_inputs([request(top_k=5), host_only], 2) is None
    assert host_only.generator.bit_generator.state == state  # nothing drawn


def test_device_sampling_is_reproducible_and_batch_independent() -> None:
    llm = tiny(vulkan(), max_num_seqs=8)
    steps = record_steps(llm)
    alone = llm.generate([PROMPTS[0]], sampled(seed=7))[0].token_ids
    assert len(alone) == 24
    assert any(s.replayed for s in steps)
    others = [sampled(seed=1, top_k=3), sampled(seed=None, temperature=0.0), sampled(seed=2, top_p=0.5, min_p=0.1)]
    batched = llm.generate(PROMPTS, [sampled(seed=7)] + others)
    assert batched[0].token_ids == alone
    # Chunked prefill: the target's first decode steps share eager steps with prefill chunks.
    mixed = tiny(vulkan(), max_num_seqs=8, max_num_batched_tokens=8)
    mixed_steps = record_steps(mixed)
    assert mixed.generate(PROMPTS, [sampled(seed=7)] + others)[0].token_ids == alone
    assert any(not s.replayed and s.num_seqs > 1 and s.num_tokens > s.num_seqs for s in mixed_steps)
    assert llm.generate([PROMPTS[0]], sampled(seed=7))[0].token_ids == alone
    assert llm.generate([PROMPTS[0]], sampled(seed=8))[0].token_ids != alone


def test_every_path_draws_the_same_tokens() -> None:
    """Host sampler (a neighbour needs it), eager steps, and the reference backend agree."""
    params = sampled(seed=11, max_tokens=20, top_k=20, min_p=0.02)
    device = tiny(vulkan()).generate([PROMPTS[1]], params)[0].token_ids
    penalised = sampled(seed=3, repetition_penalty=1.3)  # forces host sampling of every row
    host = tiny(vulkan()).generate(PROMPTS[1:3], [params, penalised])[0].token_ids
    eager = tiny(vulkan(), enable_replay=False).generate([PROMPTS[1]], params)[0].token_ids
    reference = tiny("reference").generate([PROMPTS[1]], params)[0].token_ids
    assert host == device and eager == device and reference == device


def test_top_k_1_equals_greedy() -> None:
    llm = tiny(vulkan())
    greedy = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    top1 = llm.generate(PROMPTS[:2], sampled(seed=5, max_tokens=16, top_k=1, temperature=1.3))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_one_draw_per_sampled_token() -> None:
    llm = tiny(vulkan())
    engine = llm.engine
    target = engine.add_request("s", PROMPTS[0], sampled(seed=21, max_tokens=12))
    engine.add_request("g", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    fresh = np.random.Generator(np.random.PCG64(21))
    fresh.random(12)
    assert target.num_output_tokens == 12
    assert target.generator.bit_generator.state == fresh.bit_generator.state


def test_device_sampled_step_reads_back_only_ids() -> None:
    llm = tiny(vulkan(), max_num_seqs=4)
    steps = record_steps(llm)
    llm.generate(PROMPTS, [sampled(seed=s, max_tokens=10) for s in range(3)] + [sampled(None, max_tokens=10, temperature=0.0)])
    decode = [s for s in steps if s.replayed]
    assert len(decode) == 9
    for step in decode:
        bucket = 1 << (step.num_seqs - 1).bit_length()
        c = step.counters
        assert (c["bytes_down"], c["submits"], c["fence_waits"], c["drains"]) == (4 * bucket, 1, 1, 0)
