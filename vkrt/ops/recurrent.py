"""Recurrent mixers' ops: the depthwise causal convolution, the gated delta rule, Mamba2's scan.

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

from collections.abc import Iterator

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
    for t0, t1, slot in _sequences(seq_start, state_slots):
        window = state[slot] if positions[t0] > 0 else np.zeros_like(state[slot])  # [C, K - 1]
        seq = np.concatenate([window, inputs[t0:t1].T], axis=1).astype(np.float32)  # [C, K - 1 + n]
        for t in range(t1 - t0):
            acc = np.zeros(inputs.shape[1], np.float32)
            for j in range(taps):
                acc = (acc + w[:, j] * seq[:, t + j]).astype(np.float32)
            y[t0 + t] = acc + bias
        state[slot] = seq[:, -(taps - 1):]
    return y


def _sequences(seq_start: np.ndarray, state_slots: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(first token, end, state slot) of each sequence of a step that has tokens in it."""
    for s in range(state_slots.shape[0]):
        t0, t1 = int(seq_start[s]), int(seq_start[s + 1])
        if t1 > t0:
            yield t0, t1, int(state_slots[s])


def _carried(state: np.ndarray, slot: int, first_position: int) -> np.ndarray:
    """The float64 state a sequence starts its step from: its slot's, or zeros at position 0."""
    return state[slot].astype(np.float64) if first_position > 0 else np.zeros(state.shape[1:], np.float64)


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
#   beta = sigmoid(b[h]) (x beta_scale: 2 lets OLMo-hybrid's eigenvalues go negative), g = A[h] * softplus(a[h] + dt_bias[h]) (A = -exp(A_log) < 0),
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
               num_v_heads: int, k_head_dim: int, v_head_dim: int, tiled_heads: bool = False,
               beta_scale: float = 1.0) -> tuple[TensorSpec, ...]:
    specs = (qkv, ba, a, dt_bias, state, seq_start, positions, state_slots)
    name = "gated_delta_net"
    require(beta_scale in (1.0, 2.0), name, specs, f"beta_scale must be 1 or 2, got {beta_scale}")
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


