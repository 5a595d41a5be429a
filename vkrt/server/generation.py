"""Running one request on the engine: incremental updates, abort on early exit, metrics.

The engine streams delta outputs (each holds only what its step added); `Generation` passes
each on as an `Update`, accumulates the `Result` from them, observes TTFT and inter-token
latency as the client sees them, and on any early exit (client disconnect, cancellation,
error) aborts the engine request so its KV blocks are freed within one engine step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from vkrt.engine.async_llm import EngineMetrics
from vkrt.engine.config import SamplingParams
from vkrt.engine.request import RequestMetrics, RequestOutput, TokenLogprobs
from vkrt.server.config import ServerConfig
from vkrt.server.engine_client import EngineClient
from vkrt.server.errors import APIError
from vkrt.server.metrics import ServerMetrics

log = logging.getLogger("vkrt.server")

T = TypeVar("T")


class ServerState:
    """What the routes share: the config, the engine once loaded, metrics, load accounting."""

    def __init__(self, config: ServerConfig, engine: EngineClient | None) -> None:
        self.config = config
        self.engine = engine
        self.load_error: str | None = None
        # Warmed: one tiny generation has run, so pipelines exist and the decode step is recorded
        # (GET /ready). An engine handed to the app is taken as warmed by whoever built it.
        self.warm = engine is not None
        self.model_name = config.model_name()
        # Requests admitted and not yet finished: counted at admission, so a burst that
        # arrives together cannot all pass the capacity check before any starts.
        self.num_in_flight = 0
        self.metrics = ServerMetrics(self.read_stats, self.model_name)
        self._cpu_pool: ThreadPoolExecutor | None = None

    async def run_cpu(self, fn: Callable[..., T], *args: Any, inline: bool = False, **kwargs: Any) -> T:
        """Run tokenisation or template rendering on the worker pool, off the event loop, so
        one big prompt never stalls /health or other clients' streams; `inline` (work the
        caller knows is small) runs it here, sparing a short request the hop."""
        if inline:
            return fn(*args, **kwargs)
        if self._cpu_pool is None:
            self._cpu_pool = ThreadPoolExecutor(self.config.cpu_workers, thread_name_prefix="vkrt-cpu",
                                                initializer=_lower_thread_priority)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu_pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        if self._cpu_pool is not None:
            self._cpu_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        engine = self.engine
        # AsyncLLM(load_in_background=True) also turns is_ready on when its load failed.
        return (engine is not None and bool(engine.is_ready) and getattr(engine, "load_error", None) is None
                and self.load_error is None)

    def require_engine(self) -> EngineClient:
        if self.engine is None or not self.ready:
            lost = getattr(self.engine, "device_error", None)
            if lost is not None:
                raise APIError(503, f"the device failed: {lost}", code="device_lost")
            error = self.load_error or getattr(self.engine, "load_error", None)
            detail = f"the model failed to load: {error}" if error else "the model is still loading"
            raise APIError(503, f"{detail}; retry when GET /health answers 200", code="model_not_ready")
        return self.engine

    def read_stats(self) -> EngineMetrics | None:
        return self.engine.metrics() if self.ready and self.engine is not None else None

    def admit(self) -> None:
        """Count one more request in flight, or 429 when those waiting beyond the running
        batch would exceed the limit. Check and count happen with no await between them, so
        admission is atomic on the event loop; `Generation.release` gives the place back."""
        waiting = self.num_in_flight - self.config.max_num_seqs
        if waiting >= self.config.max_waiting_requests:
            raise APIError(429, f"server overloaded: {self.num_in_flight} requests in flight, "
                           f"{max(waiting, 0)} waiting (limit {self.config.max_waiting_requests}); retry later",
                           code="server_overloaded")
        self.num_in_flight += 1

    def abort(self, request_id: str) -> None:
        """Synchronous on purpose: this runs inside cancelled tasks, where an await would be cancelled."""
        if self.engine is not None:
            self.engine.abort(request_id)


def _lower_thread_priority() -> None:
    """Nice a worker thread (Linux schedules threads by their own id): a megabyte of prompt
    being tokenised must not take the CPU from the event loop or the engine's steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


@dataclass
class Candidate:
    """One engine request of a response: made (validated) by the engine, not yet started."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: AsyncIterator[RequestOutput]  # the engine's delta stream; iterating it starts the request


@dataclass
class Update:
    """What one engine output added."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None


