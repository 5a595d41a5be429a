"""Prefix caching for hybrid models: recurrent-state snapshots at cached block boundaries.

tiny_lfm2 (short convolutions), tiny_qwen3_5 (gated delta nets), tiny_granite4 (Mamba2) and
tiny_falcon_h1 (attention and Mamba2 in the same layers: a hit serves both their blocks and their
snapshot), on Vulkan and on the numpy reference device, each loaded once per module and shared by fresh
engines. A hit serves the attention layers' blocks and starts the recurrent layers from the
snapshot taken where a chunk of an earlier prompt ended on that boundary; it must give the ids
and logprobs of the same prompt computed without it (a miss on a cold cache, whose chunks end
on the same boundaries), and the same ids as an engine with prefix caching off. The hit is
checked to have happened, to be cut to the last boundary that has a snapshot, and every path
(hits, chunked prefill, concurrency, preemption, abort, eviction) to leave the state slots and
the snapshot slots free and each snapshot tied to a block still cached.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.conftest import FIXTURES
from vkrt.backend import get_backend
from vkrt.engine import LLM, SamplingParams
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.models.base import CausalLM

# bit-exact across splits of a prompt into steps: the recurrent delta-net and Mamba2 kernels (conftest.py)
pytestmark = pytest.mark.usefixtures("recurrent_prefill")

MAX_LEN = 64
BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
MODELS: dict[tuple[str, str], CausalLM] = {}


@pytest.fixture(scope="module", params=["tiny_lfm2", "tiny_qwen3_5", "tiny_granite4", "tiny_falcon_h1"])
def fixture(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=["vulkan", "reference"])
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def prompt(fixture: str) -> list[int]:
    """The fixture's 40-token prompt: two full blocks and 8 tokens."""
    cases = json.loads((FIXTURES / fixture / "golden.json").read_text())["cases"]
    ids = cases[-1]["input_ids"]
    assert len(ids) == 40
    return list(ids)


def sharing(fixture: str, length: int) -> list[int]:
    """A prompt of 39 tokens sharing the first `length` of `prompt` (then different tokens)."""
    p = prompt(fixture)
    tail = [(t + 1) % 50 for t in p[length:]]  # tiny fixtures have vocabularies of >= 64
    return (p[:length] + tail + p)[:39]


def make_llm(fixture: str, device: str, **overrides: Any) -> LLM:
    """A fresh engine (cold prefix cache) over the module's loaded model."""
    if (fixture, device) not in MODELS:
        MODELS[fixture, device] = build_model(load_model(FIXTURES / fixture), get_backend(device))
    config: dict[str, Any] = dict(device=device, max_model_len=MAX_LEN, max_num_seqs=4, kv_dtype="f32")
    return LLM(FIXTURES / fixture, model=MODELS[fixture, device], **{**config, **overrides})


Result = tuple[list[int], list[float]]


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[Result, int]]:
    """Each output's (ids, logprobs) and its prompt tokens served from the cache."""
    return [((o.token_ids, [lp.token.logprob for lp in o.outputs[0].logprobs]), o.num_cached_tokens)
            for o in llm.generate(prompts, GREEDY)]


def results(runs: list[tuple[Result, int]]) -> list[Result]:
    return [r for r, _ in runs]


def assert_same(got: list[Result], want: list[Result], device: str) -> None:
    """For runs whose chunks or batches differ: ids exactly; logprobs exactly on Vulkan, whose
    steps are chunk and batch invariant bit for bit. The reference device's float64 matmuls
    round a row differently with the rows beside it (a prompt split into other chunks: measured
    ~6e-8 on a logprob), so there logprobs agree to 1e-6 and the bit-exact comparison is the
    cold-cache miss, whose chunks end where the hit's do."""
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, lp), (_, lp_want) in zip(got, want, strict=True):
        if device == "vulkan":
            assert lp == lp_want
        else:
            np.testing.assert_allclose(lp, lp_want, rtol=0, atol=1e-6)


def assert_pools_full(llm: LLM) -> None:
    """Every state slot is free, no snapshot is half taken, and each kept snapshot's prefix is
    still in the prefix cache (a snapshot dies with its block)."""
    blocks = llm.engine.block_manager
    states, snapshots = blocks.states, blocks.snapshots
    assert states is not None and states.num_free == states.num_slots
    assert snapshots is not None and snapshots.num_free == snapshots.num_slots
    assert all(blocks.managers[0].is_cached(h) for h in snapshots.hashes())
    assert blocks.usage == 0.0


