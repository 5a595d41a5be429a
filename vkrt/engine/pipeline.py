"""Pipeline parallelism: a model's layers split over stage processes, one Vulkan device each.

`PipelineModel` stands in for the model in the engine. Each stage process loads the file and
uploads only its layers (the first also the embedding, the last the final norm and head), keeps
the K/V of its layers, and runs its part of every step: the engine's batch (token ids, positions,
slots, block tables: the same for every stage, since every stage's pools have the engine's block
counts) and the previous stage's hidden states go in, its hidden states [T, hidden] f32 (or the
last stage's logits rows) come out, through the host. A step is one submit per stage. The engine
process holds no weights: it schedules, and samples on the numpy reference backend from the
logits the last stage returns.

Stages run one after another within a step (no micro-batching yet), so P stages hold a model P
times larger than one device, not P times the throughput.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
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
                 selectors: tuple[str, ...] = (), check_tensors: bool | None = None) -> None:
        self.config = loaded.config
        self.backend = backend  # where the engine samples: the logits come to the host anyway
        self.file_type = loaded.file_type
        why = unsplittable(self.config)
        if why is not None:
            raise UnsupportedModelError(f"{loaded.path}: cannot split this model into pipeline stages: {why}; "
                                        "run it with --pipeline-parallel-size 1")
        assert not selectors or len(selectors) == stages, "EngineConfig.validate checks this"
        specs = [StageSpec(str(loaded.path), stage, device, selectors[i] if selectors else None, check_tensors)
                 for i, stage in enumerate(split_layers(self.config.num_layers, stages))]
        self.stages: list[_StageProcess] = []
        try:
            for spec in specs:  # started together: they load at once, each on its own device
                self.stages.append(_StageProcess(len(self.stages), spec))
            for stage_process in self.stages:
                stage_process.wait_loaded()
        except BaseException:
            self.close()
            raise
        log.info("pipeline of %d stages: layers %s; %d hidden-state bytes per token between stages",
                 stages, ", ".join(f"{s.stage.start}-{s.stage.stop - 1}" for s in specs),
                 self.hidden_bytes_per_token)

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
        hidden: np.ndarray | None = None
        counters = self.backend.counters
        for stage_process in self.stages:
            hidden, done = stage_process.call("forward", batch, hidden)
            # The stages' device work counts as the step's (dispatches, submits, drains, ...), and the
            # hidden states crossing between processes as bytes down and up.
            for name, value in done.items():
                setattr(counters, name, getattr(counters, name) + value)
        assert hidden is not None
        return self.backend.upload(hidden, "f32", purpose="activations")

    def memory_stats(self) -> list[dict[str, int]]:
        """Each stage's device memory accounting."""
        return [dict(s.call("memory")) for s in self.stages]

    def close(self) -> None:
        for stage_process in self.stages:
            stage_process.close()


class _StageProcess:
    """One stage's process and the connection to it. Calls are answered in order; a stage that
    dies or fails raises here with its own words. A fresh interpreter (`python -m
    vkrt.engine.pipeline FD`), not a fork of a process that may hold a device, nor a spawn that
    would import the caller's main module again."""

    def __init__(self, index: int, spec: StageSpec) -> None:
        self.index = index
        self.spec = spec
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-m", "vkrt.engine.pipeline", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.call_async("load", spec, index)

    def wait_loaded(self) -> None:
        self._receive()

    def call_async(self, what: str, *args: Any) -> None:
        try:
            self._conn.send((what, args))
        except OSError:
            raise self._gone() from None

    def call(self, what: str, *args: Any) -> Any:
        self.call_async(what, *args)
        return self._receive()

    def _receive(self) -> Any:
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        if status == "ok":
            return payload
        kind, message = payload
        raise _ERRORS.get(kind, VkrtError)(f"pipeline stage {self.index} (layers {self.spec.stage.start}-"
                                           f"{self.spec.stage.stop - 1}): {message}")

    def _gone(self) -> DeviceLostError:
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return DeviceLostError(f"pipeline stage {self.index} (layers {self.spec.stage.start}-"
                               f"{self.spec.stage.stop - 1}) stopped (exit code {code}); restart the engine")

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


def _stage_main(conn: Connection) -> None:
    """A stage process: load the stage's part of the model, then answer calls until "close"."""
    what, (spec, index) = conn.recv()
    assert what == "load"
    if spec.selector is not None:
        os.environ["VKRT_DEVICE"] = spec.selector
    from vkrt import config
    from vkrt.backend import get_backend
    from vkrt.loader import load_model
    from vkrt.models import build_model

    logging.basicConfig(level=getattr(logging, config.log_level(), logging.WARNING),
                        format=f"vkrt [stage {index}]: %(levelname)s: %(message)s")
    try:
        model = build_model(load_model(spec.model, check_tensors=spec.check_tensors), get_backend(spec.device),
                            spec.stage)
    except Exception as exc:  # noqa: BLE001 (every failure goes back to the engine, in words)
        _answer_error(conn, exc)
        return
    conn.send(("ok", None))
    kv: KVCache | None = None
    while True:
        try:
            what, args = conn.recv()
        except (EOFError, OSError):
            return  # the engine is gone
        if what == "close":
            return
        try:
            if what == "allocate":
                kv = model.allocate_kv_cache(*args)
                conn.send(("ok", kv.nbytes))
            elif what == "forward":
                assert kv is not None, "allocate before forward"
                conn.send(("ok", _forward(model, kv, *args)))
            elif what == "memory":
                conn.send(("ok", model.backend.memory_stats()))
            else:
                raise VkrtError(f"unknown call {what!r}")
        except Exception as exc:  # noqa: BLE001
            _answer_error(conn, exc)


def _forward(model: CausalLM, kv: KVCache, batch: ForwardBatch,
             hidden: np.ndarray | None) -> tuple[np.ndarray, dict[str, int]]:
    """The stage's output for one step, and what its device did for it."""
    backend = model.backend
    before = backend.counters.snapshot()
    step = StepTensors.upload(backend, batch)
    h = None if hidden is None else backend.upload(hidden, "f32", purpose="activations")
    out = model.stage_forward(step, kv, h)
    result = np.asarray(backend.read(out), dtype=np.float32).reshape(out.shape)
    return result, backend.counters.since(before)


def _answer_error(conn: Connection, exc: BaseException) -> None:
    kind = type(exc).__name__ if isinstance(exc, VkrtError) else "VkrtError"
    message = str(exc) if isinstance(exc, VkrtError) else f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, VkrtError):
        log.error("pipeline stage failed:\n%s", traceback.format_exc())
    try:
        conn.send(("error", (kind, message)))
    except (BrokenPipeError, OSError):
        pass


if __name__ == "__main__":
    _stage_main(Connection(int(sys.argv[1])))
