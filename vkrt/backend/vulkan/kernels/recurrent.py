"""The recurrent mixers' kernels: causal_conv1d and short_conv (shaders/causal_conv1d.comp, an
invocation per (sequence, channel)), gated_delta_net (shaders/gated_delta_net.comp, an invocation
per (sequence, value head, state column)), ssm_scan (shaders/ssm_scan.comp, an invocation per
(sequence, head, state row)); copy_state_slots, one buffer copy of a region per slot (no shader)."""

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


MAX_KEY_DIM = 256  # the delta net's state column in registers (gated_delta_net.comp)
# The delta net and the scan read their state slot through a second, read-only binding of the same
# tensor (texel on CPU devices, where a storage-buffer load costs many texel loads) and write it
# through the storage buffer; each invocation reads its own state before it writes it, so the
# two views never race (measured: a Qwen3.5-shaped decode call, 16 value heads of 128 x 128,
# went from ~9 ms to ~5 ms on llvmpipe).


def _gated_delta_net(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                     out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    qkv, ba, a_rate, dt_bias, state, seq_start, positions, state_slots = inputs
    seqs, v_heads, dv = state_slots.shape[0], params["num_v_heads"], params["v_head_dim"]
    o = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "gated_delta_net"),
                       [(qkv, "f32", False), (ba, "f32", False), (a_rate, "f32", False), (dt_bias, "f32", False),
                        (state, "f32", True), (seq_start, "i32", False), (positions, "i32", False),
                        (state_slots, "i32", False), (o, "f32", True), (state, "f32", False)],
                       grid_1d(seqs * v_heads * dv), ("<5If", (seqs, params["num_k_heads"], v_heads, dv, int(params.get("tiled_heads", False)),
                                  params.get("beta_scale", 1.0))),
                       local_size() | {1: params["k_head_dim"]})
    return (o,)


MAX_STATE_SIZE = 256  # a row of Mamba2's state in registers (ssm_scan.comp)


def _ssm_scan(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
              out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    xbc, dt, a_rate, skip, dt_bias, state, seq_start, positions, state_slots = inputs
    seqs, heads, head_dim = state_slots.shape[0], params["num_heads"], params["head_dim"]
    y = backend.empty(out[0].shape, "f32")
    push = (seqs, heads, head_dim, params["n_groups"], params.get("dt_min", 0.0),
            min(params.get("dt_max", float("inf")), 3.4e38))  # an f32 push constant: inf as the largest float
    backend.run_shader(module(backend, "ssm_scan"),
                       [(xbc, "f32", False), (dt, "f32", False), (a_rate, "f32", False), (skip, "f32", False),
                        (dt_bias, "f32", False), (state, "f32", True), (seq_start, "i32", False),
                        (positions, "i32", False), (state_slots, "i32", False), (y, "f32", True),
                        (state, "f32", False)],
                       grid_1d(seqs * heads * head_dim), ("<4I2f", push), local_size() | {1: params["state_size"]})
    return (y,)


def _copy_state_slots(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                      out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (state,) = inputs
    size = state.nbytes // state.shape[0]  # one slot's bytes ([slots, ...] is contiguous f32)
    backend.copy_regions(state, state, [(s * size, d * size, size) for s, d in zip(params["src"], params["dst"],
                                                                                  strict=True)])
    return ()


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("causal_conv1d", "causal_conv1d.plain", _conv("plain")))
    backend.register_kernel(Kernel("short_conv", "causal_conv1d.gated", _conv("gated")))
    backend.register_kernel(Kernel("gated_delta_net", "gated_delta_net", _gated_delta_net,
                                   supports=lambda inputs, params: params["k_head_dim"] <= MAX_KEY_DIM))
    backend.register_kernel(Kernel("ssm_scan", "ssm_scan", _ssm_scan,
                                   supports=lambda inputs, params: params["state_size"] <= MAX_STATE_SIZE))
    backend.register_kernel(Kernel("copy_state_slots", "copy_state_slots.buffer_copy", _copy_state_slots))
