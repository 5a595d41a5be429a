"""Op declarations: name, signature check, numpy reference (the spec). vkrt.ops declares the
ops and dispatches them; backends add native kernels for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vkrt.core.tensor import TensorSpec
from vkrt.errors import VkrtError

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
