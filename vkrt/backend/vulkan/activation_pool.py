"""Released activation and step-input allocations, kept by size and handed out again.

An eager step (a prefill) makes ~1000 short-lived tensors; were each a fresh
allocation, every dispatch would need a new descriptor set (measured: two thirds of a short
prefill's host time on llvmpipe). A pooled allocation keeps its id, texel views and
descriptor sets, so the next step of the same shape binds exactly what this one did.

Each size hands out its lowest allocation id first: a step then takes the same allocations
in the same order whatever order the previous step released them in, so after one step of a
shape every later one of that shape hits the descriptor cache. Past `capacity` bytes the
least recently released sizes go back to the allocator (their sets die with them).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from vkrt.backend.vulkan.memory import Allocation

ACTIVATION_POOL_BYTES = 64 << 20
POOLED_PURPOSES = ("activations", "inputs")
Key = tuple[str, int]  # (purpose, size): purposes may live in different memory


class ActivationPool:
    def __init__(self, capacity: int = ACTIVATION_POOL_BYTES) -> None:
        self.capacity = capacity
        self.nbytes = 0
        self.nbytes_by_purpose = dict.fromkeys(POOLED_PURPOSES, 0)
        # key -> heap of (allocation id, allocation); keys in the order they were last released
        self._free: OrderedDict[Key, list[tuple[int, Allocation]]] = OrderedDict()

    def take(self, purpose: str, size: int) -> Allocation | None:
        """A pooled allocation for `purpose` of exactly `size` bytes (the lowest id), or None."""
        key = (purpose, size)
        heap = self._free.get(key)
        if not heap:
            return None
        _, alloc = heapq.heappop(heap)
        if not heap:
            del self._free[key]
        self._count(key, -size)
        return alloc

    def put(self, alloc: Allocation) -> list[Allocation]:
        """Keep `alloc` for reuse; the allocations that no longer fit (the caller releases them)."""
        key = (alloc.purpose, alloc.size)
        heapq.heappush(self._free.setdefault(key, []), (alloc.id, alloc))
        self._free.move_to_end(key)
        self._count(key, alloc.size)
        return self.trim()

    def trim(self) -> list[Allocation]:
        """Remove the least recently released allocations past `capacity`, and return them."""
        evicted: list[Allocation] = []
        while self.nbytes > self.capacity:
            oldest, heap = next(iter(self._free.items()))
            evicted.append(heapq.heappop(heap)[1])
            if not heap:
                del self._free[oldest]
            self._count(oldest, -oldest[1])
        return evicted

    def _count(self, key: Key, nbytes: int) -> None:
        self.nbytes += nbytes
        self.nbytes_by_purpose[key[0]] += nbytes