def test_a_repeated_prompt_hits_and_equals_the_miss(fixture: str, device: str) -> None:
    p = prompt(fixture)
    want = results(run(make_llm(fixture, device, enable_prefix_caching=False), [p]))
    llm = make_llm(fixture, device)
    engine = llm.engine
    assert engine.prefix_caching and engine.block_manager.snapshots is not None
    (miss, miss_cached), = run(llm, [p])
    hits_before = engine.block_manager.prefix_hits
    (hit, hit_cached), = run(llm, [p])
    assert (miss_cached, hit_cached) == (0, 2 * BLOCK)  # two full blocks; the last token is computed
    assert engine.block_manager.prefix_hits - hits_before == 2 * BLOCK
    assert hit == miss  # ids and logprobs, bit for bit
    assert_same([hit], want, device)
    if device == "vulkan":  # decode steps are still one replayed submit, without a drain
        assert engine.totals.decode_counters_max.get("drains", 0) == 0
        assert engine.totals.decode_counters_max.get("submits", 0) == 1
    assert_pools_full(llm)


def test_prompts_sharing_a_prefix_hit_it(fixture: str, device: str) -> None:
    """A different prompt with the same first 32 tokens starts from their snapshot; concurrent
    hits equal the same prompts run one at a time."""
    p, q = prompt(fixture), sharing(fixture, 2 * BLOCK)
    want = results(run(make_llm(fixture, device, enable_prefix_caching=False), [p, q]))
    cold = results(run(make_llm(fixture, device), [q]))
    llm = make_llm(fixture, device)
    run(llm, [p])
    (q_hit, q_cached), = run(llm, [q])
    assert q_cached == 2 * BLOCK and [q_hit] == cold
    assert_same([q_hit], want[1:], device)
    together = run(llm, [p, q])  # both hit, in one batch
    assert [c for _, c in together] == [2 * BLOCK, 2 * BLOCK]
    alone = [run(llm, [x])[0][0] for x in (p, q)]
    assert_same(results(together), alone, device)
    assert_same(alone, want, device)
    assert_pools_full(llm)


def test_a_hit_is_cut_to_the_last_snapshot(fixture: str, device: str) -> None:
    """The 40-token prompt in one chunk budget runs as 0..32 and 32..40: a snapshot at 32 only.
    A prompt sharing just its first block finds that block cached but no state after it, so it
    is computed whole; in chunks of 7 the chunk crossing 16 is cut there, and it hits."""
    p, r = prompt(fixture), sharing(fixture, BLOCK)
    want = results(run(make_llm(fixture, device, enable_prefix_caching=False), [r]))
    llm = make_llm(fixture, device)
    run(llm, [p])
    blocks = llm.engine.block_manager
    first_block = blocks.managers[0].block_hashes(llm.engine.make_request("x", r, GREEDY), 1)[0]
    assert blocks.managers[0].is_cached(first_block) and blocks.snapshots is not None
    assert blocks.snapshots.lookup(first_block) is None
    (got, cached), = run(llm, [r])
    assert cached == 0
    assert_same([got], want, device)

    chunked = make_llm(fixture, device, max_num_batched_tokens=7)
    first = run(chunked, [p])
    assert chunked.engine.block_manager.snapshots.num_cached == 2  # at 16 and 32
    again, (r_hit, r_cached) = run(chunked, [p])[0], run(chunked, [r])[0]
    assert (again[1], r_cached) == (2 * BLOCK, BLOCK)
    assert again[0] == first[0][0]
    assert_same([again[0], r_hit], results(run(make_llm(fixture, device, enable_prefix_caching=False),
                                                           [p])) + want, device)
    assert_pools_full(chunked)


