"""Continuous batching over FakeLM: budgets, chunked prefill mixed with decodes, preemption,
abort, prefix caching. Expected tokens come from FakeLM.reference_greedy (no KV cache)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from engine_fakes import FakeLM

from vkrt.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def fake(llm: LLM) -> FakeLM:
    model = llm.engine.model
    assert isinstance(model, FakeLM)
    return model


def test_token_budget_and_max_num_seqs(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(max_num_batched_tokens=16, max_num_seqs=3)
    batch = prompts(6)
    outputs = llm.generate(batch, GREEDY)
    steps = fake(llm).steps
    assert max(t for t, _ in steps) <= 16 and max(s for _, s in steps) <= 3
    assert max(t for t, _ in steps) == 16  # the budget was actually used
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.token_ids == fake(llm).reference_greedy(prompt, 12)


def test_chunked_prefill_runs_in_the_same_step_as_decodes(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(max_num_batched_tokens=16)
    engine = llm.engine
    short, long = [1, 2, 3], list(range(10, 60))
    engine.add_request("short", short, GREEDY)
    engine.step()  # prefill of "short" + its first token
    engine.add_request("long", long, GREEDY)
    engine.step()
    # One forward: the decode of "short" (1 token) and a 15-token chunk of "long".
    assert fake(llm).steps[-1] == (16, 2)
    assert engine.scheduler.requests["long"].num_computed_tokens == 15
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
    model = fake(llm)
    assert results["long"] == model.reference_greedy(long, 12)
    assert results["short"] == model.reference_greedy(short, 12)
    assert all(tokens <= 16 for tokens, _ in model.steps)


def test_preemption_under_kv_pressure_keeps_outputs_exact(make_llm: Callable[..., LLM]) -> None:
    # 16 blocks x 4 tokens; 8 requests of up to ~40 tokens each cannot all be resident.
    llm = make_llm(block_size=4, num_kv_blocks=16, max_model_len=64, max_num_seqs=8)
    batch = prompts(8, seed=1, lo=5, hi=20)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(8)]
    outputs = llm.generate(batch, greedy)
    assert llm.engine.num_preemptions > 0
    assert any(o.metrics is not None and o.metrics.num_preemptions for o in outputs)
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.token_ids == fake(llm).reference_greedy(prompt, 20)
    before = llm.engine.num_preemptions
    sampled = llm.generate(batch, seeded)
    assert llm.engine.num_preemptions > before
    solo = make_llm(max_model_len=64)
    for prompt, params, out in zip(batch, seeded, sampled, strict=True):
        assert out.token_ids == solo.generate([prompt], params)[0].token_ids
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_abort_frees_blocks_at_once(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(block_size=4)
    engine = llm.engine
    blocks = engine.block_manager
    initial = blocks.num_free_blocks
    for i, prompt in enumerate(prompts(3, seed=2, lo=20, hi=30)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    held = len(blocks.block_table("r1"))
    assert held > 0
    free_before = blocks.num_free_blocks
    final = engine.abort("r1")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert blocks.num_free_blocks == free_before + held
    assert engine.abort("r1") is None and engine.abort("unknown") is None
    engine.add_request("waiting", [5, 6, 7], GREEDY)
    assert engine.abort("waiting") is not None  # aborting a request that never ran
    finished = set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"r0", "r2"}
    assert blocks.num_free_blocks == initial


def test_prefix_cache_hits_give_the_same_tokens(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(block_size=4)
    shared = list(range(100, 130))
    first = llm.generate([shared + [1, 2]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    pair = llm.generate([shared + [3], shared + [4, 5, 6]], GREEDY)
    assert all(o.num_cached_tokens == 28 for o in pair)  # 7 full blocks of the 30 shared tokens
    # Same step: the second request reuses blocks that the first one fills in that very step.
    fresh = list(range(150, 170))
    same_step = llm.generate([fresh + [1], fresh + [2]], GREEDY)
    assert [o.num_cached_tokens for o in same_step] == [0, 20]
    assert len(fake(llm).steps) == 3 * 12  # the two requests really shared one prefill step
    model = fake(llm)
    for out in (first, *pair, *same_step):
        assert out.token_ids == model.reference_greedy(out.prompt_token_ids, 12)
    blocks = llm.engine.block_manager
    assert blocks.prefix_hits > 0 and blocks.num_free_blocks == blocks.num_blocks


def test_logprobs_and_prompt_logprobs_match_uncached_logits(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(max_num_batched_tokens=8)  # the prompt spans several chunks
    prompt = list(range(30, 50))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, logprob_token_ids=[7])
    out = llm.generate([prompt, prompts(1)[0]], params)[0]
    model = fake(llm)
    logits = model.reference_logits(prompt + out.token_ids).astype(np.float64)
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry is not None and entry.token.token_id == prompt[i]
        assert abs(entry.token.logprob - lp[i - 1, prompt[i]]) < 1e-4
        assert entry.top[0].token_id == int(np.argmax(lp[i - 1])) and entry.scored[0].token_id == 7
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 4
    for k, entry in enumerate(logprobs):
        row = lp[len(prompt) - 1 + k]
        assert entry.token.token_id == out.token_ids[k] and entry.token.rank == 1  # greedy
        assert abs(entry.token.logprob - row.max()) < 1e-4 and len(entry.top) == 2
        assert abs(entry.scored[0].logprob - row[7]) < 1e-4


def test_prompt_logprobs_minus_one_scores_the_whole_vocabulary(make_llm: Callable[..., LLM]) -> None:
    """vLLM's prompt_logprobs=-1: every vocabulary entry at each prompt position, in rank order."""
    llm = make_llm()
    prompt = list(range(30, 36))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1))[0]
    logits = fake(llm).reference_logits(prompt).astype(np.float64)
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry is not None and len(entry.top) == lp.shape[1]
        assert sorted(alt.token_id for alt in entry.top) == list(range(lp.shape[1]))
        assert [alt.rank for alt in entry.top] == list(range(1, lp.shape[1] + 1))
        assert max(abs(alt.logprob - lp[i - 1, alt.token_id]) for alt in entry.top) < 1e-4


def test_steps_are_counted_by_the_tokens_they_ran(make_llm: Callable[..., LLM]) -> None:
    """vllm:iteration_tokens_total's source: a 20-token prompt in chunks of 8, 8 and 4, then 3
    one-token decode steps."""
    from vkrt.engine.engine import STEP_TOKEN_BUCKETS

    llm = make_llm(max_num_batched_tokens=8)
    llm.generate([list(range(30, 50))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    totals = llm.engine.totals
    by_bound = dict(zip((*STEP_TOKEN_BUCKETS, "above"), totals.steps_by_tokens, strict=True))
    assert (by_bound[1], by_bound[8], by_bound[16]) == (3, 3, 0) and sum(totals.steps_by_tokens) == totals.steps
    assert totals.step_tokens == 20 + 3
