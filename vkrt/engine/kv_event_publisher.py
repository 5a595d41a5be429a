"""Publishes KV event batches over ZeroMQ off the engine's critical path (vLLM's ZMQ publisher protocol).

The engine thread only numbers a batch and puts it on a queue (never blocking: a full queue
drops the batch, which leaves a gap in the sequence numbers a subscriber can see). One
background thread owns both sockets: it encodes each batch with msgpack and sends

    PUB:    [topic, seq (8 bytes, big-endian), payload]

and keeps the last `buffer_steps` (seq, payload) pairs for the ROUTER replay socket. A replay
client (a REQ or DEALER socket) sends a start sequence number as 8 big-endian bytes and gets
back every buffered batch from there, each [seq, payload], then the end marker [-1 as 8
signed big-endian bytes, b""].

zmq and msgpack are imported here only, and this module only when events are configured.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import msgpack
import zmq

from vkrt.engine.kv_events import KVEventsConfig
from vkrt.errors import VkrtError

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 50  # how often the thread looks at the replay socket when no batch arrives
_FLUSH_MS = 1000  # how long closing waits for sent batches still queued in the PUB socket


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, IPv6 any or ipc/inproc endpoint is bound; a host:port is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket + optional ROUTER replay socket, served by one daemon thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.dropped = 0  # batches dropped because the queue was full
        self._next_seq = 0
        self._queue: queue.Queue[tuple[int, list[Any]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._open(self._pub, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._open(self._replay, config.replay_endpoint, "replay_endpoint", bind=True)
        except VkrtError:
            self._close_sockets()
            raise
        # The sockets were made here; from now on only the thread touches them (zmq sockets are
        # not thread-safe, and starting a thread is the memory barrier handing them over needs).
        self._thread = threading.Thread(target=self._run, name="vkrt-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s", config.endpoint,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    @staticmethod
    def _open(socket: zmq.Socket[bytes], endpoint: str, key: str, bind: bool | None = None) -> None:
        try:
            if bind if bind is not None else binds(endpoint):
                socket.bind(endpoint)
            else:
                socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise VkrtError(f"--kv-events-config: {key} {endpoint!r}: {exc}; pick a free port or a valid "
                            "address (e.g. tcp://*:5557)") from None

    def publish(self, batch: list[Any]) -> None:
        """Queue one KVEventBatch (event_batch's list); never blocks the caller."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the publisher queue is full (max_queue_size=%d); dropping batches "
                            "(subscribers see a gap in the sequence numbers)", self.config.max_queue_size)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), stop the thread, close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("KV events: the publisher did not drain its queue; closing anyway")
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=_FLUSH_MS)  # a PUB socket with no subscriber drops at once: no wait then
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # ---- the publisher thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except zmq.ZMQError as exc:  # a client that left mid-answer must not end the thread
                        log.warning("KV events: a replay request failed: %s", exc)
            try:
                item = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = msgpack.packb(batch, use_bin_type=True)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
            except (zmq.ZMQError, ValueError, TypeError) as exc:
                log.error("KV events: batch %d not published: %s", seq, exc)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("KV events: ignoring a replay request of %d frames (want identity, b'', 8-byte seq)",
                        len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