def test_preemption_and_abort_return_slots_and_snapshots(fixture: str, device: str) -> None:
    p, q = prompt(fixture), sharing(fixture, 2 * BLOCK)
    prompts = [p, q, p, q]
    want = results(run(make_llm(fixture, device), [p])) + results(run(make_llm(fixture, device), [q]))
    # 4 blocks of 16: two shared by all four, each needs one more of its own; they cannot all fit
    llm = make_llm(fixture, device, num_kv_blocks=4, max_num_batched_tokens=64)
    got = run(llm, prompts)
    assert llm.engine.num_preemptions > 0
    assert_same(results(got), want * 2, device)  # a preempted one recomputes in other chunks
    assert_pools_full(llm)

    engine = llm.engine
    for i, x in enumerate(prompts):
        engine.add_request(str(i), x, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    for i in range(len(prompts)):
        engine.abort(str(i))
    assert_pools_full(llm)
    assert results(run(llm, [q])) == want[1:]  # what the aborted ones left is still right


def test_snapshot_memory_bounds_the_snapshots(fixture: str, device: str) -> None:
    """--state-snapshot-memory of one slot: one snapshot, in a state tensor one slot longer than
    the running sequences'; a second prefix evicts the first's (least recently used), whose
    repeat is then computed whole, with the same result."""
    probe = make_llm(fixture, device)
    slot = probe.engine.model.state_bytes_per_slot()
    p, q = prompt(fixture), sharing(fixture, 5)
    llm = make_llm(fixture, device, state_snapshot_memory=slot + slot // 2)
    snapshots = llm.engine.block_manager.snapshots
    assert snapshots is not None and snapshots.num_slots == 1
    assert {t.shape[0] for ts in llm.engine.runner.kv.states.values() for t in ts} == {4 + 1}
    (first, _), = run(llm, [p])
    run(llm, [q])  # takes the only slot
    (again, cached), = run(llm, [p])
    assert cached == 0 and again == first
    assert_pools_full(llm)


def test_metrics_show_the_snapshots() -> None:
    """What /metrics reads: prefix caching on with its snapshot slots; off without snapshot memory."""
    from vkrt.engine import AsyncLLM

    make_llm("tiny_lfm2", "vulkan")  # loads the shared model
    model = MODELS["tiny_lfm2", "vulkan"]
    config: dict[str, Any] = dict(device="vulkan", max_model_len=MAX_LEN, max_num_seqs=4, kv_dtype="f32")
    for memory, enabled in ((None, True), (0, False)):
        llm = AsyncLLM(FIXTURES / "tiny_lfm2", model=model, state_snapshot_memory=memory, **config)
        try:
            metrics = llm.metrics()
            snapshots = llm.engine.block_manager.snapshots
            assert metrics.prefix_caching is enabled
            assert metrics.num_state_snapshots == (snapshots.num_slots if snapshots is not None else 0)
            assert (metrics.num_state_snapshots > 0) is enabled and metrics.num_cached_state_snapshots == 0
        finally:
            llm.shutdown()


# ---- the bookkeeping alone (no model): which copies a step makes, eviction ---------------------------


def test_snapshots_are_taken_at_block_ends_restored_on_hits_and_die_with_their_block() -> None:
    """Blocks of 4, 2 state slots (0, 1) and 2 snapshot slots (2, 3), a pool of 4 blocks."""
    from vkrt.engine.kv_groups import KVCacheManager
    from vkrt.engine.request import Request
    from vkrt.models.base import KVGroup

    blocks = KVCacheManager([KVGroup(0, (0,))], [4], 4, True, num_state_slots=2, num_snapshot_slots=2)
    assert blocks.chunk_alignment == 4
    a = Request("a", list(range(10)), SamplingParams())
    assert blocks.allocate_slots(a, 8, blocks.get_computed_blocks(a))
    copies = blocks.state_copies([(a, 0, 8, 0)])  # ends block 1: a snapshot of slot 0 into slot 2
    assert (copies.restore, copies.snapshot) == ([], [(0, 2)])
    assert blocks.get_computed_blocks(Request("x", list(range(10)), SamplingParams())).num_tokens == 0  # not yet
    blocks.commit_state_snapshots()
    a.num_computed_tokens = 8
    blocks.free(a)

    b = Request("b", list(range(9)) + [99], SamplingParams())  # shares 8 tokens: the snapshot's prefix
    hit = blocks.get_computed_blocks(b)
    assert (hit.num_tokens, hit.state_snapshot) == (8, 2)
    assert blocks.allocate_slots(b, 2, hit)
    copies = blocks.state_copies([(b, 8, 2, 0)])  # restored before the forward; 10 ends no block
    assert (copies.restore, copies.snapshot) == ([(2, 0)], [])
    blocks.free(b)

    c = Request("c", [50 + i for i in range(16)], SamplingParams())  # needs every block: evicts a's
    assert blocks.allocate_slots(c, 16, blocks.get_computed_blocks(c))
    snapshots = blocks.snapshots
    assert snapshots is not None and snapshots.num_cached == 0 and snapshots.num_free == 2
    assert blocks.get_computed_blocks(b).num_tokens == 0


def test_a_verify_step_checkpoints_the_state_and_a_rejection_restores_it() -> None:
    """Blocks of 4, 2 state slots (0, 1), 2 snapshot slots (2, 3), then the checkpoints (4, 5)."""
    from vkrt.engine.kv_groups import KVCacheManager
    from vkrt.engine.request import Request
    from vkrt.models.base import KVGroup

    blocks = KVCacheManager([KVGroup(0, (0,))], [8], 4, True, num_state_slots=2, num_snapshot_slots=2,
                            state_checkpoints=True)
    a, b = Request("a", list(range(7)), SamplingParams()), Request("b", list(range(20, 27)), SamplingParams())
    for r in (a, b):
        assert blocks.allocate_slots(r, 7, blocks.get_computed_blocks(r))
    # b's verify step ends on block 1 with its proposals: the state past them is no snapshot
    copies = blocks.state_copies([(a, 6, 1, 0), (b, 6, 2, 1)])
    assert (copies.restore, copies.snapshot) == ([(1, 5)], [])
    blocks.roll_back_state(b)  # its proposal was rejected
    copies = blocks.state_copies([(a, 7, 1, 0), (b, 6, 2, 0)])
    assert (copies.restore, copies.snapshot) == ([(5, 1)], [])
    assert not blocks.state_copies([(b, 8, 1, 0)])  # the restore is made once
