"""Peephole fusion: model files call primitive ops, backends run the fused kernels they have.

`matmul`, `rms_norm` and `rms_norm_matmul` do not run when dispatched: they return a
*pending* tensor (see `Tensor.pending`). The op that consumes it may fold the producer into
one fused op, if the backend has a kernel for that call:

    matmul(rms_norm(x, g), w)                 -> rms_norm_matmul(x, g, w)
    silu_and_mul(matmul(x, w))                -> matmul_silu_and_mul(x, w)
    gelu_tanh_and_mul(matmul(x, w))           -> matmul_gelu_tanh_and_mul(x, w)
    silu_and_mul(rms_norm_matmul(x, g, w))    -> rms_norm_matmul(x, g, w, gated=True)
      (and gelu_tanh_and_mul likewise, with activation="gelu_tanh")
    silu_and_mul(moe_matmul(x, w, ids))       -> moe_matmul_gated(x, w, ids)  (gelu_tanh likewise)
    scale(matmul(x, w), s)                    -> matmul(x, w, scale=s)  (still pending)
    add(matmul(x, w[, scale]), r)  (either order) -> matmul_add(x, w, r[, scale])
    add(rms_norm_matmul(x, g, w), r)  (either order) -> rms_norm_matmul_add(x, g, w, r)
      (r [T, N] or a bias [N], as add takes it: Qwen2's q/k/v bias joins the projection)
    add(rms_norm(x, g), r)  (either order)    -> rms_norm_add(x, g, r)
    qkv_rope_kv_write(rms_norm_matmul(...))   -> rms_norm_qkv_rope_kv_write(...)

Anything else that touches a pending tensor's storage (another op, a read, a write) runs
the producer first (`Tensor.handle` realises it: the one door to a tensor's storage). Each
backend's pending tensors are its own: the first deferral on a backend registers a sync hook
(`Backend.on_sync`) that runs that backend's pending tensors still alive, which the backend
calls before it syncs and before a captured step ends, so nothing pending escapes a recording.
A pending tensor nobody touches is never computed. A producer folded into a consumer and also
used elsewhere runs again there: correct, only slower. The kernel a fold was checked against
is the one that runs: `Kernel.supports` is asked once per fused call.

This is safe because the deferred ops read only activations and weights, which no op
mutates in place (in-place ops write KV caches only): running a producer later than it was
dispatched reads the same bytes. Each fused op is equal to its composition (bit-identical,
except the norm folding's rounding, bounded and tested in tests/ops), so fusion changes
which kernels run, not what the model means.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vkrt.core.op import OPS
from vkrt.core.tensor import Tensor, TensorBackend, TensorSpec

Call = tuple[str, tuple[Tensor, ...], dict[str, Any]]

# Producers whose result may be folded into the op that consumes it.
DEFERRED_OPS = frozenset({"matmul", "rms_norm", "rms_norm_matmul", "moe_matmul"})

_dispatch_order = itertools.count()
_disabled = 0


class _Deferred:
    """One backend's pending tensors (weakly held: one nobody can touch is never run)."""

    def __init__(self) -> None:
        self.pending: weakref.WeakSet[Tensor] = weakref.WeakSet()

    def flush(self) -> None:
        """Run every pending tensor still alive, oldest first (their order of dispatch)."""
        for tensor in sorted(self.pending, key=lambda t: t.pending.seq if isinstance(t.pending, Pending) else -1):
            if tensor.pending is not None:
                tensor.pending.realize(tensor)


_states: weakref.WeakKeyDictionary[TensorBackend, _Deferred] = weakref.WeakKeyDictionary()


