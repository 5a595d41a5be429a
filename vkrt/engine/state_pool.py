"""Recurrent-state slots: the cache group of a hybrid model's recurrent layers.

A recurrent layer (a gated convolution, a gated delta net, a Mamba2 scan) keeps a fixed-size state per
sequence instead of K/V per token: the model allocates each such layer's state as
[slots, ...] tensors (models.base.KVCache.states) and reads sequence s's from slot
`state_slots[s]`. One slot serves a sequence in every recurrent layer. The pool has one slot
per sequence that can run at once (max_num_seqs), so admission never waits for one; a
sequence takes its slot with its first KV blocks and gives it back when it finishes, is
aborted or preempted. A slot needs no clearing when it changes hands: a sequence that starts
at position 0 starts from a zero state (vkrt.ops.recurrent), and a preempted one recomputes
from position 0.
"""

from __future__ import annotations


class StatePool:
    """Which request holds which state slot."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def slot(self, request_id: str) -> int:
        return self._held[request_id]

    def take(self, request_id: str) -> bool:
        """Give `request_id` a slot if it has none; False when none is free."""
        if request_id in self._held:
            return True
        if not self._free:
            return False
        self._held[request_id] = self._free.pop()
        return True

    def release(self, request_id: str) -> None:
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
