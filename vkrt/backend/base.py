"""The Backend protocol: storage, kernel selection, counters."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from vkrt.core.host_weight import HostWeight
from vkrt.core.op import OpDef
from vkrt.core.quant import dequantize
from vkrt.core.tensor import (
    KV_Q8_0,
    NUMPY_DTYPES,
    Tensor,
    TensorSpec,
    host_numpy_dtype,
    is_block_format,
    storage_nbytes,
)

log = logging.getLogger("vkrt")

KernelRun = Callable[[Any, tuple[Tensor, ...], dict[str, Any], tuple[TensorSpec, ...]], tuple[Tensor, ...]]
KernelSupports = Callable[[tuple[Tensor, ...], dict[str, Any]], bool]


@dataclass(frozen=True)
class Kernel:
    """A native implementation of an op on one backend."""

    op: str
    name: str
    run: KernelRun
    priority: int = 0
    supports: KernelSupports | None = None


@dataclass
class Counters:
    """What the device did. Per step: take a snapshot before, `since(snapshot)` after."""

    dispatches: int = 0
    submits: int = 0
    fence_waits: int = 0
    drains: int = 0
    barriers: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    wait_us: int = 0  # time the host spent blocked on the device (in fence waits)
    # Replays during which the host computed the step's late inputs (structured output's token
    # masks) while the device ran the step, instead of before the submit.
    host_overlaps: int = 0
    gpu_us: int = 0  # device time of submitted work, from timestamp queries (0 where unsupported)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)

    def since(self, before: dict[str, int]) -> dict[str, int]:
        now = asdict(self)
        return {key: now[key] - before.get(key, 0) for key in now}


class Backend(ABC):
    """Where tensors live and ops run. Subclasses register native kernels per op."""

    name: str = "backend"

    def __init__(self) -> None:
        self.counters = Counters()
        self.selections: Counter[tuple[str, str]] = Counter()
        self._kernels: dict[str, list[Kernel]] = {}
        self._warned_fallback: set[str] = set()
        self._sync_hooks: list[Callable[[], None]] = []

    # -- kernels ---------------------------------------------------------------
    def register_kernel(self, kernel: Kernel) -> None:
        kernels = self._kernels.setdefault(kernel.op, [])
        kernels.append(kernel)
        kernels.sort(key=lambda k: (-k.priority, k.name))  # deterministic selection order

    def kernels(self, op: str) -> list[Kernel]:
        return list(self._kernels.get(op, ()))

    def select(self, op: str, inputs: tuple[Tensor, ...], params: dict[str, Any]) -> Kernel | None:
        for kernel in self._kernels.get(op, ()):
            if kernel.supports is None or kernel.supports(inputs, params):
                return kernel
        return None

    def execute(self, op: OpDef, inputs: tuple[Tensor, ...], params: dict[str, Any],
                out_specs: tuple[TensorSpec, ...], kernel: Kernel | None = None) -> tuple[Tensor, ...]:
        """Run op on its native kernel (`kernel`, when the caller selected it already) or the reference."""
        if kernel is None:
            kernel = self.select(op.name, inputs, params)
        if kernel is None:
            self.selections[(op.name, "reference-fallback")] += 1
            return self.fallback(op, inputs, params, out_specs)
        self.selections[(op.name, kernel.name)] += 1
        return kernel.run(self, inputs, params, out_specs)

    def fallback(self, op: OpDef, inputs: tuple[Tensor, ...], params: dict[str, Any],
                 out_specs: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        """Run the numpy reference on host copies of the inputs (a counted drain)."""
        if op.name not in self._warned_fallback:
            self._warned_fallback.add(op.name)
            log.warning("op %s has no native kernel on %s for %s; running the numpy reference "
                        "after a drain", op.name, self.name,
                        ", ".join(f"{t.dtype}{list(t.shape)}" for t in inputs))
        self.counters.drains += 1
        self.sync()
        arrays = [self.reference_array(t) for t in inputs]
        result = op.reference(*arrays, **params)
        for index in op.inplace:
            self.write(inputs[index], arrays[index])
        if not out_specs:
            return ()
        results = result if isinstance(result, tuple) else (result,)
        return tuple(self.upload(np.asarray(r), spec.dtype) for r, spec in zip(results, out_specs, strict=True))

    def reference_array(self, t: Tensor) -> np.ndarray:
        """Host copy of `t` in the form references take: block formats dequantized to f32."""
        if is_block_format(t.dtype):
            return dequantize(self.read(t), t.dtype)
        return self.read(t)

    # -- storage ---------------------------------------------------------------
    @abstractmethod
    def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Tensor:
        """A new tensor holding `array` (bf16 given as uint16 bits; block formats as uint8 rows)."""

    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: str, purpose: str = "activations") -> Tensor:
        """A new tensor with undefined contents."""

    @abstractmethod
    def write(self, t: Tensor, array: np.ndarray) -> None:
        """Overwrite the contents of `t` (same shape and dtype)."""

    @abstractmethod
    def read(self, t: Tensor) -> np.ndarray:
        """Host copy of `t` in its storage representation (block formats: uint8 rows)."""

    @abstractmethod
    def view(self, t: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A tensor of `shape` (same element count, checked by the caller) on t's storage: no
        copy, no dispatch; it keeps t's base alive and never frees the storage itself."""

    def reserve(self, purpose: str, nbytes: int) -> None:  # noqa: B027 (optional hook)
        """Hint: about `nbytes` of `purpose` tensors follow (lets a device size one block)."""

    def weight_nbytes(self, dtype: str, shape: tuple[int, ...]) -> int:
        """Bytes a weight of this format and shape occupies once uploaded."""
        return storage_nbytes(shape, dtype)

    def tensor_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        """Bytes `empty(shape, dtype)` takes from its pool (what a `reserve` for it needs)."""
        return storage_nbytes(shape, dtype)

    def upload_weight(self, array: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Tensor:
        """Upload one stored array as a weight of `shape` in storage format `dtype`."""
        return self.upload_host_weight(HostWeight.of(array, dtype, shape))

    @abstractmethod
    def upload_host_weight(self, weight: HostWeight) -> Tensor:
        """Upload a weight in its storage format (the backend may repack it, never dequantize).
        Its stacked pieces are joined as they are uploaded, never copied together first."""

    def on_sync(self, hook: Callable[[], None]) -> None:
        """Call `hook()` before every sync and before a captured step ends (the fusion layer
        registers one that runs the ops it has deferred on this backend)."""
        self._sync_hooks.append(hook)

    def run_sync_hooks(self) -> None:
        for hook in self._sync_hooks:
            hook()

    def sync(self) -> None:
        """Submit pending work and wait for it."""
        self.run_sync_hooks()

    def discard(self) -> None:  # noqa: B027 (an optional hook: nothing is queued by default)
        """Drop work recorded but not yet submitted: the step it belonged to failed (its
        results are not wanted), and the next step must not run it."""

    # Backends that can record a step once and re-submit it (see VulkanBackend.capture).
    supports_replay: bool = False

    def capture(self) -> Any:
        raise NotImplementedError(f"the {self.name} backend cannot record steps for replay")

    # Device timing. `supports_gpu_timing`: Counters.gpu_us measures device time. Profiling
    # (off by default) times every kernel; a no-op where the backend cannot.
    supports_gpu_timing: bool = False

    def enable_profiling(self, enabled: bool = True) -> bool:
        """Turn per-kernel timing on or off; returns whether it is now on."""
        return False

    def profile_commit(self, phase: str) -> None:  # noqa: B027 (a no-op unless profiling)
        """File the kernel time profiled since the last commit under `phase` (e.g. "decode")."""

    def profile_report(self, reset: bool = False) -> dict[str, Any]:
        """{"enabled", "phases": {phase: {"steps", "gpu_ms", "kernels": {name: {...}}}}}."""
        return {"enabled": False, "phases": {}}

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def describe_text(self) -> list[str]:
        """Human-readable lines about the device (for `vkrt devices`)."""
        return [f"backend: {self.name}"]

    def memory_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:  # noqa: B027 (an optional hook: nothing to release by default)
        """Release device resources."""


def as_storage_array(array: np.ndarray, dtype: str) -> np.ndarray:
    """Coerce a host array into the numpy representation of `dtype`."""
    if is_block_format(dtype):
        return np.ascontiguousarray(array, dtype=np.uint8)
    if dtype == "bf16" and array.dtype != np.uint16:
        raise TypeError("bf16 tensors are uploaded as uint16 bits (vkrt.core.quant.f32_to_bf16)")
    if dtype == KV_Q8_0 and array.dtype != np.uint32:
        raise TypeError(f"{KV_Q8_0} tensors are uploaded as their uint32 words (vkrt.core.kv_format.encode)")
    return np.ascontiguousarray(array, dtype=host_numpy_dtype(dtype))


def infer_dtype(array: np.ndarray) -> str:
    for name, np_type in NUMPY_DTYPES.items():
        if name != "bf16" and array.dtype == np_type:
            return name
    if array.dtype == np.float64:
        return "f32"
    if array.dtype == np.int64:
        return "i32"
    raise TypeError(f"no vkrt dtype for numpy {array.dtype}; pass dtype=")
