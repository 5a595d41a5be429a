"""`AsyncLLM`: the server's facade. The blocking engine loop runs in one background thread;
asyncio callers submit requests and read their updates from per-request queues."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.engine.engine import EngineCore, IterationStats, StatsListener
from vkrt.engine.llm import make_config
from vkrt.engine.pooling import PoolingParams, PoolingResult
from vkrt.engine.prompts import Messages, Prompt, encode_prompt, render_chat
from vkrt.engine.request import Request, RequestOutput, RequestOutputKind
from vkrt.engine.speculative import SpecStats
from vkrt.errors import RequestError, VkrtError
from vkrt.loader.config import ModelConfig
from vkrt.models.base import CausalLM
from vkrt.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineMetrics:
    """Gauges and running totals for /metrics, consistent as of the end of one step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    block_size: int = 0  # tokens per KV block (0 before the load)
    kv_cache_dtype: str = ""
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_caching: bool = False  # on for this model (off when configured so, or a hybrid without snapshot memory)
    num_state_slots: int = 0  # a hybrid's recurrent-state slots (0: no recurrent layer)
    num_free_state_slots: int = 0
    num_state_snapshots: int = 0  # a hybrid's prefix-cache state snapshot slots (0: none)
    num_cached_state_snapshots: int = 0  # of which hold the state after a cached prefix
    steps: int = 0
    steps_by_tokens: tuple[int, ...] = ()  # steps per STEP_TOKEN_BUCKETS bucket (the last: above them all)
    step_tokens: int = 0  # tokens run, over all steps
    nonfinite_logits: int = 0  # requests ended because their logits held NaN or Inf
    out_of_memory_steps: int = 0  # steps the device refused for lack of memory
    device: str = ""  # the device the model runs on, as its backend names it ("" before the load)
    backend: str = ""
    device_memory_bytes: int = 0  # the device's memory (its largest device-local heap; 0: unknown)
    device_memory_reserved_bytes: int = 0  # of which vkrt has reserved (weights, KV cache, state, scratch)
    counters: dict[str, int] = field(default_factory=dict)  # summed over all steps
    last_step_counters: dict[str, int] = field(default_factory=dict)
    spec: SpecStats | None = None  # speculative decoding's totals (None: the engine does not speculate)