def _state(backend: TensorBackend) -> _Deferred:
    state = _states.get(backend)
    if state is None:
        state = _states[backend] = _Deferred()
        backend.on_sync(state.flush)
    return state


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run ops exactly as called inside the block: no deferral, no folding (tests compare a
    fused kernel with the unfused ops it replaces this way)."""
    global _disabled
    flush()
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def enabled() -> bool:
    return _disabled == 0


@dataclass
class Pending:
    """An op dispatched but not run yet; `realize` runs it into the tensor that stands for it
    (with `kernel`, when a fold has chosen it already)."""

    op: str
    inputs: tuple[Tensor, ...]
    params: dict[str, Any]
    spec: TensorSpec
    kernel: Any = None
    seq: int = field(default_factory=lambda: next(_dispatch_order))

    def realize(self, tensor: Tensor) -> None:
        tensor.pending = None
        backend = self.inputs[0].backend
        _state(backend).pending.discard(tensor)
        (real,) = backend.execute(OPS[self.op], self.inputs, self.params, (self.spec,), self.kernel)
        tensor.handle = real.handle
        tensor.base = real  # owns the storage (its finaliser frees it)


def defer(op: str, inputs: tuple[Tensor, ...], params: dict[str, Any], spec: TensorSpec,
          kernel: Any = None) -> Tensor:
    """A pending tensor standing for op(inputs) with output `spec`."""
    backend = inputs[0].backend
    tensor = Tensor(spec.shape, spec.dtype, backend, None)
    tensor.pending = Pending(op, inputs, params, spec, kernel)
    _state(backend).pending.add(tensor)
    return tensor


def flush(backend: TensorBackend | None = None) -> None:
    """Run the pending tensors of `backend` (None: of every backend)."""
    states = list(_states.values()) if backend is None else [_states[backend]] if backend in _states else []
    for state in states:
        state.flush()


def _producer(t: Tensor, op: str) -> Pending | None:
    p = t.pending
    return p if isinstance(p, Pending) and p.op == op else None


def _fold_matmul(x: Tensor, w: Tensor) -> Call | None:
    norm = _producer(x, "rms_norm")
    if norm is None:
        return None
    h, g = norm.inputs
    return "rms_norm_matmul", (h, g, w), {"eps": norm.params["eps"], "gated": False}


def _unscaled_matmul(t: Tensor) -> Pending | None:
    mm = _producer(t, "matmul")
    return mm if mm is not None and mm.params.get("scale", 1.0) == 1.0 else None


def _fold_gated(activation: str, fused: str) -> Callable[[Tensor], Call | None]:
    def rule(y: Tensor) -> Call | None:
        mm = _unscaled_matmul(y)
        if mm is not None:
            return fused, mm.inputs, {}
        nm = _producer(y, "rms_norm_matmul")
        if nm is not None and not nm.params["gated"]:
            return "rms_norm_matmul", nm.inputs, {**nm.params, "gated": True, "activation": activation}
        return _fold_moe_gated(y, activation)
    return rule


def _fold_moe_gated(y: Tensor, activation: str) -> Call | None:
    """The activation of a MoE layer's gate|up expert matmul, folded into its epilogue."""
    mm = _producer(y, "moe_matmul")
    return ("moe_matmul_gated", mm.inputs, {"activation": activation}) if mm is not None else None


def _fold_scale(x: Tensor, factor: float) -> Call | None:
    mm = _unscaled_matmul(x)  # one product, as scale rounds it: never two scales folded into one
    return ("matmul", mm.inputs, {"scale": factor}) if mm is not None else None


def _fold_add(a: Tensor, b: Tensor) -> Call | None:
    for branch, residual in ((a, b), (b, a)):
        if residual.dtype != "f32" or residual.shape not in (branch.shape, branch.shape[-1:]):
            continue  # a residual of the branch's shape or a bias row: what the fused epilogue adds
        mm = _producer(branch, "matmul")
        if mm is not None:
            return "matmul_add", (*mm.inputs, residual), dict(mm.params)
        nm = _producer(branch, "rms_norm_matmul")
        if nm is not None and not nm.params["gated"]:
            return "rms_norm_matmul_add", (*nm.inputs, residual), {"eps": nm.params["eps"]}
    for branch, residual in ((a, b), (b, a)):
        norm = _producer(branch, "rms_norm")
        if norm is not None and residual.shape == branch.shape and residual.dtype == "f32":
            return "rms_norm_add", (*norm.inputs, residual), dict(norm.params)
    return None


def _fold_qkv_rope_kv_write(qkv: Tensor, *rest: Tensor, **params: Any) -> Call | None:
    nm = _producer(qkv, "rms_norm_matmul")
    if nm is None or nm.params["gated"]:
        return None
    return ("rms_norm_qkv_rope_kv_write", (*nm.inputs, *rest), {"eps": nm.params["eps"], **params})


FOLDS: dict[str, Callable[..., Call | None]] = {
    "matmul": _fold_matmul,
    "silu_and_mul": _fold_gated("silu", "matmul_silu_and_mul"),
    "gelu_tanh_and_mul": _fold_gated("gelu_tanh", "matmul_gelu_tanh_and_mul"),
    "scale": _fold_scale,
    "add": _fold_add,
    "qkv_rope_kv_write": _fold_qkv_rope_kv_write,
}


def fold(op: str, inputs: tuple[Tensor, ...], params: dict[str, Any]) -> tuple[Call, Any] | None:
    """The fused call that replaces op(inputs) on this backend and the kernel that runs it, or None."""
    rule = FOLDS.get(op)
    if rule is None:
        return None
    call = rule(*inputs, **params)
    if call is None:
        return None
    name, fused_inputs, fused_params = call
    kernel = inputs[0].backend.select(name, fused_inputs, fused_params)
    if kernel is None:
        return None  # no native kernel takes it: run the unfused ops natively instead
    return call, kernel
