"""KV-cache events for KV-aware routers: what the prefix cache stored and evicted, per step.

The block managers report each block that enters the prefix cache and each cached block they
evict; `KVEvents` gathers them into one batch per engine step, and a publisher
(kv_event_publisher.py) sends the batches in vLLM's wire format, so routers written for vLLM
(llm-d, the Gateway API inference extension's scorers, Dynamo) follow vkrt's cache unchanged.

The format (vLLM's `KVEventBatch`, positional msgpack arrays, the layout every router decodes;
vLLM itself sends each event as a map since mid-2026, and the routers decode both):

    batch:        [ts, [event, ...], data_parallel_rank]
    BlockStored:  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                   lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind
                   (, kv_cache_spec_sliding_window)]
    BlockRemoved: ["BlockRemoved", block_hashes, medium, group_idx]
    AllBlocksCleared: ["AllBlocksCleared"]

A block hash on the wire is `external_hash` of kv_cache.hash_block's digest (the low 64 bits,
as vLLM publishes its own), so a router can recompute it from token ids.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vkrt.engine.json_flag import json_object
from vkrt.errors import VkrtError

MEDIUM = "GPU"  # vLLM's name for blocks in device memory (the tier a router routes on)
DATA_PARALLEL_RANK = 0  # one engine per server; replicas are told apart by endpoint

_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
         "max_queue_size", "topic"}


@dataclass(frozen=True)
class KVEventsConfig:
    """What `--kv-events-config` asked for (vLLM's keys and defaults), validated."""

    endpoint: str = "tcp://*:5557"  # PUB socket; bound when it has a wildcard or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests (None: no replay)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it a batch is dropped
    topic: str = ""

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> KVEventsConfig | None:
        """From a JSON object (the CLI flag's text) or a dict; None when events are off
        (no config, enable_kv_cache_events false, or the "null" publisher)."""
        value = json_object(value, "--kv-events-config", _KEYS,
                            '{"enable_kv_cache_events": true, "publisher": "zmq"}')
        if value is None:
            return None
        enabled = value.get("enable_kv_cache_events", False)
        if not isinstance(enabled, bool):
            raise VkrtError(f"--kv-events-config: enable_kv_cache_events must be true or false, got {enabled!r}")
        publisher = value.get("publisher", "zmq" if enabled else "null")
        if publisher not in ("zmq", "null"):
            raise VkrtError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got {publisher!r}")
        for name in ("endpoint", "topic"):
            if name in value and not isinstance(value[name], str):
                raise VkrtError(f"--kv-events-config: {name} must be a string, got {value[name]!r}")
        replay = value.get("replay_endpoint")
        if replay is not None and not (isinstance(replay, str) and replay):
            raise VkrtError(f"--kv-events-config: replay_endpoint must be a non-empty string or null, got {replay!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            n = value.get(name, 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise VkrtError(f"--kv-events-config: {name} must be an integer >= 1, got {n!r}")
        config = cls(**{k: v for k, v in value.items() if k not in ("enable_kv_cache_events", "publisher")})
        if not config.endpoint:
            raise VkrtError("--kv-events-config: endpoint is empty; give e.g. \"tcp://*:5557\"")
        if not enabled or publisher == "null":
            return None
        return config


def external_hash(block_hash: bytes) -> int:
    """A block's hash as published: the digest's low 64 bits (big-endian), vLLM's int block hash."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEvents:
    """One KV group's events since the last `take`, in the order they happened.

    Adjacent removals merge into one BlockRemoved; stored runs come from the block manager
    already chained (each run's blocks consecutive, the parent the block before the first).
    """

    def __init__(self, block_size: int, group_idx: int = 0, window: int = 0) -> None:
        self.block_size = block_size
        self.group_idx = group_idx
        self.window = window  # 0: full attention
        self._events: list[list[Any]] = []

    def stored(self, block_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]) -> None:
        kind = ["sliding_window", self.window] if self.window else ["full_attention"]
        self._events.append(["BlockStored", [external_hash(h) for h in block_hashes],
                             None if parent is None else external_hash(parent), [int(t) for t in token_ids],
                             self.block_size, None, MEDIUM, None, None, self.group_idx, *kind])

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(external_hash(block_hash))
        else:
            self._events.append(["BlockRemoved", [external_hash(block_hash)], MEDIUM, self.group_idx])

    def take(self) -> list[list[Any]]:
        events, self._events = self._events, []
        return events


def all_blocks_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def event_batch(events: list[list[Any]]) -> list[Any]:
    """A KVEventBatch, stamped now, as the msgpack encoder takes it."""
    return [time.time(), events, DATA_PARALLEL_RANK]
