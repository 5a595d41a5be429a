"""KV groups: sliding-window layers keep only their window's blocks.

Block accounting is checked against arithmetic on positions; token correctness against
independent expectations: a numpy fake whose second layer reads its own (windowed) cache
through its own block tables, recomputed here without any cache, and transformers' goldens
for tiny Gemma 3 and Mistral (tests/fixtures/README.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
from engine_fakes import FakeLM, byte_tokenizer

from tests.conftest import FIXTURES
from vkrt.core.tensor import Tensor
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.config import EngineConfig
from vkrt.engine.kv_cache import NULL_BLOCK, BlockManager
from vkrt.engine.kv_groups import KVCacheManager, size_kv_pools
from vkrt.engine.request import Request
from vkrt.loader.config import LayerConfig
from vkrt.models.base import KVCache, KVGroup, StepTensors


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- one sliding manager -------------------------------------------------------------------


def test_sliding_manager_releases_blocks_that_left_the_window() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, window=6)
    r = req("a", list(range(30)))
    assert bm.allocate_slots(r, 10)
    first = bm.block_table("a")[:]
    assert len(first) == 3 and bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    # Position 10 attends to 5..10: block 0 (positions 0..3) is out of every future window.
    assert bm.free_skipped_blocks(r) == 1
    assert bm.block_table("a") == [NULL_BLOCK, *first[1:]] and bm.num_free_blocks == 6
    assert bm.free_skipped_blocks(r) == 0  # idempotent
    for n in range(11, 30):  # decode: position n - 1 computed, next query n reads n - 5 ..
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens = n
        bm.free_skipped_blocks(r)
        held = [b for b in bm.block_table("a") if b != NULL_BLOCK]
        # Blocks kept: those holding positions n - 5 .. n - 1.
        assert len(held) == (n - 1) // 4 - (n - 5) // 4 + 1
        assert bm.num_held_blocks("a") == len(held) and bm.num_free_blocks == 8 - len(held)
    # Slots of live positions still resolve through the logical table.
    table = bm.block_table("a")
    assert bm.slots("a", 26, 3).tolist() == [table[p // 4] * 4 + p % 4 for p in (26, 27, 28)]
    bm.free(r)
    assert bm.num_free_blocks == 8


def test_sliding_prefix_hit_needs_only_the_window_before_it() -> None:
    """A window of 5 needs one block before the hit; an evicted earlier block does not matter."""
    groups = [KVGroup(0, (0,)), KVGroup(5, (1,))]
    kv = KVCacheManager(groups, [16, 3], block_size=4)
    a = req("a", list(range(13)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.free_skipped_blocks(a)  # position 8 reads 4..8: block 0 leaves the sliding pool (still cached)
    assert kv.allocate_slots(a, 5)  # the sliding pool has 3 blocks: this reuses (evicts) block 0
    a.num_computed_tokens = 13
    kv.free(a)
    b = req("b", list(range(13)) + [99, 98, 97, 96])
    hit = kv.get_computed_blocks(b)
    # Position 12 reads 8..12, all in block 2, which both pools still cache: 3 blocks hit.
    assert hit.num_tokens == 12
    assert hit.blocks[1][:2] == [NULL_BLOCK, NULL_BLOCK] and hit.blocks[1][2] != NULL_BLOCK
    assert len(hit.blocks[0]) == 3 and NULL_BLOCK not in hit.blocks[0]


def test_prefix_hit_is_the_shortest_any_group_can_serve() -> None:
    """A window of 9 needs two blocks before the hit; the sliding pool lost block 2, so 8 tokens hit, not 12."""
    groups = [KVGroup(0, (0,)), KVGroup(9, (1,))]
    kv = KVCacheManager(groups, [16, 4], block_size=4)
    a = req("a", list(range(13)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 13
    kv.free(a)  # sliding free queue: the partial block 3 first, then blocks 2, 1, 0 (least recent first)
    filler = req("filler", list(range(100, 108)))
    assert kv.allocate_slots(filler, 8)  # takes block 3, then evicts block 2 in the sliding pool only
    b = req("b", list(range(13)) + [99, 98, 97, 96])
    hit = kv.get_computed_blocks(b)
    # A hit of 12 would need blocks 1 and 2 (positions 4..12); a hit of 8 needs blocks 0 and 1.
    assert hit.num_tokens == 8 and all(len(h) == 2 for h in hit.blocks)
    kv.free(filler)
    assert kv.allocate_slots(b, 4, hit)  # the hit's blocks are referenced again, one block is new
    assert [kv.block_table("b", g)[:2] for g in (0, 1)] == hit.blocks
    assert [m.num_free_blocks for m in kv.managers] == [13, 1]
    kv.free(b)
    assert [m.num_free_blocks for m in kv.managers] == [16, 4]


def test_allocation_is_all_groups_or_none() -> None:
    groups = [KVGroup(0, (0,)), KVGroup(8, (1,))]
    kv = KVCacheManager(groups, [4, 16], block_size=4)
    a = req("a", list(range(20)))
    assert not kv.allocate_slots(a, 20)  # the full pool is short: the sliding pool is untouched
    assert [m.num_free_blocks for m in kv.managers] == [4, 16]
    assert kv.block_table("a", 1) == []


# ---- pool sizing -------------------------------------------------------------------------


GEMMA3_270M = [KVGroup(0, (5, 11, 17)), KVGroup(512, tuple(i for i in range(18) if i % 6 != 5))]


def test_pool_sizes_follow_the_window_not_the_context() -> None:
    per_layer = 2 * 16 * 1 * 256 * 2  # K and V, 16 tokens, 1 KV head of 256, f16
    bytes_per_block = [3 * per_layer, 15 * per_layer]
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, block_size=16)
    full, sliding = size_kv_pools(config, GEMMA3_270M, bytes_per_block, max_model_len=8192)
    assert full == 8192 // 16
    # A step of up to 512 tokens from position p reads p - 511 .. p + 511: 1022 positions.
    assert sliding == cdiv(1022 - 1, 16) + 1 == 65
    # With an explicit budget, what the sliding layers leave goes to the full-attention ones.
    memory = 400 * 2**20  # more than 4 sequences want
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, block_size=16, kv_cache_memory=memory)
    full, sliding = size_kv_pools(config, GEMMA3_270M, bytes_per_block, max_model_len=8192)
    assert sliding == 4 * 65 and full == (memory - sliding * bytes_per_block[1]) // bytes_per_block[0]
    # A budget smaller than the want shrinks both groups by the same fraction (the full one takes the rest).
    memory = 100 * 2**20
    want = 4 * (512 * bytes_per_block[0] + 65 * bytes_per_block[1])
    config = dataclasses.replace(config, kv_cache_memory=memory)
    full, sliding = size_kv_pools(config, GEMMA3_270M, bytes_per_block, max_model_len=8192)
    assert sliding == 4 * 65 * memory // want
    assert full == (memory - sliding * bytes_per_block[1]) // bytes_per_block[0] and full >= 4 * 512 * memory // want
    # A pool too small for one sequence names its layers.
    config = EngineConfig(max_num_seqs=1, block_size=16, num_kv_blocks=64)
    with pytest.raises(Exception, match="sliding-window"):
        size_kv_pools(config, [KVGroup(512, (0,))], [per_layer], max_model_len=8192)


class KVShapeLM(FakeLM):
    """FakeLM's cache shapes set to Gemma-3-270M's: 18 layers, 1 KV head of 256, window 512 on 5 of 6."""

    def __init__(self) -> None:
        super().__init__(max_len=32768)
        layers = tuple(LayerConfig(window=0 if i % 6 == 5 else 512) for i in range(18))
        self.config = dataclasses.replace(self.config, num_layers=18, num_kv_heads=1, head_dim=256, layers=layers)


def test_gemma3_like_cache_at_8k_context_is_allocated_by_window() -> None:
    llm = LLM(model=KVShapeLM(), tokenizer=byte_tokenizer(), device="reference", max_model_len=8192,
              max_num_seqs=1, max_num_batched_tokens=512, block_size=16, kv_dtype="f16")
    kv = llm.engine.runner.kv
    per_token_layer = 2 * 256 * 2  # K and V of one 256-wide head, f16
    full_bytes = 3 * per_token_layer * 8192
    sliding_bytes = 15 * per_token_layer * 65 * 16
    assert kv.nbytes == full_bytes + sliding_bytes
    assert kv.nbytes * 3 < 18 * per_token_layer * 8192  # every layer at full context: > 3x more
    assert [t.shape[0] for t in kv.keys.values()] == [65 if i % 6 != 5 else 512 for i in range(18)]


# ---- through the engine: a fake with a full and a sliding layer -------------------------


class WindowedFakeLM(FakeLM):
    """Layer 0 attends to the whole context, layer 1 to the last `window` positions, each
    through its own KV group's cache, slots and block tables."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.config = dataclasses.replace(self.config, num_layers=2, layers=(LayerConfig(0), LayerConfig(window)))

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        read = self.backend.read
        ids, pos, seq, rows = (read(t) for t in (step.token_ids, step.positions, step.seq_index, step.logits_index))
        keys = self._keys(ids, pos)
        bs = kv.block_size
        contexts = []
        for layer, window in enumerate((0, self.window)):
            group = kv.group_of(layer)
            slots, tables = read(step.slots_of(group)), read(step.block_tables_of(group))
            cache = read(kv.keys[layer]).reshape(-1, self.config.head_dim)
            live = slots >= 0
            cache[slots[live]] = keys[live]
            self.backend.write(kv.keys[layer], cache.reshape(kv.keys[layer].shape))
            rows_ctx = []
            for t in rows:
                n = np.arange(max(0, pos[t] + 1 - window) if window else 0, pos[t] + 1)
                rows_ctx.append(cache[tables[seq[t]][n // bs] * bs + n % bs])
            contexts.append(rows_ctx)
        logits = np.stack([self._windowed_logits(keys[t], contexts[0][r], contexts[1][r])
                           for r, t in enumerate(rows)]).astype(np.float32)
        return self.backend.upload(logits, "f32")

    def _windowed_logits(self, key: np.ndarray, full: np.ndarray, local: np.ndarray) -> np.ndarray:
        hidden = key.astype(np.float64) + full.astype(np.float64).mean(axis=0) + local.astype(np.float64).mean(axis=0)
        return np.tanh(hidden) @ self.unembed

    def reference_greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_tokens):
            keys = self._keys(np.asarray(ids), np.arange(len(ids)))
            n = len(ids)
            logits = self._windowed_logits(keys[-1], keys, keys[max(0, n - self.window):])
            ids.append(int(np.argmax(logits.astype(np.float32))))
        return ids[len(prompt):]


WINDOW, BLOCK, CHUNK = 8, 4, 8
SLIDING_BOUND = cdiv(WINDOW + CHUNK - 2, BLOCK) + 1  # blocks a sequence may hold in a step (5)


def windowed_llm(**kwargs: Any) -> LLM:
    config: dict[str, Any] = {"device": "reference", "max_model_len": 128, "block_size": BLOCK,
                              "max_num_batched_tokens": CHUNK, "kv_dtype": "f32", **kwargs}
    return LLM(model=WindowedFakeLM(WINDOW), tokenizer=byte_tokenizer(), **config)


def track_sliding_peak(llm: LLM, group: int = 1) -> dict[str, int]:
    """Most blocks each request held in `group` right after a step was scheduled (its peak)."""
    engine = llm.engine
    manager = engine.block_manager
    peak: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def tracked() -> Any:
        out = schedule()
        for s in out.scheduled:
            rid = s.request.request_id
            peak[rid] = max(peak.get(rid, 0), manager.managers[group].num_held_blocks(rid))
        return out

    engine.scheduler.schedule = tracked  # type: ignore[method-assign]
    return peak


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(5, 40))).tolist() for _ in range(n)]


