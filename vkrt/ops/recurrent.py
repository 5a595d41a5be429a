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


# ---- the gated delta rule (Qwen3.5, Qwen3-Next) -------------------------------------------------
#
# Per value head h of sequence s, a state S [dk, dv] (its key head serves num_v_heads /
# num_k_heads consecutive value heads): for each token, with q and k of h's key head
# L2-normalised (x / sqrt(sum x^2 + 1e-6)) and q also scaled by 1 / sqrt(dk),
#   beta = sigmoid(b[h]), g = A[h] * softplus(a[h] + dt_bias[h]) (A = -exp(A_log) < 0),
#   S <- S * exp(g);  delta = beta * (v - S^T k);  S <- S + k delta^T;  o = S^T q,
# the order transformers' torch_recurrent_gated_delta_rule computes it in. With `tiled_heads`
# value head h uses key head h % num_k_heads instead of h // (num_v_heads / num_k_heads): llama.cpp's
# converter reorders a GGUF's value heads that way (every tensor that has them, consistently).

L2_EPS = 1e-6


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20): x itself above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _gdn_infer(qkv: TensorSpec, ba: TensorSpec, a: TensorSpec, dt_bias: TensorSpec, state: TensorSpec,
               seq_start: TensorSpec, positions: TensorSpec, state_slots: TensorSpec, num_k_heads: int,
               num_v_heads: int, k_head_dim: int, v_head_dim: int, tiled_heads: bool = False) -> tuple[TensorSpec, ...]:
    specs = (qkv, ba, a, dt_bias, state, seq_start, positions, state_slots)
    name = "gated_delta_net"
    require(num_k_heads > 0 and num_v_heads % num_k_heads == 0, name, specs,
            f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
    width = 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim
    require(qkv.dtype == "f32" and len(qkv.shape) == 2 and qkv.shape[1] == width, name, specs,
            f"qkv must be f32 [T, {width}] (q, k of {num_k_heads} heads of {k_head_dim}, v of {num_v_heads} of {v_head_dim})")
    require(ba.dtype == "f32" and ba.shape == (qkv.shape[0], 2 * num_v_heads), name, specs,
            "ba must be f32 [T, 2 * num_v_heads] (b, then a)")
    require(a.dtype == dt_bias.dtype == "f32" and a.shape == dt_bias.shape == (num_v_heads,), name, specs,
            "A and dt_bias must be f32 [num_v_heads]")
    require(state.dtype == "f32" and len(state.shape) == 4 and state.shape[1:] == (num_v_heads, k_head_dim, v_head_dim),
            name, specs, "state must be f32 [slots, num_v_heads, k_head_dim, v_head_dim]")
    require(positions.dtype == "i32" and positions.shape == (qkv.shape[0],), name, specs, "positions must be i32 [T]")
    require(seq_start.dtype == "i32" and state_slots.dtype == "i32" and len(seq_start.shape) == 1
            and state_slots.shape == (seq_start.shape[0] - 1,), name, specs,
            "seq_start must be i32 [S + 1] and state_slots i32 [S]")
    return (TensorSpec((qkv.shape[0], num_v_heads * v_head_dim), "f32"),)


@register_op("gated_delta_net", _gdn_infer, inplace=(4,))
def gated_delta_net(qkv: np.ndarray, ba: np.ndarray, a_rate: np.ndarray, dt_bias: np.ndarray, state: np.ndarray,
                    seq_start: np.ndarray, positions: np.ndarray, state_slots: np.ndarray, num_k_heads: int,
                    num_v_heads: int, k_head_dim: int, v_head_dim: int, tiled_heads: bool = False) -> np.ndarray:
    """o [T, Hv * dv]: the gated delta rule over each sequence (float64 within a step; the state
    is stored f32 between steps, as the device holds it)."""
    t = qkv.shape[0]
    kd = num_k_heads * k_head_dim
    repeat = num_v_heads // num_k_heads
    x = qkv.astype(np.float64)
    key_head = np.arange(num_v_heads) % num_k_heads if tiled_heads else np.arange(num_v_heads) // repeat
    q = x[:, :kd].reshape(t, num_k_heads, k_head_dim)[:, key_head]
    k = x[:, kd:2 * kd].reshape(t, num_k_heads, k_head_dim)[:, key_head]
    v = x[:, 2 * kd:].reshape(t, num_v_heads, v_head_dim)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2_EPS) / np.sqrt(k_head_dim)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2_EPS)
    b, a = ba.astype(np.float64)[:, :num_v_heads], ba.astype(np.float64)[:, num_v_heads:]
    beta = 1.0 / (1.0 + np.exp(-b))
    decay = np.exp(a_rate.astype(np.float64) * _softplus(a + dt_bias.astype(np.float64)))  # exp(g)
    out = np.zeros((t, num_v_heads, v_head_dim), np.float64)
    for s in range(state_slots.shape[0]):
        t0, t1 = int(seq_start[s]), int(seq_start[s + 1])
        if t1 <= t0:
            continue
        slot = int(state_slots[s])
        S = state[slot].astype(np.float64) if positions[t0] > 0 else np.zeros(state.shape[1:], np.float64)
        for i in range(t0, t1):
            S = S * decay[i][:, None, None]
            kv_mem = np.einsum("hkv,hk->hv", S, k[i])
            delta = (v[i] - kv_mem) * beta[i][:, None]
            S = S + k[i][:, :, None] * delta[:, None, :]
            out[i] = np.einsum("hkv,hk->hv", S, q[i])
        state[slot] = S.astype(np.float32)
    return out.reshape(t, -1).astype(np.float32)


def _gated_norm_infer(x: TensorSpec, z: TensorSpec, w: TensorSpec, eps: float) -> tuple[TensorSpec, ...]:
    specs = (x, z, w)
    require(x.dtype == z.dtype == w.dtype == "f32" and len(x.shape) == 2 and z == x and w.shape == (x.shape[1],),
            "gated_rms_norm", specs, "x and z must be f32 [R, D], w f32 [D]")
    return (x,)


@register_op("gated_rms_norm", _gated_norm_infer)
def gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm(x) * w * silu(z) per row (the delta net's output norm, gated by z)."""
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    inv = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    return (x64 * inv * w * (z64 / (1.0 + np.exp(-z64)))).astype(np.float32)
