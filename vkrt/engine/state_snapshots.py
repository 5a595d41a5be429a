"""Recurrent-state snapshots at block boundaries: prefix caching for hybrid models.

A cached prefix's KV blocks serve a hybrid's attention layers, but its recurrent layers need
the state a sequence had at the end of that prefix. So when a prefill chunk ends on a block
boundary whose block is in the prefix cache, the sequence's state slot is copied (on the
device, after the step's forward: vkrt.ops.copy_state_slots) into a snapshot slot named by
that block's hash, the chained hash of the whole prefix. A later prompt's hit is cut to the
longest prefix that has a snapshot, and its state slot starts as a copy of that snapshot
(before its first chunk's forward); the attention layers reuse the blocks as for any model.

Snapshot slots are spare slots of the same state tensors as the running sequences' (after
them: slots num_seqs .. num_seqs + num_slots - 1), a fixed number, so their memory is bounded
(EngineConfig.state_snapshot_memory). A snapshot lives as long as its block stays cached: the
block manager drops it when it evicts the block, and when every slot is taken the least
recently used snapshot makes room for a new one. A snapshot taken in a step becomes visible
to lookups only after that step, so a restore is always recorded after the copy that made it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BlockHash = bytes


@dataclass
class StateCopies:
    """The state-slot copies of one step, each a (source slot, destination slot) pair."""

    # before the forward, in order: snapshot or checkpoint -> sequence, sequence -> checkpoint
    restore: list[tuple[int, int]] = field(default_factory=list)
    snapshot: list[tuple[int, int]] = field(default_factory=list)  # sequence -> snapshot, after it

    def __bool__(self) -> bool:
        return bool(self.restore or self.snapshot)


class SnapshotPool:
    """Which snapshot slot holds the state at the end of which cached prefix (by block hash)."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop(): lowest first
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._pending: dict[BlockHash, int] = {}  # taken this step, visible once it ran

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free(self) -> int:
        """Slots a new snapshot can take: free ones and cached ones (evictable, as cached blocks are)."""
        return self.num_slots - len(self._pending)

    def hashes(self) -> list[BlockHash]:
        """The prefixes that have a snapshot, least recently used first."""
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding the state after the prefix ending in `block_hash`, if any."""
        return self._cached.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """A hit used the snapshot: evict it last."""
        self._cached.move_to_end(block_hash)

    def take(self, block_hash: BlockHash) -> int | None:
        """A slot for a new snapshot of `block_hash` (the least recently used one's, when none is
        free); None when it has one already or every slot is taken this step."""
        if block_hash in self._cached or block_hash in self._pending:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._cached:
            _, slot = self._cached.popitem(last=False)
        else:
            return None
        self._pending[block_hash] = slot
        return slot

    def commit(self) -> None:
        """The step ran: its snapshots hold their states now."""
        self._cached.update(self._pending)
        self._pending.clear()

    def drop(self, block_hash: BlockHash) -> None:
        """The block ending this prefix left the cache: its snapshot is of no use any more."""
        slot = self._cached.pop(block_hash, None)
        if slot is None:
            slot = self._pending.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
