"""Recurrent mixers' ops: the depthwise causal convolution with its carried state, for now.

A recurrent layer keeps a fixed-size state per sequence in a pool of slots (the engine hands
each running sequence one slot, `state_slots[s]`), updated in place on the device. Ops are
batch-shaped as attention is: sequence s of the step owns tokens seq_start[s] ..
seq_start[s + 1] - 1, consecutive positions from positions[seq_start[s]]. A sequence whose
first token is at position 0 starts from a zero state, whatever its slot held, so a slot needs
no clearing when it is reused and a preempted sequence recomputes from nothing; otherwise its
slot holds the state the previous step of that sequence left (chunked prefill, decode).

The conv state is the layer's last K - 1 inputs, [slots, C, K - 1]: y[t, c] = sum over j of
w[c, j] * in(p - K + 1 + j) + bias[c], in(q) the input at position q (0 before the first).
"""

from __future__ import annotations

import numpy as np

from vkrt.core.op import register_op, require
from vkrt.core.tensor import TensorSpec

CONV_ACTIVATIONS = ("", "silu")
MAX_CONV_KERNEL = 8  # taps the kernels hold in registers (real models: 3 or 4)


def _conv_infer(name: str, x: TensorSpec, w: TensorSpec, bias: TensorSpec, state: TensorSpec,
                seq_start: TensorSpec, positions: TensorSpec, state_slots: TensorSpec,
                channels: int) -> tuple[TensorSpec, ...]:
    specs = (x, w, bias, state, seq_start, positions, state_slots)
    require(x.dtype == "f32" and len(x.shape) == 2, name, specs, "x must be f32 [T, channels]")
    require(w.dtype == "f32" and len(w.shape) == 2 and w.shape[0] == channels and 2 <= w.shape[1] <= MAX_CONV_KERNEL,
            name, specs, f"weight must be f32 [channels, K] with 2 <= K <= {MAX_CONV_KERNEL}")
    require(bias.dtype == "f32" and bias.shape == (channels,), name, specs, "bias must be f32 [channels]")
    require(state.dtype == "f32" and len(state.shape) == 3 and state.shape[1:] == (channels, w.shape[1] - 1),
            name, specs, "state must be f32 [slots, channels, K - 1]")
    require(positions.dtype == "i32" and positions.shape == (x.shape[0],), name, specs, "positions must be i32 [T]")
    require(seq_start.dtype == "i32" and state_slots.dtype == "i32" and len(seq_start.shape) == 1
            and state_slots.shape == (seq_start.shape[0] - 1,), name, specs,
            "seq_start must be i32 [S + 1] and state_slots i32 [S]")
    return (TensorSpec((x.shape[0], channels), "f32"),)


def _conv_rows(inputs: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray, seq_start: np.ndarray,
               positions: np.ndarray, state_slots: np.ndarray) -> np.ndarray:
    """The convolution of `inputs` [T, C] (updating `state`), in f32: taps in order, then bias."""
    taps = w.shape[1]
    y = np.zeros(inputs.shape, np.float32)
    for s in range(state_slots.shape[0]):
        t0, t1 = int(seq_start[s]), int(seq_start[s + 1])
        if t1 <= t0:
            continue
        slot = int(state_slots[s])
        window = state[slot] if positions[t0] > 0 else np.zeros_like(state[slot])  # [C, K - 1]
        seq = np.concatenate([window, inputs[t0:t1].T], axis=1).astype(np.float32)  # [C, K - 1 + n]
        for t in range(t1 - t0):
            acc = np.zeros(inputs.shape[1], np.float32)
            for j in range(taps):
                acc = (acc + w[:, j] * seq[:, t + j]).astype(np.float32)
            y[t0 + t] = acc + bias
        state[slot] = seq[:, -(taps - 1):]
    return y


def _causal_conv1d_infer(x: TensorSpec, w: TensorSpec, bias: TensorSpec, state: TensorSpec, seq_start: TensorSpec,
                         positions: TensorSpec, state_slots: TensorSpec, activation: str = "") -> tuple[TensorSpec, ...]:
    require(activation in CONV_ACTIVATIONS, "causal_conv1d", (x,), f"activation must be one of {CONV_ACTIVATIONS}")
    return _conv_infer("causal_conv1d", x, w, bias, state, seq_start, positions, state_slots, x.shape[-1])


@register_op("causal_conv1d", _causal_conv1d_infer, inplace=(3,))
def causal_conv1d(x: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray, seq_start: np.ndarray,
                  positions: np.ndarray, state_slots: np.ndarray, activation: str = "") -> np.ndarray:
    """y [T, C]: each channel of x convolved over its sequence's positions (state carried), then
    act (Qwen3.5's gated delta net and Mamba2 convolve their projections this way, with silu)."""
    y = _conv_rows(x, w, bias, state, seq_start, positions, state_slots)
    return (y / (np.float32(1) + np.exp(-y))).astype(np.float32) if activation == "silu" else y


def _short_conv_infer(bcx: TensorSpec, w: TensorSpec, bias: TensorSpec, state: TensorSpec, seq_start: TensorSpec,
                      positions: TensorSpec, state_slots: TensorSpec) -> tuple[TensorSpec, ...]:
    require(len(bcx.shape) == 2 and bcx.shape[1] % 3 == 0, "short_conv", (bcx,), "bcx must be [T, 3 * channels]")
    return _conv_infer("short_conv", bcx, w, bias, state, seq_start, positions, state_slots, bcx.shape[1] // 3)


@register_op("short_conv", _short_conv_infer, inplace=(3,))
def short_conv(bcx: np.ndarray, w: np.ndarray, bias: np.ndarray, state: np.ndarray, seq_start: np.ndarray,
               positions: np.ndarray, state_slots: np.ndarray) -> np.ndarray:
    """LFM2's gated short convolution: with bcx = [B | C | x] per token, C * conv(B * x) [T, channels]."""
    b, c, x = np.split(bcx.astype(np.float32), 3, axis=1)
    return (c * _conv_rows(b * x, w, bias, state, seq_start, positions, state_slots)).astype(np.float32)
