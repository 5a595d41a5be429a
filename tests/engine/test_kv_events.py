"""KV events as a router sees them: a subscriber written from vLLM's published schema (ZMQ
multipart [topic, 8-byte big-endian seq, msgpack KVEventBatch], events as tagged positional
arrays) decodes what a real engine on the tiny Llama fixture publishes. It decodes with plain
msgpack and recomputes block hashes by the documented scheme, never with vkrt's own classes."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vkrt.engine import LLM, AsyncLLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.kv_cache import BlockManager
from vkrt.engine.kv_events import KVEvents, KVEventsConfig
from vkrt.engine.request import Request
from vkrt.errors import VkrtError

zmq = pytest.importorskip("zmq", reason="pyzmq is a dependency of KV events; install the project's dependencies")
msgpack = pytest.importorskip("msgpack", reason="msgpack is a dependency of KV events")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny_llama"
BLOCK = 4
TOPIC = "kv@test"


def documented_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """docs/USAGE.md's scheme: sha256(parent digest || token ids as int64 little-endian)."""
    data = (parent or b"") + b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data).digest()


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


class Subscriber:
    """A router's side: SUB on the event endpoint, REQ on the replay endpoint."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.batches: dict[int, tuple[bytes, Any]] = {}  # seq -> (payload, decoded)

    def drain(self, quiet: float = 0.5) -> None:
        """Read until nothing has arrived for `quiet` seconds."""
        while self.sub.poll(int(quiet * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = (payload, msgpack.unpackb(payload))

    def events(self) -> list[list[Any]]:
        return [event for seq in sorted(self.batches) for event in self.batches[seq][1][1]]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask for every buffered batch from `start`: a DEALER sends [b"", seq] as a REQ would,
        and reads the stream of [b"", seq, payload] replies up to the end marker."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        try:
            while True:
                assert dealer.poll(5000), "the replay socket did not answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def publish(tmp_path: Path) -> Iterator[Callable[..., tuple[LLM, Subscriber]]]:
    """publish(model dir) -> an engine on it publishing to ipc sockets, and a subscriber."""
    made: list[tuple[LLM, Subscriber]] = []

    def make(model: Path = FIXTURE) -> tuple[LLM, Subscriber]:
        endpoint, replay = f"ipc://{tmp_path}/kv-events-{len(made)}", f"ipc://{tmp_path}/kv-replay-{len(made)}"
        config = KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                       "replay_endpoint": replay, "topic": TOPIC, "buffer_steps": 1000})
        llm = LLM(model, device="reference", block_size=BLOCK, num_kv_blocks=16, max_model_len=64,
                  max_num_seqs=2, kv_events=config)
        subscriber = Subscriber(endpoint, replay)
        made.append((llm, subscriber))
        time.sleep(0.3)  # PUB/SUB: a subscription takes a moment to reach the publisher
        return llm, subscriber

    yield make
    for llm, subscriber in made:
        llm.close()
        subscriber.close()


@pytest.fixture
def published(publish: Callable[..., tuple[LLM, Subscriber]]) -> tuple[LLM, Subscriber]:
    return publish()


def greedy(llm: LLM, prompt: list[int], max_tokens: int = 3) -> list[int]:
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    return prompt + list(out.token_ids)


def test_stored_blocks_match_the_prompt_and_chain(published: tuple[LLM, Subscriber]) -> None:
    llm, subscriber = published
    prompt = [5 + (i * 7) % 50 for i in range(13)]  # 3 full blocks and one token
    tokens = greedy(llm, prompt)
    subscriber.drain()
    stored = [e for e in subscriber.events() if e[0] == "BlockStored"]
    assert stored, "no BlockStored event arrived"
    published_blocks: list[tuple[int, int | None, list[int]]] = []
    for event in stored:
        tag, hashes, parent, token_ids, block_size, lora_id, medium = event[:7]
        assert (block_size, lora_id, medium) == (BLOCK, None, "GPU")
        assert len(token_ids) == len(hashes) * BLOCK
        for k, h in enumerate(hashes):
            published_blocks.append((h, parent if k == 0 else hashes[k - 1], token_ids[k * BLOCK:(k + 1) * BLOCK]))
    # Block by block: the request's tokens, each block's parent the one before it, the hashes
    # those a router recomputes from the token ids.
    digest: bytes | None = None
    for i, (h, parent, token_ids) in enumerate(published_blocks):
        assert token_ids == tokens[i * BLOCK:(i + 1) * BLOCK]
        assert parent == (None if digest is None else low64(digest))
        digest = documented_hash(digest, token_ids)
        assert h == low64(digest)
    assert len(published_blocks) >= 3  # the prompt's three full blocks at least
    assert [t for _, _, ids in published_blocks[:3] for t in ids] == prompt[:12]


def test_evictions_are_published_and_replay_returns_the_buffer(published: tuple[LLM, Subscriber]) -> None:
    llm, subscriber = published
    first = greedy(llm, list(range(3, 16)))
    # All 16 blocks of the pool: every block the first request cached must be evicted.
    greedy(llm, [60 + i % 40 for i in range(61)])
    subscriber.drain()
    events = subscriber.events()
    stored = {h for e in events if e[0] == "BlockStored" for h in e[1]}
    removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
    first_hashes, digest = [], None
    for i in range(len(first) // BLOCK):
        digest = documented_hash(digest, first[i * BLOCK:(i + 1) * BLOCK])
        first_hashes.append(low64(digest))
    assert removed, "a pressured cache published no BlockRemoved"
    assert set(removed) <= stored  # only what was announced is taken back
    first_stored = {h for h in first_hashes if h in stored}
    assert len(first_stored) >= 3 and first_stored <= set(removed)  # the first request's blocks left the cache
    assert all(e[2:4] == ["GPU", 0] for e in events if e[0] == "BlockRemoved")

    # The subscriber joined after the engine started, so the opening AllBlocksCleared (seq 0)
    # came before it listened: the replay socket still has it, and every batch after it.
    replayed = subscriber.replay(0)
    seqs = [seq for seq, _ in replayed]
    assert seqs == list(range(len(seqs))) and seqs[0] == 0
    assert msgpack.unpackb(replayed[0][1])[1] == [["AllBlocksCleared"]]
    for seq, payload in replayed:
        if seq in subscriber.batches:
            assert payload == subscriber.batches[seq][0]
    assert set(subscriber.batches) <= set(seqs)
    ts, batch_events, rank = msgpack.unpackb(replayed[-1][1])
    assert isinstance(ts, float) and rank == 0 and batch_events
    later = subscriber.replay(seqs[-1])
    assert [seq for seq, _ in later] == [seqs[-1]]


def test_each_kv_group_publishes_its_blocks(publish: Callable[..., tuple[LLM, Subscriber]]) -> None:
    """Gemma 2 alternates sliding-window (8) and full-attention layers: two block pools, each
    announcing the same chained hashes under its own group_idx and cache spec."""
    llm, subscriber = publish(FIXTURE.parent / "tiny_gemma2")
    tokens = greedy(llm, [7 + (i * 5) % 40 for i in range(13)])
    subscriber.drain()
    by_group: dict[tuple[int, str, int | None], list[int]] = {}
    for event in subscriber.events():
        if event[0] == "BlockStored":
            spec = (event[9], event[10], event[11] if len(event) > 11 else None)
            by_group.setdefault(spec, []).extend(event[1])
    expected, digest = [], None
    for i in range(3):
        digest = documented_hash(digest, tokens[i * BLOCK:(i + 1) * BLOCK])
        expected.append(low64(digest))
    assert set(by_group) == {(0, "full_attention", None), (1, "sliding_window", 8)}
    for hashes in by_group.values():
        assert hashes[:3] == expected


def test_a_run_after_blocks_cached_elsewhere_names_its_parent() -> None:
    """Blocks already cached by another request are not announced again; the next stored run
    starts at its own first block, whose parent is the (already announced) block before it."""
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    manager.events = KVEvents(BLOCK)
    first = Request("a", list(range(8)), SamplingParams())
    assert manager.allocate_slots(first, 8)
    twin = Request("b", list(range(8)) + [50, 51, 52, 53], SamplingParams())
    assert manager.allocate_slots(twin, 12)  # computed without its cache hit: blocks 0-1 are duplicates
    (one, two) = manager.events.take()
    digests = [documented_hash(None, list(range(4)))]
    digests.append(documented_hash(digests[0], list(range(4, 8))))
    digests.append(documented_hash(digests[1], [50, 51, 52, 53]))
    assert one[1:4] == [[low64(d) for d in digests[:2]], None, list(range(8))]
    assert two[1:4] == [[low64(digests[2])], low64(digests[1]), [50, 51, 52, 53]]


def test_the_server_facade_publishes_and_stops_its_publisher(tmp_path: Path) -> None:
    """AsyncLLM (what `vkrt serve` runs) publishes too, and its shutdown ends the publisher thread."""
    endpoint = f"ipc://{tmp_path}/kv-events"
    llm = AsyncLLM(FIXTURE, device="reference", block_size=BLOCK, num_kv_blocks=16, max_model_len=64,
                   kv_events=KVEventsConfig(endpoint=endpoint, topic=TOPIC))
    subscriber = Subscriber(endpoint, f"ipc://{tmp_path}/unused")
    try:
        time.sleep(0.3)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

        async def run() -> None:
            async for _ in llm.generate(list(range(10, 19)), params):
                pass

        asyncio.run(run())
        subscriber.drain()
        stored = [e for e in subscriber.events() if e[0] == "BlockStored"]
        assert [t for e in stored for t in e[3]][:8] == list(range(10, 18))
    finally:
        llm.shutdown()
        subscriber.close()
    assert not [t for t in threading.enumerate() if t.name == "vkrt-kv-events"]


def test_a_full_queue_drops_batches_and_never_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's side only queues: with the publisher thread stuck encoding batch 0 and a
    queue of 2, batches 3-5 are dropped at once (not waited for) and leave a gap a subscriber sees."""
    from vkrt.engine import kv_event_publisher
    from vkrt.engine.kv_events import all_blocks_cleared, event_batch

    encoding, release = threading.Event(), threading.Event()
    pack = kv_event_publisher.msgpack.packb

    def stuck_pack(obj: Any, **kwargs: Any) -> bytes:
        encoding.set()
        release.wait(10)
        return pack(obj, **kwargs)

    monkeypatch.setattr(kv_event_publisher.msgpack, "packb", stuck_pack)
    endpoint = f"ipc://{tmp_path}/kv-events"
    subscriber = Subscriber(endpoint, f"ipc://{tmp_path}/unused")
    publisher = kv_event_publisher.ZmqEventPublisher(KVEventsConfig(endpoint=endpoint, topic=TOPIC,
                                                                    max_queue_size=2))
    try:
        time.sleep(0.3)
        publisher.publish(event_batch([all_blocks_cleared()]))
        assert encoding.wait(5)
        started = time.monotonic()
        for _ in range(5):
            publisher.publish(event_batch([all_blocks_cleared()]))
        assert time.monotonic() - started < 1.0 and publisher.dropped == 3  # the thread is stuck for 10 s
        release.set()
        subscriber.drain()
        assert sorted(subscriber.batches) == [0, 1, 2]
    finally:
        release.set()
        publisher.close()
        subscriber.close()


