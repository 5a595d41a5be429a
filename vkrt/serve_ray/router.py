"""Ray Serve request router for the engine replicas: prefix affinity, else the least loaded.

A request carries its prompt's full-block hashes (forward.block_hashes: the chain the engine's
prefix cache names blocks by). The router remembers, per replica, the blocks of the prompts it
sent there (most recent last, at most `max_blocks_per_replica`), and ranks first the replicas
holding the longest run of the request's leading blocks, unless that replica is busier than the
least loaded by more than `imbalance` requests. The other replicas follow in ranks of equal load,
least loaded first, where load is the larger of what the engine last reported (running + waiting)
and the requests this router has sent there and not yet seen finish; replicas of equal load are
shuffled. Ray Serve then takes, within a rank, the replica with the shortest queue it knows of.
The shuffle matters: when Ray's queue-length cache has expired, requests routed at the same time
all wait on one probe, see the same lengths and would otherwise all take the first replica.

What the router remembers is what it routed, not what the replica still holds: an evicted
block is forgotten only when newer prompts push it out here, and a second router (another
ingress replica) learns only from its own traffic.
"""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from vkrt.serve_ray.forward import ForwardedRequest


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, max_blocks_per_replica: int = 65536, **_: Any) -> None:
        """Called by Ray Serve with the deployment's request_router_kwargs."""
        self.imbalance = imbalance
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[ReplicaID, OrderedDict[int, None]] = {}
        self._in_flight: defaultdict[ReplicaID, int] = defaultdict(int)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Wait between rounds when every replica is full, rather than spin on the probes.
            pending_request.routing_context.should_backoff = True
        hashes = _hashes_of(pending_request)
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        least = min(loads.values())
        held = {r.replica_id: self._leading_blocks_held(r.replica_id, hashes) for r in candidate_replicas}
        longest = max(held.values())
        preferred = [r for r in candidate_replicas
                     if longest > 0 and held[r.replica_id] == longest and loads[r.replica_id] <= least + self.imbalance]
        ranks = [preferred] if preferred else []
        for load in sorted(set(loads.values())):
            rank = [r for r in candidate_replicas if loads[r.replica_id] == load]
            random.shuffle(rank)
            ranks.append(rank)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        self._in_flight[replica_id] += 1
        hashes = _hashes_of(pending_request)
        if not hashes:
            return
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.max_blocks_per_replica:
            blocks.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._blocks.pop(replica_id, None)  # its replacement starts with an empty cache
        self._in_flight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in set(self._blocks) - alive:
            del self._blocks[gone]
        for gone in set(self._in_flight) - alive:
            del self._in_flight[gone]

    def _leading_blocks_held(self, replica_id: ReplicaID, hashes: tuple[int, ...]) -> int:
        blocks = self._blocks.get(replica_id)
        if not blocks:
            return 0
        count = 0
        for block in hashes:  # chained: a block is only reusable after all the blocks before it
            if block not in blocks:
                break
            count += 1
        return count

    def _load(self, replica: RunningReplica) -> int:
        """Requests the replica holds: the largest of its engine's last reported running + waiting,
        Ray's cached queue length for it and the requests this router sent it that have not
        finished (the last two are fresher between reports)."""
        stats = replica.routing_stats or {}
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        cached = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(reported, cached, self._in_flight.get(replica.replica_id, 0))


def _hashes_of(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None:
        return ()
    request = next((a for a in pending_request.args if isinstance(a, ForwardedRequest)), None)
    return request.block_hashes if request is not None else ()
