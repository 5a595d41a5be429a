"""The op registry. Each op is declared once with its numpy reference (the spec); backends
register native kernels for it. Call ops through the functions below."""

from __future__ import annotations

import numpy as np

from vkrt.core.op import OPS, OpDef, OpError
from vkrt.core.tensor import Tensor, TensorSpec
from vkrt.ops import attention as _attention
from vkrt.ops import elementwise as _elementwise
from vkrt.ops import linear as _linear
from vkrt.ops import moe as _moe
from vkrt.ops import norm as _norm
from vkrt.ops import recurrent as _recurrent
from vkrt.ops import sampling as _sampling
from vkrt.ops.attention import rope_cos_sin
from vkrt.ops.dispatch import dispatch

del _attention, _elementwise, _linear, _moe, _norm, _recurrent  # imported for their registrations


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    return dispatch("embedding", table, ids)


def matmul(x: Tensor, w: Tensor) -> Tensor:
    return dispatch("matmul", x, w)


def matmul_silu_and_mul(x: Tensor, w: Tensor) -> Tensor:
    """silu_and_mul(matmul(x, w)) of w = [gate; up] [2F, K]: y [T, F] in one dispatch."""
    return dispatch("matmul_silu_and_mul", x, w)


def matmul_gelu_tanh_and_mul(x: Tensor, w: Tensor) -> Tensor:
    """gelu_tanh_and_mul(matmul(x, w)) of w = [gate; up] [2F, K]: y [T, F] in one dispatch."""
    return dispatch("matmul_gelu_tanh_and_mul", x, w)


def rms_norm_matmul(x: Tensor, g: Tensor, w: Tensor, eps: float, gated: bool = False,
                    activation: str = "silu") -> Tensor:
    """matmul(rms_norm(x, g, eps), w) in one dispatch (its gated form with `activation` when gated)."""
    return dispatch("rms_norm_matmul", x, g, w, eps=float(eps), gated=bool(gated), activation=activation)


