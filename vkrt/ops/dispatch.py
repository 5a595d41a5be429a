"""`dispatch`: validate an op call and run it on the backend its inputs live on, through the
fusion layer (vkrt.ops.fusion), which may defer it or fold it into a fused op."""

from __future__ import annotations

from typing import Any

from vkrt.core.op import OPS, OpError
from vkrt.core.tensor import Tensor
from vkrt.ops import fusion


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
    kernel = None  # chosen by the backend at execute, unless a fold chose it
    if fusion.enabled():
        fused = fusion.fold(name, inputs, params)
        if fused is not None:  # the fused op has the same outputs as the one it replaces
            (name, inputs, params), kernel = fused
            opdef = OPS[name]
        if name in fusion.DEFERRED_OPS:
            return fusion.defer(name, inputs, params, out_specs[0], kernel)
    outputs = backend.execute(opdef, inputs, params, out_specs, kernel)
    if not out_specs:
        return None  # a purely in-place op
    return outputs[0] if len(outputs) == 1 else outputs
