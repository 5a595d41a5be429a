"""Op declarations: name, signature check, numpy reference. Backends add native kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vkrt.errors import VkrtError
from vkrt.ops import fusion
from vkrt.ops.tensor import Tensor, TensorSpec

InferFn = Callable[..., tuple[TensorSpec, ...]]


@dataclass(frozen=True)
class OpDef:
    """One op. `reference` is the spec: numpy in, numpy out (a tuple when several).

    `infer(*input_specs, **params)` validates the call and returns the output specs.
    `inplace` names input positions the op mutates (e.g. the KV cache of kv_write). Such an
    op returns nothing unless `infer` gives output specs; then it returns those outputs too
    (qkv_rope_kv_write writes the cache and returns q).
    """

    name: str
    reference: Callable[..., Any]
    infer: InferFn
    inplace: tuple[int, ...] = ()
    doc: str = ""


OPS: dict[str, OpDef] = {}


class OpError(VkrtError):
    """An op was called with shapes, dtypes or parameters it does not accept."""


def register_op(name: str, infer: InferFn, inplace: tuple[int, ...] = ()) -> Callable:
    """Decorator on the numpy reference of a new op."""

    def wrap(reference: Callable[..., Any]) -> Callable[..., Any]:
        if name in OPS:
            raise ValueError(f"op {name!r} declared twice")
        doc = (reference.__doc__ or "").strip().splitlines()
        OPS[name] = OpDef(name, reference, infer, inplace, doc[0] if doc else "")
        return reference

    return wrap


def require(cond: bool, op: str, specs: tuple[TensorSpec, ...], what: str) -> None:
    """Raise OpError naming the op, the shapes it got and what is wrong."""
    if not cond:
        got = ", ".join(f"{s.dtype}{list(s.shape)}" for s in specs)
        raise OpError(f"{op}: {what} (got {got})")


def dispatch(name: str, *inputs: Tensor, **params: Any) -> Any:
    """Validate and run op `name` on the backend its inputs live on."""
    opdef = OPS[name]
    if not inputs:
        raise OpError(f"{name}: no input tensors")
    backend = inputs[0].backend
    for t in inputs:
        if not isinstance(t, Tensor):
            raise OpError(f"{name}: inputs must be Tensors, got {type(t).__name__}")
        if t.backend is not backend:
            raise OpError(f"{name}: inputs live on different backends ({backend.name}, {t.backend.name})")
    out_specs = opdef.infer(*[t.spec for t in inputs], **params)
    if fusion.enabled():
        fused = fusion.fold(name, inputs, params)
        if fused is not None:  # the fused op has the same outputs as the one it replaces
            name, inputs, params = fused
            opdef = OPS[name]
        if name in fusion.DEFERRED_OPS:
            return fusion.defer(name, inputs, params, out_specs[0])
    outputs = backend.execute(opdef, inputs, params, out_specs)
    if not out_specs:
        return None  # a purely in-place op
    return outputs[0] if len(outputs) == 1 else outputs