def matmul_add(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    """matmul(x, w) + residual in one dispatch; residual [T, N], or a bias [N] for every row."""
    return dispatch("matmul_add", x, w, residual)


def rms_norm_matmul_add(x: Tensor, g: Tensor, w: Tensor, residual: Tensor, eps: float) -> Tensor:
    """rms_norm_matmul(x, g, w, eps) + residual ([T, N] or a bias [N]) in one dispatch."""
    return dispatch("rms_norm_matmul_add", x, g, w, residual, eps=float(eps))


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return dispatch("rms_norm", x, w, eps=float(eps))


def rms_norm_add(x: Tensor, w: Tensor, residual: Tensor, eps: float) -> Tensor:
    """residual + rms_norm(x, w) in one dispatch (what add(rms_norm(x, w), residual) fuses to)."""
    return dispatch("rms_norm_add", x, w, residual, eps=float(eps))


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return dispatch("layer_norm", x, w, b, eps=float(eps))


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b; b may also be one row [N] broadcast over the rows of a [T, N] (a bias)."""
    return dispatch("add", a, b)


def sigmoid_mul(a: Tensor, b: Tensor) -> Tensor:
    """a * sigmoid(b), elementwise f32 (b may be one row broadcast over a)."""
    return dispatch("sigmoid_mul", a, b)


def scale(x: Tensor, factor: float) -> Tensor:
    """x * factor, elementwise f32 (factor rounded to f32 first)."""
    return dispatch("scale", x, factor=float(factor))


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap), elementwise f32."""
    return dispatch("softcap", x, cap=float(cap))


def reshape(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A view of x's storage in a new contiguous shape (one dim may be -1): no copy, no dispatch."""
    return x.reshape(tuple(shape))


def relu_squared(x: Tensor) -> Tensor:
    """max(x, 0)^2, elementwise f32 (Nemotron-H's ungated MLP)."""
    return dispatch("relu_squared", x)


def silu_and_mul(x: Tensor) -> Tensor:
    return dispatch("silu_and_mul", x)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    return dispatch("gelu_tanh_and_mul", x)


def gelu_tanh_mul_slice(gate: Tensor, x: Tensor, start: int) -> Tensor:
    """gelu_tanh(gate) * x[:, start:start + F] for gate [T, F], in one dispatch."""
    return dispatch("gelu_tanh_mul_slice", gate, x, start=int(start))


def rope(x: Tensor, positions: Tensor, cos_sin: Tensor, head_dim: int,
         interleaved: bool = False) -> Tensor:
    return dispatch("rope", x, positions, cos_sin, head_dim=int(head_dim), interleaved=bool(interleaved))


def kv_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    dispatch("kv_write", k_cache, v_cache, k, v, slots)


def latent_kv_write(kv_a: Tensor, w: Tensor, positions: Tensor, cos_sin: Tensor, cache: Tensor, slots: Tensor,
                    eps: float, interleaved: bool = False) -> None:
    """MLA's cache row [rope(k_rope), rms_norm(latent) * w] of each token's kv_a [latent, k_rope] at its slot."""
    dispatch("latent_kv_write", kv_a, w, positions, cos_sin, cache, slots, eps=float(eps),
             interleaved=bool(interleaved))


def qkv_rope_kv_write(qkv: Tensor, positions: Tensor, cos_sin: Tensor, k_cache: Tensor,
                      v_cache: Tensor, slots: Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, interleaved: bool = False) -> Tensor:
    """rope(q) of the stacked qkv [T, (H + 2 KVH) * head_dim]; rope(k) and v go to their cache slots."""
    return dispatch("qkv_rope_kv_write", qkv, positions, cos_sin, k_cache, v_cache, slots,
                    num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                    interleaved=bool(interleaved))


def rms_norm_qkv_rope_kv_write(x: Tensor, g: Tensor, w: Tensor, positions: Tensor, cos_sin: Tensor,
                               k_cache: Tensor, v_cache: Tensor, slots: Tensor, eps: float, num_heads: int,
                               num_kv_heads: int, head_dim: int, interleaved: bool = False) -> Tensor:
    """qkv_rope_kv_write(rms_norm_matmul(x, g, w, eps), ...) in one dispatch where the shapes allow."""
    return dispatch("rms_norm_qkv_rope_kv_write", x, g, w, positions, cos_sin, k_cache, v_cache, slots,
                    eps=float(eps), num_heads=int(num_heads), num_kv_heads=int(num_kv_heads),
                    head_dim=int(head_dim), interleaved=bool(interleaved))


def qkv_norm_rope_kv_write(qkv: Tensor, q_norm: Tensor, k_norm: Tensor, positions: Tensor, cos_sin: Tensor,
                           k_cache: Tensor, v_cache: Tensor, slots: Tensor, eps: float, num_heads: int,
                           num_kv_heads: int, head_dim: int, interleaved: bool = False, v_norm: bool = False) -> Tensor:
    """qkv_rope_kv_write after a per-head RMSNorm of q (weights q_norm [head_dim]) and k (k_norm),
    and with `v_norm` of v (no weight)."""
    return dispatch("qkv_norm_rope_kv_write", qkv, q_norm, k_norm, positions, cos_sin, k_cache, v_cache,
                    slots, eps=float(eps), num_heads=int(num_heads), num_kv_heads=int(num_kv_heads),
                    head_dim=int(head_dim), interleaved=bool(interleaved), v_norm=bool(v_norm))


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    seq_index: Tensor, positions: Tensor, num_heads: int, num_kv_heads: int,
                    scale: float, window: int = 0, softcap: float = 0.0, chunked: bool = False) -> Tensor:
    """Causal GQA over the paged cache; window W > 0: positions p - W < j <= p only (chunked:
    floor(p / W) * W <= j <= p, Llama 4); softcap c > 0: scores -> c * tanh(scores / c) before the softmax."""
    return dispatch("paged_attention", q, k_cache, v_cache, block_table, seq_index, positions,
                    num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), scale=float(scale),
                    window=int(window), softcap=float(softcap), chunked=bool(chunked))


def paged_attention_sinks(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_index: Tensor,
                          positions: Tensor, sinks: Tensor, num_heads: int, num_kv_heads: int, scale: float,
                          window: int = 0, softcap: float = 0.0, chunked: bool = False) -> Tensor:
    """paged_attention with a learned logit per head, sinks [num_heads], in each softmax's
    denominator (gpt-oss's attention sinks)."""
    return dispatch("paged_attention_sinks", q, k_cache, v_cache, block_table, seq_index, positions, sinks,
                    num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), scale=float(scale),
                    window=int(window), softcap=float(softcap), chunked=bool(chunked))


