"""Pipeline parallelism: a model's layers split over stage processes, one Vulkan device each.

`PipelineModel` stands in for the model in the engine. Each stage process loads the file and
uploads only its layers (the first also the embedding, the last the final norm and head), keeps
the K/V of its layers, and runs its part of every step: the engine's batch (token ids, positions,
slots, block tables: the same for every stage, since every stage's pools have the engine's block
counts) and the previous stage's hidden states go in, its hidden states [T, hidden] f32 (or the
last stage's logits rows) come out, through the host. The engine process holds no weights: it
schedules, and samples on the numpy reference backend from the logits the last stage returns.

Micro-batches keep the stages busy at once: a step of several sequences is cut into up to M
runs of consecutive sequences (`micro_batches`, default P); stage 0 starts the second while
stage 1 runs the first, and so on, so a step costs about (M + P - 1) / M stage times instead of
P. Every kernel is batch-invariant (a row's bits do not depend on the rows beside it), so the
output is the same bits as one step. Each micro-batch is one submit per stage.

A stage is a local process (`python -m vkrt.engine.pipeline FD`, the default) or, with
`executor="ray"`, a Ray actor placed by a placement group that spreads the stages over the
cluster's nodes, one device each: the same calls, pickled the same way.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from vkrt import errors
from vkrt.backend.base import Backend
from vkrt.core.tensor import Tensor
from vkrt.errors import DeviceLostError, UnsupportedModelError, VkrtError
from vkrt.loader.config import LoadedModel
from vkrt.models import (
    CausalLM,
    ForwardBatch,
    KVCache,
    Stage,
    StepTensors,
    split_layers,
    unsplittable,
)

log = logging.getLogger("vkrt")

# Errors a stage reports by name are raised again as the same class here, so the engine treats a
# stage's lost device or full memory as its own.
_ERRORS = {cls.__name__: cls for cls in (errors.DeviceLostError, errors.OutOfDeviceMemory,
                                         errors.ModelFormatError, errors.UnsupportedModelError,
                                         errors.VkrtError)}


@dataclass(frozen=True)
class StageSpec:
    """What one stage process loads and where."""

    model: str
    stage: Stage
    device: str  # "vulkan" | "reference" | "auto"
    selector: str | None  # VKRT_DEVICE for the stage's process (None: the process's own)
    check_tensors: bool | None


class PipelineKVCache(KVCache):
    """The engine's view of a cache whose tensors live in the stages: counts and sizes only."""

    def __init__(self, kv_bytes: int, num_blocks: list[int], block_size: int, dtype: str, groups: list[Any],
                 layer_group: list[int]) -> None:
        super().__init__({}, {}, num_blocks, block_size, dtype, groups, layer_group)
        self._kv_bytes = kv_bytes

    @property
    def nbytes(self) -> int:
        return self._kv_bytes


