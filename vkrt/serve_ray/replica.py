"""One replica: one engine on one Vulkan device, answering forwarded requests with vkrt's own app.

Each request runs through the ASGI app `vkrt serve` would listen with (build_app over this
replica's engine), in process: the body is delivered once, the response's start and body
chunks are yielded back to the ingress as they are sent, and a caller that goes away (the
client left, the ingress was cancelled) is a disconnect the app sees, so the engine aborts the
request as it does for a direct client.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from vkrt.serve_ray.forward import REPLICA_HEADER, ForwardedRequest, ResponseStart
from vkrt.server import ServerConfig, build_app, load_engine
from vkrt.server.app import warm_up

log = logging.getLogger("vkrt.serve_ray")

_END = object()  # the app returned: nothing more will be sent


def replica_device(devices: tuple[str, ...], local_rank: int) -> str | None:
    """The VKRT_DEVICE selector of the replica with this rank on its node: the devices listed are
    dealt out by local rank; none listed keeps the node's own choice (VKRT_DEVICE or the best)."""
    return devices[local_rank % len(devices)] if devices else None


class EngineReplica:
    """A Ray Serve deployment class. Ray Serve awaits its constructor, so a replica is RUNNING (and
    counted ready by /health) only once its engine is loaded and warmed."""

    async def __init__(self, config: ServerConfig, devices: tuple[str, ...] = ()) -> None:  # type: ignore[misc]
        context = serve.get_replica_context()
        selector = replica_device(devices, context.rank.local_rank)
        if selector is not None:
            os.environ["VKRT_DEVICE"] = selector  # read when the engine opens its device, below
        self.name = f"{ray.util.get_node_ip_address()}/{os.getpid()}"
        self.engine = await asyncio.to_thread(load_engine, config)
        await warm_up(self.engine)
        self.app = build_app(self.engine, config)
        log.info("replica %s ready (rank %s, device %s)", self.name, context.rank.rank, selector or "default")

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to `request`: its ResponseStart (with x-vkrt-replica), then body bytes."""
        sent: asyncio.Queue[Any] = asyncio.Queue()
        caller_left = asyncio.Event()
        body_delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal body_delivered
            if not body_delivered:
                body_delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await caller_left.wait()
            return {"type": "http.disconnect"}

        app = asyncio.ensure_future(self.app(_scope(request), receive, sent.put))
        app.add_done_callback(lambda _: sent.put_nowait(_END))
        try:
            while (message := await sent.get()) is not _END:
                if message["type"] == "http.response.start":
                    headers = (*message.get("headers", ()), (REPLICA_HEADER.encode(), self.name.encode()))
                    yield ResponseStart(message["status"], tuple(headers))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
            app.result()  # the app ended before its body did: re-raise what stopped it
        finally:
            caller_left.set()
            if not app.done():
                try:
                    await asyncio.wait_for(app, timeout=10)
                except Exception as exc:
                    log.warning("replica %s: a request did not end cleanly: %r", self.name, exc)

    def record_routing_stats(self) -> dict[str, int]:
        """The engine's load, for the router (Ray Serve polls it every request_routing_stats_period_s)."""
        metrics = self.engine.metrics()
        return {"running": metrics.num_running, "waiting": metrics.num_waiting}

    def check_health(self) -> None:
        """Ray Serve's health probe: a lost device fails it, and Ray replaces the replica."""
        if not self.engine.is_ready:
            raise RuntimeError(f"replica {self.name}: the engine cannot serve "
                               f"({self.engine.device_error or self.engine.load_error})")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