def clamped_swiglu(x: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's clamped SwiGLU of [..., gate | up] halves -> [..., F] (vkrt.ops.elementwise)."""
    return dispatch("clamped_swiglu", x, alpha=float(alpha), limit=float(limit))


def concat_columns(*parts: Tensor) -> Tensor:
    """[T, a] + [T, b] (+ [T, c]) -> [T, a + b + c]."""
    return dispatch("concat_columns", *parts)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    return dispatch("gather_rows", x, index)


def sample_top_k(logits: Tensor, params: Tensor, uniforms: Tensor, mask: Tensor | None = None) -> Tensor:
    """Token ids [R] drawn from logits [R, V]; params [R, 4], uniforms [R] and the token mask
    [R, ceil(V / 32)] u32 (None: every token allowed) as in vkrt.ops.sampling."""
    if mask is None:
        rows, vocab = logits.shape
        mask = logits.backend.upload(np.full((rows, _sampling.mask_words(vocab)), _sampling.ALL_ALLOWED), "u32")
    return dispatch("sample_top_k", logits, params, uniforms, mask)


def cast(x: Tensor, dtype: str) -> Tensor:
    return dispatch("cast", x, dtype=dtype)


def copy(x: Tensor) -> Tensor:
    return dispatch("copy", x)


def moe_router(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Expert ids i32 [T, k] and weights f32 [T, k] from router logits [T, E] (vkrt.ops.moe)."""
    return dispatch("moe_router", logits, top_k=int(top_k), normalize=bool(normalize))


def moe_router_sigmoid(logits: Tensor, bias: Tensor, top_k: int, normalize: bool, scale: float = 1.0,
                       norm_eps: float = 1e-6, groups: int = 1, top_groups: int = 1) -> tuple[Tensor, Tensor]:
    """Expert ids and weights by sigmoid scores, chosen with an expert bias [E] within the
    `top_groups` best of `groups` groups of experts (vkrt.ops.moe)."""
    return dispatch("moe_router_sigmoid", logits, bias, top_k=int(top_k), normalize=bool(normalize),
                    scale=float(scale), norm_eps=float(norm_eps), groups=int(groups), top_groups=int(top_groups))


def moe_matmul(x: Tensor, w: Tensor, ids: Tensor) -> Tensor:
    """[T, k, N]: x [T, K] (or [T, k, K]) through the experts ids [T, k] pick of w [E, N, K]."""
    return dispatch("moe_matmul", x, w, ids)


def moe_matmul_gated(x: Tensor, w: Tensor, ids: Tensor, activation: str = "silu") -> Tensor:
    """[T, k, F]: silu_and_mul (or gelu_tanh_and_mul) of moe_matmul(x, w, ids), w [E, 2F, K] = [gate; up] per expert."""
    return dispatch("moe_matmul_gated", x, w, ids, activation=activation)


def moe_add_bias(y: Tensor, bias: Tensor, ids: Tensor) -> Tensor:
    """[T, k, N]: y plus the bias [E, N] of the expert each row went through (ids [T, k])."""
    return dispatch("moe_add_bias", y, bias, ids)


def moe_scale(y: Tensor, scale: Tensor, ids: Tensor) -> Tensor:
    """[T, k, N]: y times the scale [E, N] of the expert each row went through (ids [T, k])."""
    return dispatch("moe_scale", y, scale, ids)


def moe_combine(y: Tensor, weights: Tensor) -> Tensor:
    """[T, N]: the k expert outputs y [T, k, N] summed with their router weights [T, k]."""
    return dispatch("moe_combine", y, weights)


def moe_combine_shared(y: Tensor, weights: Tensor, shared: Tensor, shared_logit: Tensor) -> Tensor:
    """[T, N]: moe_combine(y, weights) + sigmoid(shared_logit) [T, 1] * shared [T, N] (a shared expert)."""
    return dispatch("moe_combine_shared", y, weights, shared, shared_logit)


def causal_conv1d(x: Tensor, w: Tensor, bias: Tensor, state: Tensor, seq_start: Tensor, positions: Tensor,
                  state_slots: Tensor, activation: str = "") -> Tensor:
    """[T, C]: each channel of x convolved over its sequence (w [C, K], bias [C]), the conv state
    [slots, C, K - 1] carried and updated in place (vkrt.ops.recurrent); activation "" or "silu"."""
    return dispatch("causal_conv1d", x, w, bias, state, seq_start, positions, state_slots, activation=activation)


def short_conv(bcx: Tensor, w: Tensor, bias: Tensor, state: Tensor, seq_start: Tensor, positions: Tensor,
               state_slots: Tensor) -> Tensor:
    """[T, C]: LFM2's C * conv(B * x) of bcx = [B | C | x] per token, state carried as causal_conv1d's."""
    return dispatch("short_conv", bcx, w, bias, state, seq_start, positions, state_slots)


def gated_delta_net(qkv: Tensor, ba: Tensor, a_rate: Tensor, dt_bias: Tensor, state: Tensor, seq_start: Tensor,
                    positions: Tensor, state_slots: Tensor, num_k_heads: int, num_v_heads: int, k_head_dim: int,
                    v_head_dim: int, tiled_heads: bool = False, beta_scale: float = 1.0) -> Tensor:
    """[T, Hv * dv]: the gated delta rule (Qwen3.5) over each sequence of the step (A = a_rate
    = -exp(A_log)), its state [slots, Hv, dk, dv] carried and updated in place (vkrt.ops.recurrent)."""
    return dispatch("gated_delta_net", qkv, ba, a_rate, dt_bias, state, seq_start, positions, state_slots,
                    num_k_heads=int(num_k_heads), num_v_heads=int(num_v_heads), k_head_dim=int(k_head_dim),
                    v_head_dim=int(v_head_dim), tiled_heads=bool(tiled_heads), beta_scale=float(beta_scale))


def gated_rms_norm(x: Tensor, z: Tensor, w: Tensor, eps: float, group_size: int = 0, gate_first: bool = False) -> Tensor:
    """Per group of `group_size` columns (0: the row): rms_norm(x) * w * silu(z), or with
    `gate_first` rms_norm(x * silu(z)) * w; w [D] or [group_size] (vkrt.ops.recurrent)."""
    return dispatch("gated_rms_norm", x, z, w, eps=float(eps), group_size=int(group_size), gate_first=bool(gate_first))


def copy_state_slots(state: Tensor, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
    """In place: slot dst[i] of a recurrent state [slots, ...] becomes a copy of slot src[i], on the
    device (the destinations distinct, none of them a source)."""
    dispatch("copy_state_slots", state, src=tuple(int(i) for i in src), dst=tuple(int(i) for i in dst))


def ssm_scan(xbc: Tensor, dt: Tensor, a_rate: Tensor, skip: Tensor, dt_bias: Tensor, state: Tensor, seq_start: Tensor,
             positions: Tensor, state_slots: Tensor, num_heads: int, head_dim: int, n_groups: int, state_size: int,
             dt_min: float = 0.0, dt_max: float = float("inf")) -> Tensor:
    """[T, H * P]: Mamba2's selective scan over each sequence of the step (A = a_rate, D = skip),
    its state [slots, H, P, N] carried and updated in place (vkrt.ops.recurrent)."""
    return dispatch("ssm_scan", xbc, dt, a_rate, skip, dt_bias, state, seq_start, positions, state_slots,
                    num_heads=int(num_heads), head_dim=int(head_dim), n_groups=int(n_groups),
                    state_size=int(state_size), dt_min=float(dt_min), dt_max=float(dt_max))


def op_names() -> list[str]:
    return sorted(OPS)


__all__ = [
    "OPS", "OpDef", "OpError", "Tensor", "TensorSpec", "add", "cast", "causal_conv1d", "clamped_swiglu", "concat_columns", "copy", "copy_state_slots",
    "dispatch", "embedding", "gated_delta_net", "gated_rms_norm", "gather_rows", "gelu_tanh_and_mul", "gelu_tanh_mul_slice", "kv_write", "layer_norm", "matmul",
    "matmul_add", "matmul_gelu_tanh_and_mul", "matmul_silu_and_mul", "moe_add_bias", "moe_combine", "moe_combine_shared",
    "moe_matmul", "moe_matmul_gated", "moe_router", "moe_router_sigmoid", "moe_scale", "op_names", "paged_attention", "paged_attention_sinks", "qkv_norm_rope_kv_write",
    "qkv_rope_kv_write", "reshape", "rms_norm", "rms_norm_add", "rms_norm_matmul", "rms_norm_matmul_add",
    "relu_squared", "rms_norm_qkv_rope_kv_write", "rope", "rope_cos_sin", "sample_top_k", "scale", "short_conv", "sigmoid_mul", "ssm_scan", "silu_and_mul",
    "softcap",
]