@pytest.mark.parametrize(("config", "message"), [
    ('{"enable_kv_cache_events": true, "endpointt": "x"}', "unknown key(s) endpointt"),
    ("{not json", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": "yes"}', "must be true or false"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', 'publisher must be "zmq" or "null"'),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"enable_kv_cache_events": true, "hwm": 1.5}', "hwm must be an integer >= 1"),
    ('{"enable_kv_cache_events": true, "topic": 3}', "topic must be a string"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": ""}', "replay_endpoint must be a non-empty string"),
])
def test_bad_configs_say_what_is_wrong(config: str, message: str) -> None:
    with pytest.raises(VkrtError, match="--kv-events-config") as info:
        KVEventsConfig.parse(config)
    assert message in str(info.value)


def test_defaults_and_off_switches() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert config == KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint=None, buffer_steps=10_000,
                                    hwm=100_000, topic="")
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert KVEventsConfig.parse(None) is None


def test_an_endpoint_that_cannot_bind_is_a_clear_error(tmp_path: Path) -> None:
    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "tcp://*:notaport"})
    with pytest.raises(VkrtError, match=r"--kv-events-config: endpoint 'tcp://\*:notaport'"):
        LLM(FIXTURE, device="reference", block_size=BLOCK, num_kv_blocks=16, max_model_len=64, kv_events=config)


def test_the_serve_flag_reaches_the_engine_config() -> None:
    from vkrt.cli import build_parser
    from vkrt.server.config import ServerConfig

    args = build_parser().parse_args(["serve", "--kv-events-config",
                                      '{"enable_kv_cache_events": true, "topic": "kv", "hwm": 7}'])
    assert args.kv_events_config == KVEventsConfig(topic="kv", hwm=7)
    config = ServerConfig(kv_events_config=args.kv_events_config)
    assert config.engine_config().kv_events == KVEventsConfig(topic="kv", hwm=7)


def test_a_server_without_kv_events_never_imports_zmq() -> None:
    code = ("import sys; import vkrt.server, vkrt.engine.engine, vkrt.cli; "
            "assert 'zmq' not in sys.modules and 'msgpack' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
