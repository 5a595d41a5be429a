"""KV groups: one block pool per attention type, so sliding-window layers hold only their window.

Layers with the same attention window form a group (models.base.kv_groups): its layers'
caches have the group's block count, and each request has one block table per group. A
full-attention group keeps every block; a sliding group with window W releases blocks as
they leave the window (kv_cache.BlockManager.free_skipped_blocks), so its memory is bounded
by the window plus the largest chunk, not by the context (vLLM v1's KVCacheSpec /
SlidingWindowSpec with a coordinator over one manager per group).

`KVCacheManager` is what the scheduler sees: an allocation succeeds in every group or in
none; a prefix hit is the longest length every group can serve (the minimum over groups). A
hybrid model's recurrent layers add a group of their own, the state slots (`StatePool`): a
request takes its slot with its first blocks and frees it with them. With prefix caching, a
hybrid's hits are also cut to the longest prefix whose recurrent state was kept
(`state_snapshots`), and the manager says which state copies each step makes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vkrt.engine.config import DEFAULT_KV_BUDGET, EngineConfig
from vkrt.engine.kv_cache import BlockManager
from vkrt.engine.request import Request
from vkrt.engine.state_pool import StatePool
from vkrt.engine.state_snapshots import SnapshotPool, StateCopies
from vkrt.errors import VkrtError
from vkrt.models.base import KVGroup


@dataclass
class CacheHit:
    """A prefix-cache hit: per group, the blocks of logical blocks 0..n-1 (NULL_BLOCK where a window needs none)."""

    blocks: list[list[int]] = field(default_factory=list)
    num_tokens: int = 0
    state_snapshot: int | None = None  # hybrids: the snapshot slot holding the state after the hit


def blocks_per_sequence(window: int, block_size: int, max_model_len: int, max_chunk: int) -> int:
    """Most blocks one sequence holds at once in a group (the pool must have at least this many).

    Full attention: its whole context. Window W: a step computing C <= max_chunk tokens from
    position p needs positions p - W + 1 .. p + C - 1, W - 1 + C of them, which touch at most
    ceil((W + C - 2) / block_size) + 1 blocks (a block boundary may fall inside the first).
    """
    context = math.ceil(max_model_len / block_size)
    if not window:
        return context
    return min(context, -(-(window + min(max_chunk, max_model_len) - 2) // block_size) + 1)


def size_kv_pools(config: EngineConfig, groups: Sequence[KVGroup], bytes_per_block: Sequence[int],
                  max_model_len: int) -> list[int]:
    """Blocks of each group's pool.

    A model of one full-attention group is sized by EngineConfig.resolve_num_blocks, as
    before groups existed. Otherwise each group wants max_num_seqs * blocks_per_sequence:
    `num_kv_blocks` N gives full groups N and sliding ones min(N, their want); a memory
    budget M (kv_cache_memory, or the want capped at DEFAULT_KV_BUDGET) gives each group the
    fraction M / sum(want * bytes per block) of its want, except that a full-attention group
    takes all the memory the sliding groups leave (they never use more than their want).
    """
    if len(groups) == 1 and not groups[0].window:
        return [config.resolve_num_blocks(bytes_per_block[0], max_model_len)]
    per_seq = [blocks_per_sequence(g.window, config.block_size, max_model_len, config.max_num_batched_tokens)
               for g in groups]
    wanted = [config.max_num_seqs * n for n in per_seq]
    full = [g for g, group in enumerate(groups) if not group.window]  # at most one: window 0
    if config.num_kv_blocks is not None:
        counts = [config.num_kv_blocks if g in full else min(config.num_kv_blocks, w) for g, w in enumerate(wanted)]
    else:
        want_bytes = sum(w * b for w, b in zip(wanted, bytes_per_block, strict=True))
        memory = config.kv_cache_memory
        if memory is None:
            memory = min(want_bytes, DEFAULT_KV_BUDGET)
        counts = [w * memory // want_bytes for w in wanted]
        if full:
            counts = [min(n, w) for n, w in zip(counts, wanted, strict=True)]
            sliding = sum(n * b for g, (n, b) in enumerate(zip(counts, bytes_per_block, strict=True)) if g not in full)
            counts[full[0]] = (memory - sliding) // bytes_per_block[full[0]]
    for group, n, need, nbytes in zip(groups, counts, per_seq, bytes_per_block, strict=True):
        if n < need:
            kind = f"sliding-window ({group.window}) layers" if group.window else "full-attention layers"
            raise VkrtError(
                f"the KV cache of the {kind} holds {n} blocks of {config.block_size} tokens but one "
                f"sequence of max_model_len={max_model_len} needs {need} at once; raise kv_cache_memory "
                f"(this group alone needs >= {need * nbytes} bytes) or num_kv_blocks, or lower max_model_len")
    return counts


class KVCacheManager:
    """One BlockManager per KV group, driven together; the scheduler's view of the KV pools."""

    def __init__(self, groups: Sequence[KVGroup], num_blocks: Sequence[int], block_size: int,
                 enable_prefix_caching: bool = True, num_state_slots: int = 0, num_snapshot_slots: int = 0,
                 state_checkpoints: bool = False) -> None:
        """`num_snapshot_slots` (a hybrid with prefix caching: > 0) follow the state slots in the
        state tensors; a hybrid without them must not cache prefixes (its hits would lack state).
        `state_checkpoints` (a hybrid that speculates): after those, one more slot per state slot,
        where a verify step keeps the state it started from (`roll_back_state`)."""
        if num_state_slots and enable_prefix_caching and not num_snapshot_slots:
            raise VkrtError("prefix caching for a model with recurrent layers needs state snapshot slots")
        self.groups = list(groups)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = [BlockManager(n, block_size, enable_prefix_caching, window=g.window)
                         for g, n in zip(self.groups, num_blocks, strict=True)]
        self.states = StatePool(num_state_slots) if num_state_slots else None
        self.snapshots: SnapshotPool | None = None
        self._restores: dict[str, int] = {}  # request id -> snapshot or checkpoint slot its next step starts from
        # slot s's checkpoint is slot checkpoint_base + s (None: no checkpoints)
        self.checkpoint_base = num_state_slots + num_snapshot_slots if num_state_slots and state_checkpoints else None
        if num_state_slots and enable_prefix_caching:
            self.snapshots = SnapshotPool(num_state_slots, num_snapshot_slots)
            # A snapshot is named by the hash of the block ending its prefix, in the first group.
            self.managers[0].on_evict = self.snapshots.drop

    # ---- queries (sums over groups) ------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        """Fraction of all groups' blocks held by live requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_queries(self) -> int:
        return self.managers[0].prefix_queries  # every group sees the same admissions and hits

    @property
    def prefix_hits(self) -> int:
        return self.managers[0].prefix_hits

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.managers[group].block_table(request_id)

    def slots(self, request_id: str, start: int, count: int, group: int = 0) -> np.ndarray:
        return self.managers[group].slots(request_id, start, count)

    def state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (0 for a model without recurrent layers)."""
        return self.states.slot(request_id) if self.states is not None else 0

    @property
    def chunk_alignment(self) -> int:
        """Tokens prefill chunks should end on a multiple of (0: any): a hybrid's state is kept
        only where a chunk ends, so with snapshots chunks end on block boundaries."""
        return self.block_size if self.snapshots is not None else 0

    # ---- prefix cache, allocation, release -------------------------------------------------

    def get_computed_blocks(self, request: Request) -> CacheHit:
        """The longest prefix every group holds: shrink the candidate length until all agree."""
        n = self.managers[0].max_cache_hit_blocks(request)
        while True:
            n, snapshot = self._snapshot_before(request, n)
            if n == 0:
                return CacheHit([[] for _ in self.managers])
            hits = [m.find_cache_hit(request, n) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if shortest == n:
                return CacheHit(hits, n * self.block_size, snapshot)
            n = shortest  # each group's hit at a shorter length is recomputed: a window moves with it

    def _snapshot_before(self, request: Request, n: int) -> tuple[int, int | None]:
        """The longest hit of at most `n` blocks whose recurrent state was kept, with its snapshot
        slot (a model without recurrent layers: n itself, and no snapshot)."""
        if self.snapshots is None or n == 0:
            return n, None
        hashes = self.managers[0].block_hashes(request, n)
        for length in range(n, 0, -1):
            slot = self.snapshots.lookup(hashes[length - 1])
            if slot is not None:
                return length, slot
        return 0, None

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: CacheHit | None = None) -> bool:
        """Room for `num_new_tokens` after the computed ones in every group, or False and no change."""
        computed = hit.blocks if hit is not None else [[] for _ in self.managers]
        for m in self.managers:
            m.free_skipped_blocks(request)
        if any(m.blocks_to_allocate(request, num_new_tokens, c) > m.num_free_blocks
               for m, c in zip(self.managers, computed, strict=True)):
            return False
        if self.states is not None and not self.states.take(request.request_id):
            return False
        for m, c in zip(self.managers, computed, strict=True):
            allocated = m.allocate_slots(request, num_new_tokens, c)
            assert allocated, "every group was checked above"
        if hit is not None and hit.state_snapshot is not None:
            self._restores[request.request_id] = hit.state_snapshot
            assert self.snapshots is not None
            self.snapshots.touch(request.block_hashes[hit.num_tokens // self.block_size - 1])
        return True

    def state_copies(self, chunks: Iterable[tuple[Request, int, int, int]]) -> StateCopies:
        """The state copies of a step running `chunks` (request, first position, tokens, of them
        proposed): each request admitted on a hit starts from its snapshot, or after a rejected
        proposal from its checkpoint; a verify step keeps the state it starts from in the
        request's checkpoint; and each prefill chunk that ends a cached block, with no snapshot
        yet, leaves one (`commit_state_snapshots` after the step). Decode tokens take none, so
        pure decode steps stay free of copies (and replayable)."""
        copies = StateCopies()
        if self.states is None:
            return copies
        first = self.managers[0]
        for request, start, num_tokens, num_proposed in chunks:
            slot = self.state_slot(request.request_id)
            restore = self._restores.pop(request.request_id, None)
            if restore is not None:
                copies.restore.append((restore, slot))
            if num_proposed:
                assert self.checkpoint_base is not None, "speculation on a hybrid needs state checkpoints"
                copies.restore.append((slot, self.checkpoint_base + slot))
                continue  # its end state follows proposals, which may be rejected: never a snapshot
            if self.snapshots is None:
                continue
            end = start + num_tokens
            if end % self.block_size or (num_tokens == 1 and start >= request.num_prompt_tokens):
                continue
            hashes = request.block_hashes  # this step's full blocks were hashed as they were allocated
            block_hash = hashes[end // self.block_size - 1] if len(hashes) >= end // self.block_size else None
            if block_hash is None or not first.is_cached(block_hash):
                continue
            snapshot = self.snapshots.take(block_hash)
            if snapshot is not None:
                copies.snapshot.append((slot, snapshot))
        return copies

    def roll_back_state(self, request: Request) -> None:
        """A verify step's proposal was rejected: the request's next step starts from the state
        its checkpoint kept (before that verify step) and recomputes the tokens since."""
        assert self.checkpoint_base is not None
        slot = self.state_slot(request.request_id)
        self._restores[request.request_id] = self.checkpoint_base + slot

    def commit_state_snapshots(self) -> None:
        """The step ran: the snapshots it took may serve hits from now on."""
        if self.snapshots is not None:
            self.snapshots.commit()

    def free_skipped_blocks(self, request: Request) -> int:
        """After a step: sliding groups release the blocks that left the request's window."""
        return sum(m.free_skipped_blocks(request) for m in self.managers)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Every group releases the request's blocks past its first `num_tokens` positions."""
        return sum(m.trim(request, num_tokens) for m in self.managers)

    def forget_uncomputed(self, request: Request) -> None:
        """After a failed step: no prefix-cache hit may reach the blocks it did not fill."""
        for m in self.managers:
            m.forget_uncomputed(request)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)
        if self.states is not None:
            self.states.release(request.request_id)
        self._restores.pop(request.request_id, None)