def generate(llm: LLM, batch: list[list[int]], params: SamplingParams, max_steps: int = 1000) -> list[list[int]]:
    """Greedy ids per prompt, stepping the engine at most `max_steps` times (a leak fails, not hangs)."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(rid, prompt, dataclasses.replace(params))
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        if len(done) == len(ids):
            return [done[rid] for rid in ids]
    raise AssertionError(f"{len(ids) - len(done)} requests unfinished after {max_steps} steps")


def test_sliding_group_is_sized_by_its_window_and_decodes_exactly() -> None:
    llm = windowed_llm(max_num_seqs=3, num_kv_blocks=3 * cdiv(128, BLOCK))
    manager = llm.engine.block_manager
    assert [m.num_blocks for m in manager.managers] == [3 * 32, 3 * SLIDING_BOUND]
    peak = track_sliding_peak(llm)
    batch = prompts(5, seed=1)
    outputs = generate(llm, batch, greedy(30))  # 30 new tokens: several windows past every prompt
    model = llm.engine.model
    assert isinstance(model, WindowedFakeLM)
    assert outputs == [model.reference_greedy(prompt, 30) for prompt in batch]
    assert peak and max(peak.values()) <= SLIDING_BOUND
    assert llm.engine.num_preemptions == 0  # the window pool never ran short
    assert [m.num_free_blocks for m in manager.managers] == [m.num_blocks for m in manager.managers]


def test_preemption_and_abort_return_every_groups_blocks() -> None:
    llm = windowed_llm(max_num_seqs=4, num_kv_blocks=40)  # 40 full blocks: 4 long requests do not fit
    engine = llm.engine
    manager = engine.block_manager
    before = [m.num_free_blocks for m in manager.managers]
    batch = prompts(4, seed=2)
    outputs = generate(llm, batch, greedy(60))
    assert engine.num_preemptions > 0
    model = engine.model
    assert isinstance(model, WindowedFakeLM)
    assert outputs == [model.reference_greedy(prompt, 60) for prompt in batch]
    assert [m.num_free_blocks for m in manager.managers] == before
    # Abort mid-flight, with blocks held (and some released by the window) in both groups.
    for i, prompt in enumerate(prompts(3, seed=3)):
        engine.add_request(f"x{i}", prompt, greedy(50))
    for _ in range(20):
        engine.step()
    assert all(m.num_free_blocks < n for m, n in zip(manager.managers, before, strict=True))
    for i in range(3):
        engine.abort(f"x{i}")
    assert [m.num_free_blocks for m in manager.managers] == before
    assert all(m.ref_count(b) == 0 for m in manager.managers for b in range(m.num_blocks))


def test_prefix_caching_on_a_sliding_model_changes_no_token() -> None:
    shared = list(range(40, 70))  # 30 shared tokens: past the window of 8
    batch = [shared + [1, 2, 3], shared + [9, 8], shared + [5, 6, 7, 8, 9], shared]
    runs = []
    for caching in (True, False):
        llm = windowed_llm(max_num_seqs=2, num_kv_blocks=64, enable_prefix_caching=caching)
        runs.append(generate(llm, batch, greedy(20)))
        manager = llm.engine.block_manager
        assert (manager.prefix_hits > 0) == caching
        assert [m.num_free_blocks for m in manager.managers] == [m.num_blocks for m in manager.managers]
    model = WindowedFakeLM(WINDOW)
    assert runs[0] == runs[1] == [model.reference_greedy(p, 20) for p in batch]


# ---- through the engine: transformers' goldens ----------------------------------------------


def _golden(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "golden.json").read_text())


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_mistral"])
def test_sliding_models_match_transformers_with_a_window_sized_pool(name: str) -> None:
    """Window 8, blocks of 4, chunks of 8: prompts of up to 40 tokens and 16 new ones cross
    the window several times, in prefill chunks and in decode, with the sliding pool at its bound."""
    cases = _golden(name)["cases"]
    llm = LLM(FIXTURES / name, device="reference", kv_dtype="f32", max_model_len=64, block_size=BLOCK,
              max_num_batched_tokens=CHUNK, max_num_seqs=2, enable_prefix_caching=False)
    manager = llm.engine.block_manager
    sliding = [g for g, group in enumerate(manager.groups) if group.window]
    assert len(sliding) == 1 and manager.groups[sliding[0]].window == WINDOW
    assert manager.managers[sliding[0]].num_blocks == 2 * SLIDING_BOUND
    peak = track_sliding_peak(llm, sliding[0])
    outputs = generate(llm, [c["input_ids"] for c in cases], greedy(16))
    assert outputs == [c["greedy_ids"] for c in cases]
    assert max(peak.values()) <= SLIDING_BOUND and llm.engine.num_preemptions == 0
    assert manager.num_free_blocks == manager.num_blocks


def test_sliding_groups_replay_in_one_submit(vk_default: Any) -> None:
    """Per-group slots and tables are replay inputs: decode stays 1 submit, 0 drains, same ids."""
    cases = _golden("tiny_gemma3")["cases"][1:]
    llm = LLM(FIXTURES / "tiny_gemma3", device="vulkan", max_model_len=64, block_size=BLOCK, max_num_seqs=4,
              max_num_batched_tokens=CHUNK, enable_replay=True)
    assert llm.engine.block_manager.num_groups == 2
    outputs = llm.generate([c["input_ids"] for c in cases], greedy(16))
    assert [o.token_ids for o in outputs] == [c["greedy_ids"] for c in cases]
    stats = llm.stats()
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= 10 and stats["last_step"]["replayed"]
    assert worst["drains"] == 0 and worst["submits"] == 1 and worst["fence_waits"] == 1


def test_prefix_caching_on_tiny_gemma3_matches_transformers() -> None:
    """Hits taken after the sliding group released the prefix's early blocks give the same ids."""
    case = _golden("tiny_gemma3")["cases"][-1]  # 40 prompt tokens: five windows of 8
    prompt = case["input_ids"]
    batch = [prompt, prompt, prompt[:30] + [1, 2, 3], prompt[:21]]
    runs = []
    for caching in (True, False):
        # A pool of 4 sequences at the bound (20 sliding blocks): one request's 14 blocks leave
        # the next one's window cached. One request at a time, so each hit comes from freed blocks.
        llm = LLM(FIXTURES / "tiny_gemma3", device="reference", kv_dtype="f32", max_model_len=64, block_size=BLOCK,
                  max_num_batched_tokens=CHUNK, max_num_seqs=4, enable_prefix_caching=caching)
        runs.append([generate(llm, [p], greedy(16))[0] for p in batch])
        manager = llm.engine.block_manager
        # Whole shared blocks before each prompt's last token: 9 of the repeated prompt, 7 of
        # the 30 shared tokens (the 8th holds new ones), 5 of the 21-token prefix.
        assert manager.prefix_hits == (36 + 28 + 20 if caching else 0)
        assert manager.num_free_blocks == manager.num_blocks
    assert runs[0] == runs[1] and runs[0][0] == runs[0][1] == case["greedy_ids"]