class _Stream:
    """Where the engine thread puts one request's outputs for its asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


class AsyncLLM:
    """Continuous batching for concurrent asyncio callers.

    `load_in_background=True` returns at once and loads the model in the engine thread;
    `is_ready` turns True when it can take requests (the server's /health).
    """

    def __init__(self, config: EngineConfig | str | Path | None = None, *, model: CausalLM | None = None,
                 tokenizer: Tokenizer | None = None, load_in_background: bool = False, **kwargs: Any) -> None:
        self.config = make_config(config, **kwargs)
        self.load_error: BaseException | None = None
        # The device was lost mid-run: every request ended with it, and this engine serves no more.
        self.device_error: BaseException | None = None
        self._fatal_listeners: list[Callable[[BaseException], None]] = []
        self._engine: EngineCore | None = None
        self._shut_down = False
        self._streams: dict[str, _Stream] = {}
        self._adds: list[Request] = []  # made (validated) by generate, queued by the engine thread
        self._aborts: list[str] = []
        self._listeners: list[StatsListener] = []
        self._metrics = EngineMetrics()
        self._device: tuple[str, str, int] = ("", "", 0)  # name, backend, memory bytes: set at load
        self._cond = threading.Condition()
        self._stopped = False
        self._ready = threading.Event()
        if not load_in_background:
            self._engine = EngineCore.from_config(self.config, model, tokenizer)
            self._on_loaded()
        self._thread = threading.Thread(target=self._run, args=(model, tokenizer), name="vkrt-engine", daemon=True)
        self._thread.start()

    # ---- state ----------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """Loaded and usable (a failed load or a lost device is never ready)."""
        return self._ready.is_set() and self.load_error is None and self.device_error is None

    def add_fatal_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call `listener(error)`, on the engine thread, once the device is lost (the server stops then)."""
        self._fatal_listeners.append(listener)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loaded (True) or the timeout passes; re-raises a load failure."""
        ready = self._ready.wait(timeout)
        if self.load_error is not None:
            raise self.load_error
        return ready

    @property
    def engine(self) -> EngineCore:
        if self._engine is None:
            if self._shut_down:
                raise VkrtError("the engine was shut down")
            raise VkrtError("the model is still loading" if self.load_error is None
                            else f"the model failed to load: {self.load_error}")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model.config

    def metrics(self) -> EngineMetrics:
        """A copy of the gauges and totals as of the last completed step."""
        with self._cond:
            m = self._metrics
            return EngineMetrics(**{**m.__dict__, "counters": dict(m.counters),
                                    "last_step_counters": dict(m.last_step_counters),
                                    "spec": None if m.spec is None else m.spec.copy()})

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call `listener(IterationStats)` after every step, on the engine thread (TTFT, ITL, ...)."""
        self._listeners.append(listener)
        if self._engine is not None:
            self._engine.stats_listeners.append(listener)

    # ---- requests -------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return encode_prompt(self.tokenizer, prompt)

    def render_chat(self, messages: Messages, chat_template_kwargs: dict[str, Any] | None = None,
                    tools: Sequence[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        return render_chat(self.tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs)

    def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                 *, prompt_text: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The request's stream of delta updates, one per generated token, the last with
        finished=True: each holds only what its step added (prompt logprobs in the first).

        The request is made here, before any stream exists: a bad prompt, parameter or grammar
        raises RequestError from this call. The grammar compiles here too, so call it off the
        event loop when the request may carry a new schema. Iterating the stream hands the
        request to the engine thread (a stream never iterated queues nothing); leaving the
        iteration early (client gone, task cancelled) aborts it, which frees its KV blocks
        before the next step.
        """
        text, ids = self.encode(prompt)
        request = self.engine.make_request(request_id or uuid.uuid4().hex, ids, params,
                                           prompt=prompt_text if prompt_text is not None else text,
                                           output_kind=RequestOutputKind.DELTA)
        return self._stream(request)

    async def pool(self, prompt_token_ids: list[int], params: PoolingParams,
                   request_id: str | None = None) -> PoolingResult:
        """Run the prompt's prefill with the generation requests and return its pooled hidden state
        (and last logits, if asked). RequestError for a bad prompt; VkrtError if the step failed."""
        request = self.engine.make_pooling_request(request_id or uuid.uuid4().hex, prompt_token_ids, params)
        final: RequestOutput | None = None
        async for output in self._stream(request):
            final = output
        if final is None or final.pooling is None:
            error = final.outputs[0].error if final is not None else None
            raise VkrtError(error or "the pooling request ended without a result")
        return final.pooling

    async def _stream(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._cond:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use", param="request_id", status=409)
            self._streams[request_id] = stream
            self._adds.append(request)
            self._cond.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step runs."""
        with self._cond:
            if self._streams.pop(request_id, None) is not None:
                # Not yet handed to the engine: drop it here, or it would run with no reader.
                self._adds = [request for request in self._adds if request.request_id != request_id]
                self._aborts.append(request_id)
                self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------

    def _on_loaded(self) -> None:
        assert self._engine is not None
        self._engine.stats_listeners.extend(self._listeners)
        self._engine.stats_listeners.append(self._update_metrics)
        self._device = _device_of(self._engine.model.backend)
        self._update_metrics(None)
        self._ready.set()

    def _run(self, model: CausalLM | None, tokenizer: Tokenizer | None) -> None:
        if self._engine is None:
            try:
                self._engine = EngineCore.from_config(self.config, model, tokenizer)
            except BaseException as exc:  # reported by wait_ready / engine
                log.exception("model load failed")
                self.load_error = exc
                self._ready.set()
                return
            self._on_loaded()
        engine = self._engine
        while True:
            with self._cond:
                while not (self._stopped or self._adds or self._aborts or engine.has_unfinished()):
                    self._cond.wait()
                if self._stopped:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                engine.abort(request_id)
            for request in adds:
                try:
                    engine.add(request)
                except Exception as exc:  # made by generate, so a bug: fail this stream, not the engine
                    self._deliver_error(request.request_id, exc)
            try:
                outputs = engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(VkrtError(f"engine step failed: {exc}"))
                continue
            if not outputs and aborts:
                self._update_metrics(None)  # an abort-only round still changes the gauges
            with self._cond:
                streams = [(self._streams.get(o.request_id), o) for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._streams.pop(output.request_id, None)
            # A lost device is made known before the requests' error outputs go out, so a client
            # that reads its stream's end finds /health already failing.
            if engine.device_lost is not None and self.device_error is None:
                self.device_error = engine.device_lost
                for listener in self._fatal_listeners:
                    listener(engine.device_lost)
            for stream, output in streams:
                if stream is not None:
                    stream.put(output)
        self._fail_all(VkrtError("the engine was shut down"))
        engine.close()
        # Drop the engine (and with it the model's weights and KV cache) now rather than when
        # the last reference to this object goes: a web framework's caches may hold the routes
        # that hold us long after the server has stopped.
        with self._cond:
            self._engine = None
            self._shut_down = True

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            if self._engine is not None:
                self._engine.abort(request_id)
            stream.put(exc)

    def _update_metrics(self, stats: IterationStats | None) -> None:
        engine = self.engine
        blocks = engine.block_manager
        totals = engine.totals
        metrics = EngineMetrics(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            kv_usage=blocks.usage,
            num_kv_blocks=blocks.num_blocks,
            num_free_kv_blocks=blocks.num_free_blocks,
            block_size=blocks.block_size,
            kv_cache_dtype=engine.config.kv_dtype,
            num_preemptions=engine.num_preemptions,
            prompt_tokens=totals.prompt_tokens,
            generation_tokens=totals.generation_tokens,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            prefix_caching=engine.prefix_caching,
            num_state_slots=blocks.states.num_slots if blocks.states is not None else 0,
            num_free_state_slots=blocks.states.num_free if blocks.states is not None else 0,
            num_state_snapshots=blocks.snapshots.num_slots if blocks.snapshots is not None else 0,
            num_cached_state_snapshots=blocks.snapshots.num_cached if blocks.snapshots is not None else 0,
            steps=totals.steps,
            steps_by_tokens=tuple(totals.steps_by_tokens),
            step_tokens=totals.step_tokens,
            nonfinite_logits=totals.nonfinite_logits,
            out_of_memory_steps=totals.out_of_memory_steps,
            device=self._device[0],
            backend=self._device[1],
            device_memory_bytes=self._device[2],
            device_memory_reserved_bytes=int(engine.model.backend.memory_stats().get("reserved_bytes", 0)),
            counters=dict(totals.counters),
            last_step_counters=dict(stats.step.counters) if stats is not None else {},
            spec=totals.spec.copy() if engine.config.speculative is not None else None,
        )
        with self._cond:
            self._metrics = metrics


def _device_of(backend: Any) -> tuple[str, str, int]:
    """(device name, backend name, device memory bytes) from what the backend describes."""
    device = backend.describe().get("device")
    if not isinstance(device, dict):  # a backend with no device of its own (the numpy reference)
        return (backend.name, backend.name, 0)
    return (str(device.get("name", backend.name)), backend.name, int(device.get("device_local_bytes", 0) or 0))
