"""causal_conv1d and short_conv: shaders/causal_conv1d.comp, an invocation per (sequence, channel)."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import Tensor, TensorSpec


def _conv(form: str):
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        x, w, bias, state, seq_start, positions, state_slots = inputs
        seqs, channels = state_slots.shape[0], w.shape[0]
        y = backend.empty(out[0].shape, "f32")
        spec = local_size() | {1: w.shape[1], 2: int(params.get("activation", "") == "silu")}
        backend.run_shader(module(backend, "causal_conv1d", form),
                           [(x, "f32", False), (w, "f32", False), (bias, "f32", False), (state, "f32", True),
                            (seq_start, "i32", False), (positions, "i32", False), (state_slots, "i32", False),
                            (y, "f32", True)],
                           grid_1d(seqs * channels), ("<2I", (seqs, channels)), spec)
        return (y,)
    return run


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("causal_conv1d", "causal_conv1d.plain", _conv("plain")))
    backend.register_kernel(Kernel("short_conv", "causal_conv1d.gated", _conv("gated")))
