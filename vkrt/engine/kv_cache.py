"""The KV-cache block manager of one KV group: a fixed pool of blocks, ref-counted, with prefix caching.

A block holds `block_size` consecutive tokens of one sequence. A *full* block is named by a
hash chained over its parent's hash and its own token ids, so two requests whose prompts
share a prefix share the physical blocks of that prefix. Freed blocks keep their hash and
stay reusable until the allocator evicts them, least recently freed first (vLLM v1's scheme).

A manager with a sliding `window` W serves layers that attend to positions p - W < j <= p
only: blocks wholly before the window of the next position to compute go back to the pool,
and their entries in the request's table become NULL_BLOCK (vLLM's SlidingWindowManager).
kv_groups.KVCacheManager runs one manager per group.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from vkrt.engine.kv_events import KVEvents
from vkrt.engine.request import Request

BlockHash = bytes
NULL_BLOCK = -1  # a table entry whose block left a sliding window (never read by attention)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Content hash of one full block, chained so equal blocks at different prefixes differ:
    sha256(parent digest || token ids as int64 little-endian). No seed, so every process gives
    the same tokens the same key; KV events publish its low 64 bits (docs/USAGE.md, KV events)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())  # little-endian on any host
    return digest.digest()


class BlockManager:
    """Owns which request holds which blocks; the tensors themselves live in the model's KVCache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # 0: full attention, every block is kept
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # Blocks with ref count 0, front = next to be reused (evicted, if it holds a cached hash).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._req_num_hashed: dict[str, int] = {}  # leading blocks of a request already in the cache map
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache
        self.on_evict: Callable[[BlockHash], None] | None = None  # told each hash that leaves the cache
        self.events: KVEvents | None = None  # set when KV events are published: told each store and eviction

    # ---- queries --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """Block of each logical block of the request; NULL_BLOCK where a window dropped it."""
        return self._req_blocks.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references (its table minus NULL_BLOCK entries)."""
        return sum(1 for b in self._req_blocks.get(request_id, []) if b != NULL_BLOCK)

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def slots(self, request_id: str, start: int, count: int) -> np.ndarray:
        """Cache slots (block * block_size + offset) of positions start..start+count-1."""
        blocks = np.asarray(self._req_blocks[request_id], dtype=np.int64)
        positions = np.arange(start, start + count)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    # ---- prefix cache ---------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first `num_blocks` full blocks (memoised on it)."""
        hashes: list[BlockHash] = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, request.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def max_cache_hit_blocks(self, request: Request) -> int:
        """How many leading blocks a prefix hit may cover (0 when the request must compute all)."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None or request.pooling:
            # prompt logprobs need logits at every prompt position, and mean pooling hidden states, so compute them all
            return 0
        # At least the last token must be computed: its logits give the next token.
        return (request.num_tokens - 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks (not yet referenced)."""
        return self.find_cache_hit(request, self.max_cache_hit_blocks(request))

    def find_cache_hit(self, request: Request, max_blocks: int) -> list[int]:
        """The longest usable hit of at most `max_blocks` logical blocks.

        Full attention: the leading cached blocks. A sliding window needs only the blocks
        that hold the window of the first position after the hit, so the hit is the longest
        length whose last ceil((W - 1) / block_size) blocks are cached (all of them when the
        hit is shorter); entries before those are NULL_BLOCK.
        """
        hashes = self.block_hashes(request, max_blocks)
        if not self.window:
            blocks: list[int] = []
            for block_hash in hashes:
                block_id = self._cached.get(block_hash)
                if block_id is None:
                    break
                blocks.append(block_id)
            return blocks
        needed = -(-(self.window - 1) // self.block_size)
        if needed == 0:  # a window of 1 reads nothing before the new token
            return [NULL_BLOCK] * max_blocks
        run = 0  # cached blocks in a row ending at block i
        found = [NULL_BLOCK] * max_blocks
        for i in range(max_blocks - 1, -1, -1):  # right to left: the longest hit first
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                run = 0
                continue
            found[i] = block_id
            run += 1
            if run >= needed:
                return found[:i + run]
        return found[:run]  # a run from block 0 is a hit even when shorter than the window

    # ---- allocation -----------------------------------------------------------------------

    def blocks_to_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Free blocks allocate_slots would take: new blocks, plus hits revived from the free queue."""
        held = len(self._req_blocks.get(request.request_id, []))
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = max(math.ceil(total / self.block_size) - held - len(computed_blocks), 0)
        # Hits with ref count 0 sit in the free queue: taking them shrinks what is left to allocate.
        return need + sum(1 for b in computed_blocks if b != NULL_BLOCK and self._ref_counts[b] == 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones; False if the pool is short.

        `computed_blocks` (from get_computed_blocks) are prefix-cache hits to attach first.
        """
        self.free_skipped_blocks(request)
        if self.blocks_to_allocate(request, num_new_tokens, computed_blocks) > len(self._free):
            return False
        blocks = self._req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = max(math.ceil(total / self.block_size) - len(blocks) - len(computed_blocks), 0)
        if not blocks and request.num_computed_tokens == 0:  # first admission (or after preemption)
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            if block_id == NULL_BLOCK:
                continue
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        blocks.extend(computed_blocks)
        for _ in range(need):
            blocks.append(self._pop_free())
        if computed_blocks:
            self._req_num_hashed[request.request_id] = len(blocks) - need
        if self.enable_prefix_caching:
            # Blocks this step fills are published now: the step writes their K/V before any
            # later step (or a later token of this step, in the same layer) can read them.
            # Only known tokens name a block: proposed ones (speculative decoding) may be rejected.
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens) // self.block_size)
        return True

    def trim(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past the first `num_tokens` positions (speculative
        decoding's rollback: blocks taken for proposals that were rejected). No released block
        is in the prefix cache: only known tokens' blocks are. Returns how many were released."""
        blocks = self._req_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        released = blocks[keep:]
        del blocks[keep:]
        self._req_num_hashed[request.request_id] = min(self._req_num_hashed.get(request.request_id, 0), keep)
        self._release(reversed(released))
        return len(released)

    def forget_uncomputed(self, request: Request) -> None:
        """Take the request's blocks past its computed tokens out of the prefix cache: they were
        published when allocated, and the step that was to fill them failed."""
        blocks = self._req_blocks.get(request.request_id, [])
        for block_id in blocks[request.num_computed_tokens // self.block_size:]:
            if block_id != NULL_BLOCK:
                self._unpublish(block_id)

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        self._unpublish(block_id)  # evict: the block is about to hold other tokens
        self._ref_counts[block_id] = 1
        return block_id

    def _unpublish(self, block_id: int) -> None:
        old_hash = self._block_hash[block_id]
        if old_hash is None:
            return
        if self._cached.get(old_hash) == block_id:
            del self._cached[old_hash]
            if self.on_evict is not None:
                self.on_evict(old_hash)
            if self.events is not None:
                self.events.removed(old_hash)
        self._block_hash[block_id] = None

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_full: int) -> None:
        start = self._req_num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        stored: list[int] = []  # logical blocks this call put in the cache
        for i in range(start, num_full):
            block_id = blocks[i]
            if block_id != NULL_BLOCK and self._block_hash[block_id] is None and hashes[i] not in self._cached:
                self._cached[hashes[i]] = block_id
                self._block_hash[block_id] = hashes[i]
                stored.append(i)
        self._req_num_hashed[request.request_id] = num_full
        if self.events is not None and stored:
            self._report_stored(request, hashes, stored)

    def _report_stored(self, request: Request, hashes: list[BlockHash], stored: list[int]) -> None:
        """One BlockStored per run of consecutive stored blocks, its parent the block before the run."""
        assert self.events is not None
        bs = self.block_size
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            self.events.stored(hashes[first:last + 1], hashes[first - 1] if first else None,
                               request.all_token_ids[first * bs:(last + 1) * bs])
            run_start = k

    def free_skipped_blocks(self, request: Request) -> int:
        """Sliding window: release the blocks no future token of the request attends to.

        The next position to compute is num_computed_tokens; it and every later one read
        positions >= num_computed_tokens - W + 1 only, so the blocks before that one's block
        go back to the pool (cached ones stay reusable). Returns how many were released.
        """
        if not self.window:
            return 0
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return 0
        first_needed = request.num_computed_tokens - self.window + 1
        released = []
        for i in range(min(first_needed // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] == NULL_BLOCK:
                break  # everything before it was released by an earlier call
            released.append(blocks[i])
            blocks[i] = NULL_BLOCK
        self._release(released)
        return len(released)

    def free(self, request: Request) -> None:
        """Drop the request's references (finish, abort or preemption); cached blocks stay reusable."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_num_hashed.pop(request.request_id, None)
        # Tail blocks first, so a shared prefix outlives the suffixes that hang off it.
        self._release(reversed(blocks))

    def _release(self, blocks: Iterable[int]) -> None:
        for block_id in blocks:
            if block_id == NULL_BLOCK:
                continue
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._block_hash[block_id] is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)