@dataclass
class Result:
    """Everything generated so far, accumulated from the updates."""

    prompt_token_ids: list[int]
    pieces: list[str] = field(default_factory=list)  # the text, one piece per update (joined once)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason "error": what went wrong (the engine's words)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    engine_metrics: RequestMetrics | None = None  # the engine's timestamps, as of the last output

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def raise_if_failed(result: Result) -> None:
    """For the routes whose protocol has no finish_reason "error" (Messages, Responses): a
    failed generation is a 500, or an error event once a stream has started."""
    if result.finish_reason == "error":
        raise APIError(500, f"the generation failed: {result.error or 'engine error'}", code="generation_failed")


class Generation:
    """One admitted request on the engine. Iterate `updates()` once; read `result` afterwards.

    It holds an admission place from construction until `release()` (idempotent), which
    runs when the updates end, when `run()` returns, or when the route gives up early.
    """

    def __init__(self, state: ServerState, candidate: Candidate, arrival_time: float) -> None:
        state.admit()
        self._admitted = True
        self.state = state
        self.request_id = candidate.request_id
        self.params = candidate.params
        self.outputs = candidate.outputs
        self.arrival_time = arrival_time
        self.result = Result(prompt_token_ids=list(candidate.prompt_token_ids),
                             logprobs=[] if candidate.params.logprobs is not None else None)

    def release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.state.num_in_flight -= 1

    async def updates(self) -> AsyncIterator[Update]:
        state, result = self.state, self.result
        last_token_time: float | None = None
        failed = False
        try:
            async for output in self.outputs:
                update = self._absorb(output)
                if update.token_ids:
                    now = time.monotonic()
                    if last_token_time is None:
                        state.metrics.observe_ttft(now - self.arrival_time)
                    else:
                        state.metrics.observe_itl(now - last_token_time)
                    last_token_time = now
                if update.token_ids or update.text or update.finish_reason:
                    yield update
        except Exception:
            failed = True
            raise
        finally:
            self.release()
            if result.finish_reason is None:  # left early: disconnect, cancellation or failure
                state.abort(self.request_id)
                result.finish_reason = "error" if failed else "abort"
                log.info("request %s ended (%s) after %d tokens", self.request_id, result.finish_reason,
                         len(result.token_ids))
            state.metrics.record_finished(result.finish_reason, len(result.prompt_token_ids),
                                          len(result.token_ids), self.arrival_time, result.engine_metrics,
                                          self._max_tokens())

    def _max_tokens(self) -> int | None:
        """The most this request could generate: its max_tokens, or what the context left."""
        if self.params.max_tokens is not None:
            return self.params.max_tokens
        engine = self.state.engine
        return None if engine is None else engine.max_model_len - len(self.result.prompt_token_ids)

    def _absorb(self, output: RequestOutput) -> Update:
        """Add one delta output to the result; the update it makes."""
        result = self.result
        completion = output.outputs[0]
        new_logprobs = None
        if result.logprobs is not None and completion.logprobs is not None:
            new_logprobs = completion.logprobs
            result.logprobs.extend(new_logprobs)
        result.token_ids.extend(completion.token_ids)
        if completion.text:
            result.pieces.append(completion.text)
        if output.prompt_logprobs is not None:  # sent once, in the first output
            result.prompt_logprobs = output.prompt_logprobs
        result.num_cached_tokens = output.num_cached_tokens
        result.engine_metrics = output.metrics
        if output.finished:
            result.finish_reason = completion.finish_reason or "stop"
            result.stop_reason = completion.stop_reason
            result.error = completion.error
        return Update(completion.text, completion.token_ids, new_logprobs,
                      result.finish_reason if output.finished else None)

    async def run(self, raw_request: Request | None = None) -> Result:
        """Generate to the end; abort if the HTTP client disconnects first (499-style)."""
        try:
            await consume_watching(self.updates(), raw_request)
            return self.result
        finally:
            self.release()


async def consume_watching(updates: AsyncIterator[Any], raw_request: Request | None) -> None:
    """Iterate `updates` to the end; stop it (aborting its requests) and raise a 400 if the
    HTTP client disconnects first."""

    async def consume() -> None:
        async for _ in updates:
            pass

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request)) if raw_request else None
    try:
        waiters: set[asyncio.Future[Any]] = {task} if watcher is None else {task, watcher}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the client went away
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(400, "client disconnected", code="client_disconnected")
        task.result()
    finally:
        if watcher is not None:
            watcher.cancel()
        if not task.done():
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed its connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