def _gdn_operands(qkv: np.ndarray, ba: np.ndarray, a_rate: np.ndarray, dt_bias: np.ndarray, num_k_heads: int,
                  num_v_heads: int, k_head_dim: int, tiled_heads: bool, beta_scale: float,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q, k [T, Hv, dk] (L2-normalised, q also by 1 / sqrt(dk), each value head's key head),
    v [T, Hv, dv], beta and the log decay g [T, Hv], in float64: what both forms share."""
    t = qkv.shape[0]
    kd = num_k_heads * k_head_dim
    repeat = num_v_heads // num_k_heads
    x = qkv.astype(np.float64)
    key_head = np.arange(num_v_heads) % num_k_heads if tiled_heads else np.arange(num_v_heads) // repeat
    q = x[:, :kd].reshape(t, num_k_heads, k_head_dim)[:, key_head]
    k = x[:, kd:2 * kd].reshape(t, num_k_heads, k_head_dim)[:, key_head]
    v = x[:, 2 * kd:].reshape(t, num_v_heads, -1)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2_EPS) / np.sqrt(k_head_dim)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2_EPS)
    b, a = ba.astype(np.float64)[:, :num_v_heads], ba.astype(np.float64)[:, num_v_heads:]
    beta = beta_scale / (1.0 + np.exp(-b))
    g = a_rate.astype(np.float64) * _softplus(a + dt_bias.astype(np.float64))
    return q, k, v, beta, g


@register_op("gated_delta_net", _gdn_infer, inplace=(4,))
def gated_delta_net(qkv: np.ndarray, ba: np.ndarray, a_rate: np.ndarray, dt_bias: np.ndarray, state: np.ndarray,
                    seq_start: np.ndarray, positions: np.ndarray, state_slots: np.ndarray, num_k_heads: int,
                    num_v_heads: int, k_head_dim: int, v_head_dim: int, tiled_heads: bool = False,
                    beta_scale: float = 1.0) -> np.ndarray:
    """o [T, Hv * dv]: the gated delta rule over each sequence (float64 within a step; the state
    is stored f32 between steps, as the device holds it)."""
    q, k, v, beta, g = _gdn_operands(qkv, ba, a_rate, dt_bias, num_k_heads, num_v_heads, k_head_dim, tiled_heads,
                                     beta_scale)
    decay = np.exp(g)
    out = np.zeros(v.shape, np.float64)
    for t0, t1, slot in _sequences(seq_start, state_slots):
        S = _carried(state, slot, positions[t0])
        for i in range(t0, t1):
            S = S * decay[i][:, None, None]
            kv_mem = np.einsum("hkv,hk->hv", S, k[i])
            delta = (v[i] - kv_mem) * beta[i][:, None]
            S = S + k[i][:, :, None] * delta[:, None, :]
            out[i] = np.einsum("hkv,hk->hv", S, q[i])
        state[slot] = S.astype(np.float32)
    return out.reshape(qkv.shape[0], -1).astype(np.float32)


# The chunked form (the WY / chunked delta-rule formulation; transformers' torch_chunk_gated_delta_rule
# computes it for prefill): the same sums regrouped so a chunk of C tokens costs a few matrix products
# and one C x C triangular solve instead of C dependent steps. Within a chunk starting from state S0,
# with G_i = g_0 + ... + g_i (the chunk's cumulative log decay) and D_ij = exp(G_i - G_j) for j <= i
# (never above 1, so nothing overflows however long the chunk decays):
#   delta_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} D_ij (k_i . k_j) delta_j)
#     i.e. (I + A) delta = beta (v - exp(G) K S0), A = strictly-lower(beta_i D_ij k_i . k_j), solved forwards;
#   o_i = exp(G_i) S0^T q_i + sum_{j<=i} D_ij (q_i . k_j) delta_j;
#   S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j delta_j^T.
# Chunks start at each sequence's first token of the step (the last one may be short).


def gated_delta_net_chunked(qkv: np.ndarray, ba: np.ndarray, a_rate: np.ndarray, dt_bias: np.ndarray,
                            state: np.ndarray, seq_start: np.ndarray, positions: np.ndarray, state_slots: np.ndarray,
                            num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                            tiled_heads: bool = False, beta_scale: float = 1.0, chunk: int = 64) -> np.ndarray:
    """`gated_delta_net` computed chunk by chunk (float64; the same arguments, the state updated in
    place): the readable definition of what the chunked kernels compute."""
    q, k, v, beta, g = _gdn_operands(qkv, ba, a_rate, dt_bias, num_k_heads, num_v_heads, k_head_dim, tiled_heads,
                                     beta_scale)
    out = np.zeros(v.shape, np.float64)
    for t0, t1, slot in _sequences(seq_start, state_slots):
        S = _carried(state, slot, positions[t0])
        for c0 in range(t0, t1, chunk):
            c1 = min(c0 + chunk, t1)
            out[c0:c1], S = _gdn_chunk(q[c0:c1], k[c0:c1], v[c0:c1], beta[c0:c1], g[c0:c1], S)
        state[slot] = S.astype(np.float32)
    return out.reshape(qkv.shape[0], -1).astype(np.float32)


def _gdn_chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray,
               S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of n tokens (q, k [n, H, dk], v [n, H, dv], beta, g [n, H]) from state S [H, dk, dv]:
    the chunk's outputs [n, H, dv] and the state after it."""
    n = q.shape[0]
    G = np.cumsum(g, axis=0).T  # [H, n]
    causal = np.tril(np.ones((n, n), bool))
    D = np.where(causal, np.exp(np.where(causal, G[:, :, None] - G[:, None, :], 0.0)), 0.0)  # [H, i, j]
    kk = np.einsum("ihd,jhd->hij", k, k)
    A = np.tril(beta.T[:, :, None] * D * kk, -1)
    rhs = beta.T[:, :, None] * (v.transpose(1, 0, 2) - np.exp(G)[:, :, None] * np.einsum("ihd,hde->hie", k, S))
    delta = np.zeros_like(rhs)  # [H, n, dv]: forward substitution through the unit lower-triangular I + A
    for i in range(n):
        delta[:, i] = rhs[:, i] - np.einsum("hj,hje->he", A[:, i, :i], delta[:, :i])
    qk = D * np.einsum("ihd,jhd->hij", q, k)
    o = np.exp(G)[:, :, None] * np.einsum("ihd,hde->hie", q, S) + np.einsum("hij,hje->hie", qk, delta)
    tail = np.exp(G[:, -1:] - G)  # [H, n]: exp(G_last - G_j)
    S = np.exp(G[:, -1])[:, None, None] * S + np.einsum("jhd,hj,hje->hde", k, tail, delta)
    return o.transpose(1, 0, 2), S


def _gated_norm_infer(x: TensorSpec, z: TensorSpec, w: TensorSpec, eps: float, group_size: int = 0,
                      gate_first: bool = False) -> tuple[TensorSpec, ...]:
    specs = (x, z, w)
    require(x.dtype == z.dtype == w.dtype == "f32" and len(x.shape) == 2 and z == x, "gated_rms_norm", specs,
            "x and z must be f32 [R, D]")
    size = group_size or x.shape[1]
    require(x.shape[1] % size == 0 and w.shape in ((x.shape[1],), (size,)), "gated_rms_norm", specs,
            f"groups of {size} must tile D, and w be f32 [D] or [group_size]")
    return (x,)


@register_op("gated_rms_norm", _gated_norm_infer)
def gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float, group_size: int = 0,
                   gate_first: bool = False) -> np.ndarray:
    """Per group of `group_size` columns (0: the whole row): rms_norm(x) * w * silu(z) (Qwen3.5's
    delta net), or with `gate_first` rms_norm(x * silu(z)) * w (Mamba2's); w is [D], or [group_size]
    for every group."""
    rows, dim = x.shape
    size = group_size or dim
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    gate = z64 / (1.0 + np.exp(-z64))
    if gate_first:
        x64 = x64 * gate
    groups = x64.reshape(rows, dim // size, size)
    normed = (groups / np.sqrt((groups * groups).mean(axis=-1, keepdims=True) + eps)).reshape(rows, dim)
    weight = np.tile(w.astype(np.float64), dim // w.shape[0])
    return (normed * weight * (1.0 if gate_first else gate)).astype(np.float32)


# ---- Mamba2's selective scan (Granite 4, Nemotron-H, Falcon-H1) -----------------------------------
#
# Per head h of sequence s (head_dim P, state size N, head h reading B and C of group
# h // (num_heads / n_groups)), a state [P, N]: for each token, with dt = clamp(softplus(dt[h] +
# dt_bias[h]), dt_min, dt_max),
#   state <- state * exp(dt * A[h]) + dt * x ⊗ B;   y = state C + D[h] * x,
# transformers' mamba2_selective_state_update (its chunked prefill computes the same sums).


def _ssm_infer(xbc: TensorSpec, dt: TensorSpec, a_rate: TensorSpec, skip: TensorSpec, dt_bias: TensorSpec,
               state: TensorSpec, seq_start: TensorSpec, positions: TensorSpec, state_slots: TensorSpec,
               num_heads: int, head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0,
               dt_max: float = float("inf")) -> tuple[TensorSpec, ...]:
    specs = (xbc, dt, a_rate, skip, dt_bias, state, seq_start, positions, state_slots)
    name = "ssm_scan"
    require(n_groups > 0 and num_heads % n_groups == 0, name, specs, "num_heads must be a multiple of n_groups")
    width = num_heads * head_dim + 2 * n_groups * state_size
    require(xbc.dtype == "f32" and len(xbc.shape) == 2 and xbc.shape[1] == width, name, specs,
            f"xbc must be f32 [T, {width}] (x of {num_heads} heads of {head_dim}, B and C of {n_groups} groups of "
            f"{state_size})")
    require(dt.dtype == "f32" and dt.shape == (xbc.shape[0], num_heads), name, specs, "dt must be f32 [T, num_heads]")
    require(all(t.dtype == "f32" and t.shape == (num_heads,) for t in (a_rate, skip, dt_bias)), name, specs,
            "A, D and dt_bias must be f32 [num_heads]")
    require(state.dtype == "f32" and len(state.shape) == 4 and state.shape[1:] == (num_heads, head_dim, state_size),
            name, specs, "state must be f32 [slots, num_heads, head_dim, state_size]")
    require(positions.dtype == "i32" and positions.shape == (xbc.shape[0],), name, specs, "positions must be i32 [T]")
    require(seq_start.dtype == "i32" and state_slots.dtype == "i32" and len(seq_start.shape) == 1
            and state_slots.shape == (seq_start.shape[0] - 1,), name, specs,
            "seq_start must be i32 [S + 1] and state_slots i32 [S]")
    return (TensorSpec((xbc.shape[0], num_heads * head_dim), "f32"),)


def _ssm_operands(xbc: np.ndarray, dt: np.ndarray, a_rate: np.ndarray, dt_bias: np.ndarray, num_heads: int,
                  head_dim: int, n_groups: int, state_size: int, dt_min: float, dt_max: float,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [T, H, P], each head's B and C [T, H, N], the step dt and log decay dt * A [T, H], in
    float64: what the scan's two forms share."""
    t = xbc.shape[0]
    inner = num_heads * head_dim
    x64 = xbc.astype(np.float64)
    x = x64[:, :inner].reshape(t, num_heads, head_dim)
    group = np.arange(num_heads) // (num_heads // n_groups)
    b = x64[:, inner:inner + n_groups * state_size].reshape(t, n_groups, state_size)[:, group]
    c = x64[:, inner + n_groups * state_size:].reshape(t, n_groups, state_size)[:, group]
    step = np.clip(_softplus(dt.astype(np.float64) + dt_bias.astype(np.float64)), dt_min, dt_max)  # [T, H]
    return x, b, c, step, step * a_rate.astype(np.float64)


@register_op("ssm_scan", _ssm_infer, inplace=(5,))
def ssm_scan(xbc: np.ndarray, dt: np.ndarray, a_rate: np.ndarray, skip: np.ndarray, dt_bias: np.ndarray,
             state: np.ndarray, seq_start: np.ndarray, positions: np.ndarray, state_slots: np.ndarray, num_heads: int,
             head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0, dt_max: float = float("inf"),
             ) -> np.ndarray:
    """y [T, H * P]: Mamba2's scan over each sequence (float64 within a step, the state stored f32)."""
    x, b, c, step, log_decay = _ssm_operands(xbc, dt, a_rate, dt_bias, num_heads, head_dim, n_groups, state_size,
                                             dt_min, dt_max)
    decay = np.exp(log_decay)
    y = np.zeros(x.shape, np.float64)
    for t0, t1, slot in _sequences(seq_start, state_slots):
        h = _carried(state, slot, positions[t0])
        for i in range(t0, t1):
            h = h * decay[i][:, None, None] + (step[i][:, None] * x[i])[:, :, None] * b[i][:, None, :]
            y[i] = np.einsum("hpn,hn->hp", h, c[i]) + skip.astype(np.float64)[:, None] * x[i]
        state[slot] = h.astype(np.float32)
    return y.reshape(xbc.shape[0], -1).astype(np.float32)


# Mamba2's chunked form (SSD, transformers' torch_forward for prefill): within a chunk starting
# from state h0, with L_i the chunk's cumulative log decay (dt * A summed to i), every token's
# contribution reaches a later one through exp(L_i - L_j) <= 1, so no solve is needed:
#   y_i = exp(L_i) h0 C_i + sum_{j<=i} exp(L_i - L_j) (C_i . B_j) dt_j x_j + D x_i;
#   h = exp(L_last) h0 + sum_j exp(L_last - L_j) dt_j x_j B_j^T.


def ssm_scan_chunked(xbc: np.ndarray, dt: np.ndarray, a_rate: np.ndarray, skip: np.ndarray, dt_bias: np.ndarray,
                     state: np.ndarray, seq_start: np.ndarray, positions: np.ndarray, state_slots: np.ndarray,
                     num_heads: int, head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0,
                     dt_max: float = float("inf"), chunk: int = 64) -> np.ndarray:
    """`ssm_scan` computed chunk by chunk (float64; the same arguments, the state updated in place)."""
    x, b, c, step, log_decay = _ssm_operands(xbc, dt, a_rate, dt_bias, num_heads, head_dim, n_groups, state_size,
                                             dt_min, dt_max)
    y = np.zeros(x.shape, np.float64)
    for t0, t1, slot in _sequences(seq_start, state_slots):
        h = _carried(state, slot, positions[t0])
        for c0 in range(t0, t1, chunk):
            part = slice(c0, min(c0 + chunk, t1))
            L = np.cumsum(log_decay[part], axis=0).T  # [H, n]
            n = L.shape[1]
            causal = np.tril(np.ones((n, n), bool))
            D = np.where(causal, np.exp(np.where(causal, L[:, :, None] - L[:, None, :], 0.0)), 0.0)  # [H, i, j]
            scores = D * np.einsum("ihn,jhn->hij", c[part], b[part]) * step[part].T[:, None, :]
            y[part] = (np.exp(L).T[:, :, None] * np.einsum("hpn,ihn->ihp", h, c[part])
                       + np.einsum("hij,jhp->ihp", scores, x[part]))
            tail = np.exp(L[:, -1:] - L) * step[part].T  # [H, n]
            h = np.exp(L[:, -1])[:, None, None] * h + np.einsum("hj,jhp,jhn->hpn", tail, x[part], b[part])
        state[slot] = h.astype(np.float32)
    y += skip.astype(np.float64)[:, None] * x
    return y.reshape(xbc.shape[0], -1).astype(np.float32)


# ---- copying state slots (prefix caching's snapshots) ---------------------------------------------
#
# The engine keeps a copy of a sequence's state at a cached block boundary in a spare slot of the
# same [slots, ...] tensor, and starts a later sequence whose prompt hits that prefix from it.


def _copy_slots_infer(state: TensorSpec, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[TensorSpec, ...]:
    name = "copy_state_slots"
    require(state.dtype == "f32" and len(state.shape) >= 2, name, (state,), "state must be f32 [slots, ...]")
    slots = state.shape[0]
    require(len(src) == len(dst) and all(0 <= int(i) < slots for i in (*src, *dst)), name, (state,),
            f"src and dst must be equally many slots in [0, {slots}), got {list(src)} and {list(dst)}")
    require(len(set(dst)) == len(dst) and not set(src) & set(dst), name, (state,),
            f"dst slots must be distinct and none a src, got {list(src)} -> {list(dst)}")
    return ()


@register_op("copy_state_slots", _copy_slots_infer, inplace=(0,))
def copy_state_slots(state: np.ndarray, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
    """state[dst[i]] = state[src[i]] for every i, in place (the bytes, unchanged)."""
    state[list(dst)] = state[list(src)]
