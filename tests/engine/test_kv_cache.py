"""BlockManager: allocation, ref counts, prefix caching, eviction order, full release."""

from __future__ import annotations

from vkrt.engine.config import SamplingParams
from vkrt.engine.kv_cache import BlockManager
from vkrt.engine.request import Request


def req(rid: str, tokens: list[int], **params: object) -> Request:
    return Request(rid, tokens, SamplingParams(**params))  # type: ignore[arg-type]


def admit(bm: BlockManager, r: Request, num_new: int | None = None) -> int:
    """Admit like the scheduler does; returns the number of prefix-cache hit tokens."""
    hits = bm.get_computed_blocks(r)
    num_cached = len(hits) * bm.block_size
    assert bm.allocate_slots(r, (num_new or r.num_tokens) - num_cached, hits)
    r.num_computed_tokens = num_cached + (num_new or r.num_tokens) - num_cached
    return num_cached


def test_allocate_free_and_slots() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert bm.allocate_slots(r, 10)
    table = bm.block_table("a")
    assert len(table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_count(b) == 1 for b in table)
    slots = bm.slots("a", 0, 10)
    expected = [table[p // 4] * 4 + p % 4 for p in range(10)]
    assert slots.tolist() == expected
    r.num_computed_tokens = 10
    # Two more tokens fit in the third block; a third needs a fourth block.
    assert bm.allocate_slots(r, 2) and len(bm.block_table("a")) == 3
    r.num_computed_tokens = 12
    assert bm.allocate_slots(r, 1) and len(bm.block_table("a")) == 4
    assert abs(bm.usage - 4 / 8) < 1e-12
    bm.free(r)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocation_fails_cleanly_when_pool_is_short() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req("a", list(range(8)))
    assert bm.allocate_slots(a, 8)
    b = req("b", list(range(100, 108)))
    assert not bm.allocate_slots(b, 8)
    assert bm.num_free_blocks == 1 and bm.block_table("b") == []


def test_prefix_cache_shares_full_blocks_and_refcounts() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    shared = list(range(50, 59))  # 2 full blocks + 1 token
    a = req("a", shared + [1, 2, 3])
    b = req("b", shared + [7, 8, 9, 10])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8  # the two full shared blocks
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [bm.ref_count(x) for x in ta[:2]] == [2, 2]
    assert bm.prefix_hits == 8 and bm.prefix_queries == a.num_tokens + b.num_tokens
    # A different first block means no hit at all (hashes are chained).
    c = req("c", [0] + shared[1:] + [1, 2, 3])
    assert admit(bm, c) == 0
    for r in (a, b, c):
        bm.free(r)
    assert bm.num_free_blocks == 16


def test_whole_prompt_hit_still_computes_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    admit(bm, a)
    bm.free(a)
    again = req("again", list(range(8)))
    # 8 tokens = 2 full blocks, but the last token must run to produce logits: only 1 hit.
    assert admit(bm, again) == 4


def test_freed_cached_blocks_are_reused_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)  # blocks keep their hashes while free
    assert bm.num_free_blocks == 4
    b = req("b", list(range(9)))
    assert admit(bm, b) == 8
    bm.free(b)
    # A request that needs the whole pool evicts the cached blocks...
    c = req("c", list(range(100, 116)))
    assert admit(bm, c) == 0 and bm.num_free_blocks == 0
    bm.free(c)
    # ...so the old prefix no longer hits.
    d = req("d", list(range(9)))
    assert admit(bm, d) == 0
    bm.free(d)
    assert bm.num_free_blocks == 4


def test_eviction_prefers_uncached_then_least_recently_freed() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    old = req("old", [1, 2, 3, 4, 5])  # 2 full blocks + a partial (uncached) one
    admit(bm, old)
    bm.free(old)
    new = req("new", [7, 8, 9, 10, 11])
    admit(bm, new)
    bm.free(new)
    # Taking 2 blocks reuses the 2 partial (never cached) blocks first: both prefixes survive.
    filler = req("filler", [20, 21, 22])
    assert bm.allocate_slots(filler, 3)
    assert admit(bm, req("old2", [1, 2, 3, 4, 5])) == 4
    # That admission needed one more block: it evicted the least recently freed cached block
    # that was not a hit, which is the tail of "new" ([9, 10]); its head ([7, 8]) survives.
    assert len(bm.get_computed_blocks(req("new2", [7, 8, 9, 10, 11]))) == 1


def test_prompt_logprobs_requests_skip_the_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, req("a", list(range(9))))
    assert admit(bm, req("b", list(range(9)), prompt_logprobs=1)) == 0


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    admit(bm, a)
    assert admit(bm, req("b", list(range(9)))) == 0