class PipelineModel(CausalLM):
    """The model for an engine whose layers run in `len(stages)` stage processes."""

    replayable = False  # a step crosses processes: each stage runs its part eagerly (one submit)

    def __init__(self, loaded: LoadedModel, backend: Backend, stages: int, device: str = "auto",
                 selectors: tuple[str, ...] = (), check_tensors: bool | None = None, *,
                 micro_batches: int | None = None, executor: str = "mp", ray_address: str | None = None) -> None:
        self.config = loaded.config
        self.micro_batches = stages if micro_batches is None else micro_batches
        self.backend = backend  # where the engine samples: the logits come to the host anyway
        self.file_type = loaded.file_type
        why = unsplittable(self.config)
        if why is not None:
            raise UnsupportedModelError(f"{loaded.path}: cannot split this model into pipeline stages: {why}; "
                                        "run it with --pipeline-parallel-size 1")
        assert not selectors or len(selectors) == stages, "EngineConfig.validate checks this"
        specs = [StageSpec(str(loaded.path), stage, device, selectors[i] if selectors else None, check_tensors)
                 for i, stage in enumerate(split_layers(self.config.num_layers, stages))]
        self.stages: list[_Stage] = []
        try:
            if executor == "ray":
                from vkrt.engine.pipeline_ray import ray_stages

                self.stages = ray_stages(specs, ray_address)
            elif executor == "mp":
                for spec in specs:  # started together: they load at once, each on its own device
                    self.stages.append(_StageProcess(len(self.stages), spec))
            else:
                raise VkrtError(f"--distributed-executor-backend must be mp or ray, got {executor!r}")
            for stage in self.stages:
                stage.receive()  # each one's "load"
        except BaseException:
            self.close()
            raise
        log.info("pipeline of %d stages (%s): layers %s; %d hidden-state bytes per token between stages; "
                 "up to %d micro-batches per step", stages, executor,
                 ", ".join(f"{s.stage.start}-{s.stage.stop - 1}" for s in specs), self.hidden_bytes_per_token,
                 self.micro_batches)

    @property
    def hidden_bytes_per_token(self) -> int:
        """Bytes one token's hidden state takes from one stage to the next (f32)."""
        return 4 * self.config.hidden_size

    def allocate_kv_cache(self, num_blocks: int | Sequence[int], block_size: int = 16, dtype: str = "f32",
                          max_len: int | None = None, state_slots: int = 1) -> KVCache:
        """Each stage's pools for its layers, the engine's block counts in every stage."""
        self.check_kv_dtype(dtype)
        kv_bytes = sum(int(s.call("allocate", num_blocks, block_size, dtype, max_len, state_slots))
                       for s in self.stages)
        return PipelineKVCache(kv_bytes, self._pool_sizes(num_blocks), block_size, dtype, self.kv_groups(),
                               self.layer_groups())

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        batch = step.batch
        assert batch is not None, "a pipeline runs steps eagerly, from the batch's host arrays"
        parts = micro_batches(batch, self.micro_batches)
        outputs = self._run(parts)
        logits = np.concatenate([out[:len(out) - drop] for out, (_, drop) in zip(outputs, parts, strict=True)])
        return self.backend.upload(logits, "f32", purpose="activations")

    def forward_pooled(self, step: StepTensors, kv: KVCache, hidden_index: Tensor,
                       hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A step with pooling rows runs whole; the last stage sends back the logits rows and the
        final-norm hidden states of the rows in `step.batch.hidden_index`."""
        batch = step.batch
        assert batch is not None and batch.hidden_index is not None
        ((logits, normed),) = self._run([(batch, 0)])
        return (self.backend.upload(logits, "f32", purpose="activations"),
                self.backend.upload(normed, "f32", purpose="activations"))

    def _run(self, parts: list[tuple[ForwardBatch, int]]) -> list[Any]:
        """Each micro-batch through every stage in order; a stage takes the next micro-batch as
        soon as it has given the previous one on, so the stages work at once. Returns the last
        stage's output of each."""
        counters = self.backend.counters
        outputs: list[Any] = [None] * len(parts)
        waiting: dict[int, deque[int]] = {i: deque() for i in range(len(self.stages))}  # micro-batches sent
        failure: BaseException | None = None
        for m, (part, _) in enumerate(parts):
            self.stages[0].send("forward", part, None)
            waiting[0].append(m)
        while any(waiting.values()):
            for i in _ready([self.stages[i] for i, sent in waiting.items() if sent]):
                m = waiting[i].popleft()
                try:
                    hidden, done = self.stages[i].receive()
                except DeviceLostError:
                    raise  # a stage is gone: nothing more will come from it
                except VkrtError as exc:  # the rest still answer, in order: collect them, then raise
                    failure = failure or exc
                    continue
                # The stages' device work counts as the step's (dispatches, submits, drains, ...).
                for name, value in done.items():
                    setattr(counters, name, getattr(counters, name) + value)
                if failure is not None:
                    continue
                if i + 1 < len(self.stages):
                    self.stages[i + 1].send("forward", parts[m][0], hidden)
                    waiting[i + 1].append(m)
                else:
                    outputs[m] = hidden
        if failure is not None:
            raise failure
        assert all(out is not None for out in outputs)
        return outputs

    def memory_stats(self) -> list[dict[str, int]]:
        """Each stage's device memory accounting."""
        return [dict(s.call("memory")) for s in self.stages]

    def nodes(self) -> list[str]:
        """Where each stage runs: its host name and process id."""
        return [str(s.call("where")) for s in self.stages]

    def close(self) -> None:
        for stage_process in self.stages:
            stage_process.close()


def micro_batches(batch: ForwardBatch, most: int) -> list[tuple[ForwardBatch, int]]:
    """`batch` cut into min(`most`, its sequences) runs of consecutive sequences with about as many
    tokens each, and for each how many trailing logits rows are filler (a part with none of the
    step's logits rows still makes one, of its last token). Concatenating the parts' logits rows without their
    filler gives the step's. A step with pooling rows stays whole."""
    parts = min(most, batch.num_seqs)
    rows = batch.logits_index
    if parts <= 1 or batch.hidden_index is not None or np.any(np.diff(rows) < 0):
        return [(batch, 0)]
    start = batch.seq_start
    # cut after the sequence where the running token count first reaches each k/parts of the total,
    # each part keeping at least one sequence
    bounds = [0]
    for k in range(1, parts):
        cut = int(np.searchsorted(start[1:], start[-1] * k / parts, side="left")) + 1
        bounds.append(min(max(cut, bounds[-1] + 1), batch.num_seqs - (parts - k)))
    bounds.append(batch.num_seqs)
    out = []
    for s0, s1 in zip(bounds, bounds[1:], strict=False):
        t0, t1 = int(start[s0]), int(start[s1])
        mine = rows[(rows >= t0) & (rows < t1)] - t0
        drop = 0 if len(mine) else 1
        if drop:
            mine = np.array([t1 - t0 - 1])
        seqs = slice(s0, s1)
        out.append((replace(
            batch, token_ids=batch.token_ids[t0:t1], positions=batch.positions[t0:t1],
            seq_index=batch.seq_index[t0:t1] - s0, slots=batch.slots[..., t0:t1],
            block_tables=batch.block_tables[..., seqs, :], logits_index=mine.astype(np.int32),
            # without state_slots sequence s uses slot s: each part keeps its sequences' own
            state_slots=(np.arange(s0, s1, dtype=np.int32) if batch.state_slots is None
                         else batch.state_slots[seqs])), drop))
    return out


class _Stage:
    """One stage and the way to it. Calls are answered in order; a stage that dies or fails
    raises here with its own words."""

    index: int
    spec: StageSpec

    def send(self, what: str, *args: Any) -> None:
        raise NotImplementedError

    def receive(self) -> Any:
        raise NotImplementedError

    def call(self, what: str, *args: Any) -> Any:
        self.send(what, *args)
        return self.receive()

    def close(self) -> None:
        raise NotImplementedError

    def _name(self) -> str:
        return f"pipeline stage {self.index} (layers {self.spec.stage.start}-{self.spec.stage.stop - 1})"

    def _answer(self, status: str, payload: Any) -> Any:
        if status == "ok":
            return payload
        kind, message = payload
        raise _ERRORS.get(kind, VkrtError)(f"{self._name()}: {message}")


def _ready(stages: list[_Stage]) -> list[int]:
    """The indices of the stages among `stages` whose next answer has arrived (blocks until one has)."""
    if isinstance(stages[0], _StageProcess):
        conns = {id(s._conn): s.index for s in stages if isinstance(s, _StageProcess)}
        return sorted(conns[id(c)] for c in wait([s._conn for s in stages if isinstance(s, _StageProcess)]))
    from vkrt.engine.pipeline_ray import ready

    return ready(stages)


class _StageProcess(_Stage):
    """A stage in a local process. A fresh interpreter (`python -m vkrt.engine.pipeline FD`), not
    a fork of a process that may hold a device, nor a spawn that would import the caller's main
    module again."""

    def __init__(self, index: int, spec: StageSpec) -> None:
        self.index = index
        self.spec = spec
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-m", "vkrt.engine.pipeline", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.send("load", spec, index)

    def send(self, what: str, *args: Any) -> None:
        try:
            self._conn.send((what, args))
        except OSError:
            raise self._gone() from None

    def receive(self) -> Any:
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        return self._answer(status, payload)

    def _gone(self) -> DeviceLostError:
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return DeviceLostError(f"{self._name()} stopped (exit code {code}); restart the engine")

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._conn.send(("close", ()))
            except OSError:
                pass
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._conn.close()


class StageServer:
    """A stage's side: the model's layers of one stage on this process's device, and the calls
    the engine makes of it ("allocate", "forward", "memory", "where"). Each answer is ("ok",
    payload) or ("error", (kind, message)), for a local process and a Ray actor alike."""

    def __init__(self) -> None:
        self.model: CausalLM | None = None
        self.kv: KVCache | None = None

    def load(self, spec: StageSpec, index: int) -> tuple[str, Any]:
        if spec.selector is not None:
            os.environ["VKRT_DEVICE"] = spec.selector
        from vkrt import config
        from vkrt.backend import get_backend
        from vkrt.loader import load_model
        from vkrt.models import build_model

        logging.basicConfig(level=getattr(logging, config.log_level(), logging.WARNING),
                            format=f"vkrt [stage {index}]: %(levelname)s: %(message)s")
        try:
            self.model = build_model(load_model(spec.model, check_tensors=spec.check_tensors),
                                     get_backend(spec.device), spec.stage)
        except Exception as exc:  # noqa: BLE001 (every failure goes back to the engine, in words)
            return _error(exc)
        return ("ok", None)

    def handle(self, what: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        try:
            model = self.model
            assert model is not None, "load before anything else"
            if what == "allocate":
                self.kv = model.allocate_kv_cache(*args)
                return ("ok", self.kv.nbytes)
            if what == "forward":
                assert self.kv is not None, "allocate before forward"
                return ("ok", _forward(model, self.kv, *args))
            if what == "memory":
                return ("ok", model.backend.memory_stats())
            if what == "where":
                return ("ok", f"{socket.gethostname()} pid {os.getpid()}")
            raise VkrtError(f"unknown call {what!r}")
        except Exception as exc:  # noqa: BLE001
            return _error(exc)


def _stage_main(conn: Connection) -> None:
    """A stage process: load the stage's part of the model, then answer calls until "close". A
    thread takes the calls off the socket as they come, so the engine never waits to send the
    next micro-batch while this stage sends its answer to the last one."""
    what, (spec, index) = conn.recv()
    assert what == "load"
    server = StageServer()
    answer = server.load(spec, index)
    conn.send(answer)
    if answer[0] != "ok":
        return
    calls: queue.SimpleQueue[tuple[str, tuple[Any, ...]] | None] = queue.SimpleQueue()

    def take() -> None:
        while True:
            try:
                calls.put(conn.recv())
            except (EOFError, OSError):
                calls.put(None)  # the engine is gone
                return

    threading.Thread(target=take, name="vkrt-stage-calls", daemon=True).start()
    while True:
        call = calls.get()
        if call is None or call[0] == "close":
            return
        try:
            conn.send(server.handle(*call))
        except (BrokenPipeError, OSError):
            return


def _forward(model: CausalLM, kv: KVCache, batch: ForwardBatch,
             hidden: np.ndarray | None) -> tuple[Any, dict[str, int]]:
    """The stage's output for one step (the last stage's for a step with pooling rows: its logits
    and the rows' final-norm hidden states), and what its device did for it."""
    backend = model.backend
    before = backend.counters.snapshot()
    step = StepTensors.upload(backend, batch)
    h = None if hidden is None else backend.upload(hidden, "f32", purpose="activations")

    def host(t: Tensor) -> np.ndarray:
        return np.asarray(backend.read(t), dtype=np.float32).reshape(t.shape)

    stage = getattr(model, "stage", None)
    if batch.hidden_index is not None and (stage is None or stage.last):
        index = backend.upload(batch.hidden_index, "i32", purpose="inputs")
        logits, normed = model.forward_pooled(step, kv, index, h)
        return (host(logits), host(normed)), backend.counters.since(before)
    return host(model.stage_forward(step, kv, h)), backend.counters.since(before)


def _error(exc: BaseException) -> tuple[str, tuple[str, str]]:
    kind = type(exc).__name__ if isinstance(exc, VkrtError) else "VkrtError"
    message = str(exc) if isinstance(exc, VkrtError) else f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, VkrtError):
        log.error("pipeline stage failed:\n%s", traceback.format_exc())
    return ("error", (kind, message))


if __name__ == "__main__":
    _stage_main(Connection(int(sys.argv[1])))
