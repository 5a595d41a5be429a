"""Prefix-cache keys: a block is shared only when every one of its tokens (and its whole
prefix) matches. Each case differs from a cached prompt in exactly one token and must not
reuse the block holding it, nor any block after it."""

from __future__ import annotations

import pytest

from vkrt.engine.config import SamplingParams
from vkrt.engine.kv_cache import BlockManager, hash_block
from vkrt.engine.request import Request

BLOCK = 4


def admit(bm: BlockManager, rid: str, tokens: list[int]) -> tuple[Request, int]:
    """Admit like the scheduler; returns the request and its prefix-cache hit tokens."""
    request = Request(rid, tokens, SamplingParams())
    hits = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, len(tokens) - len(hits) * BLOCK, hits)
    request.num_computed_tokens = len(tokens)
    bm.allocate_slots(request, 0)  # the scheduler's next call caches the now-full blocks
    return request, len(hits) * BLOCK


@pytest.mark.parametrize("position", range(3 * BLOCK))
def test_one_different_token_is_never_shared(position: int) -> None:
    """Prompts of 3 full blocks + 1 token that differ only at `position`: the blocks before
    the one holding it are shared, that block and the rest are not."""
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    base = list(range(100, 100 + 3 * BLOCK + 1))
    first, hits = admit(bm, "a", base)
    assert hits == 0
    other = list(base)
    other[position] += 1
    second, hits = admit(bm, "b", other)
    shared = position // BLOCK
    assert hits == shared * BLOCK, f"token {position} differs: {hits} tokens reused"
    table_a, table_b = bm.block_table("a"), bm.block_table("b")
    assert table_b[:shared] == table_a[:shared]
    assert not set(table_b[shared:]) & set(table_a), "a block holding a different token was shared"


def test_the_last_token_of_a_full_block_counts() -> None:
    """The case a hash over all but the block's last token would get wrong."""
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    admit(bm, "a", [1, 2, 3, 4, 9])
    _, hits = admit(bm, "b", [1, 2, 3, 5, 9])
    assert hits == 0
    _, hits = admit(bm, "c", [1, 2, 3, 4, 7])
    assert hits == BLOCK  # the same full block is shared


def test_block_hash_covers_every_token_and_the_parent() -> None:
    tokens = [5, 6, 7, 8]
    h = hash_block(None, tokens)
    for i in range(len(tokens)):
        changed = list(tokens)
        changed[i] += 1
        assert hash_block(None, changed) != h, f"token {i} is not in the hash"
    assert hash_block(h, tokens) != h and hash_block(hash_block(None, [1, 2, 3, 4]), tokens) != hash_block(h, tokens)


def test_sliding_window_hit_needs_the_whole_prefix_to_match() -> None:
    """A sliding-window layer's hit reads only its last blocks, so those blocks' hashes must
    carry everything before them: two prompts that share their later blocks but differ in the
    first one share nothing (a hash not chained to its parent would reuse the later blocks)."""
    bm = BlockManager(num_blocks=32, block_size=BLOCK, window=BLOCK + 1)  # the hit needs 1 block
    tail = list(range(200, 200 + 3 * BLOCK)) + [7]
    _, hits = admit(bm, "a", [1, 2, 3, 4, *tail])
    assert hits == 0
    _, hits = admit(bm, "b", [9, 9, 9, 9, *tail])
    assert hits == 0, f"{hits} tokens of a prompt with another first block were reused"
    _, hits = admit(bm, "c", [1, 2, 3, 4, *tail])
    assert hits == 4 * BLOCK  # the same prompt again: its window's block is a hit (sanity)
