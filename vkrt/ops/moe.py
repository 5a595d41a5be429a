"""Mixture-of-experts ops: routing, the id-indexed expert matmul and the weighted combine.

A sparse MLP is four ops (the router matmul is a plain `matmul` against [E, H]):

    ids, weights = moe_router(router_logits, top_k, normalize)   # [T, k] i32, [T, k] f32
    a = silu_and_mul(moe_matmul(x, experts_gate_up, ids))         # [T, k, 2F] -> [T, k, F]
    out = moe_combine(moe_matmul(a, experts_down, ids), weights)  # [T, H]

`moe_router_sigmoid(logits, bias, top_k, normalize, scale, norm_eps, groups, top_groups)` routes
by sigmoid scores with an expert bias instead, within the best groups of experts (LFM2-MoE,
Nemotron-H, DeepSeek-V3's router).

A shared expert (Qwen2-MoE) is a dense gated MLP every token runs; its output s [T, H] enters
the combine as one more term, weighted by the sigmoid of its gate's logit g [T, 1]:
`moe_combine_shared(y, weights, s, g)`, a sibling op rather than optional inputs of the combine.

ids and weights are tensors that stay where the activations live (no host readback of
routing), so a decode step can be recorded and replayed like a dense one. The fusion layer
folds the activation into the gate|up expert matmul (`moe_matmul_gated`, as
`matmul_silu_and_mul` folds the dense MLP's). The combine is its own op rather than part of
the down projection: it keeps the expert matmul one op for both projections, and a backend
can fold it into the down projection's epilogue the way `matmul_add` folds a residual.
"""

from __future__ import annotations

import numpy as np

from vkrt.core.op import register_op, require
from vkrt.core.tensor import TensorSpec
from vkrt.ops.elementwise import gelu_tanh_and_mul, silu_and_mul
from vkrt.ops.linear import WEIGHT_DTYPES, _weight_values


def _router_infer(logits: TensorSpec, top_k: int, normalize: bool) -> tuple[TensorSpec, ...]:
    require(logits.dtype == "f32" and len(logits.shape) == 2, "moe_router", (logits,),
            "router logits must be f32 [T, E]")
    require(1 <= top_k <= logits.shape[1], "moe_router", (logits,),
            f"top_k must be in 1..E ({logits.shape[1]}), got {top_k}")
    rows = logits.shape[0]
    return TensorSpec((rows, top_k), "i32"), TensorSpec((rows, top_k), "f32")


@register_op("moe_router", _router_infer)
def moe_router(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each token's k experts and their weights from router logits [T, E].

    The k largest logits, in descending order, ties broken by the lower expert index
    (softmax is monotone, so this is the top-k of the probabilities transformers takes).
    Weights are the softmax probabilities of the chosen experts over all E; with
    `normalize` (Qwen3-MoE's norm_topk_prob, Mixtral) they are divided by their sum, which
    is the softmax over the k chosen logits. Computed in float64, rounded once to f32.
    """
    x = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-x, axis=1, kind="stable")[:, :top_k]  # stable: equal logits keep index order
    probs = np.exp(x - x.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    chosen = np.take_along_axis(probs, order, axis=1)
    if normalize:
        chosen = chosen / chosen.sum(axis=1, keepdims=True)
    return order.astype(np.int32), chosen.astype(np.float32)


def _sigmoid_router_infer(logits: TensorSpec, bias: TensorSpec, top_k: int, normalize: bool,
                          scale: float, norm_eps: float, groups: int, top_groups: int) -> tuple[TensorSpec, ...]:
    specs = (logits, bias)
    require(logits.dtype == "f32" and len(logits.shape) == 2, "moe_router_sigmoid", specs,
            "router logits must be f32 [T, E]")
    experts = logits.shape[1]
    require(bias.dtype == "f32" and bias.shape == logits.shape[1:], "moe_router_sigmoid", specs,
            f"the expert bias must be f32 [E] (E = {experts})")
    require(1 <= groups <= MAX_ROUTER_GROUPS and experts % groups == 0 and (groups == 1 or experts // groups >= 2),
            "moe_router_sigmoid", specs, f"groups must divide E ({experts}) into groups of at least 2 experts, "
            f"at most {MAX_ROUTER_GROUPS} groups; got {groups}")
    require(1 <= top_groups <= groups, "moe_router_sigmoid", specs, f"top_groups must be in 1..{groups}, got {top_groups}")
    require(1 <= top_k <= top_groups * (experts // groups), "moe_router_sigmoid", specs,
            f"top_k must be in 1..{top_groups * (experts // groups)} (the experts of the top groups), got {top_k}")
    require(bool(np.isfinite(scale)) and scale > 0, "moe_router_sigmoid", specs, f"scale must be > 0, got {scale}")
    require(bool(np.isfinite(norm_eps)) and norm_eps >= 0, "moe_router_sigmoid", specs,
            f"norm_eps must be >= 0, got {norm_eps}")
    rows = logits.shape[0]
    return TensorSpec((rows, top_k), "i32"), TensorSpec((rows, top_k), "f32")


MAX_ROUTER_GROUPS = 32  # the native kernel keeps the chosen groups as the bits of one word


@register_op("moe_router_sigmoid", _sigmoid_router_infer)
def moe_router_sigmoid(logits: np.ndarray, bias: np.ndarray, top_k: int, normalize: bool,
                       scale: float, norm_eps: float, groups: int, top_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid routing with an expert bias, limited to the best groups of experts (DeepSeek-V3's,
    Nemotron-H's; LFM2-MoE's is one group).

    Each expert's score is sigmoid(logit) and its rank score + bias. With `groups` > 1 the E
    experts are split into that many consecutive groups, each valued by the sum of its two best
    ranks, and only the `top_groups` best groups are chosen from. The k experts are those of the
    largest rank (descending, ties to the lower index; groups likewise), and their weights are
    their scores without the bias: divided by (their sum + norm_eps) with `normalize`, then times
    `scale` (routed_scaling_factor). Ranks and group values are in f32 as transformers computes
    them (score rounded to f32, plus the f32 bias); the weights in float64, rounded once to f32.
    """
    x = np.asarray(logits, dtype=np.float64)
    scores = 1.0 / (1.0 + np.exp(-x))
    ranked = scores.astype(np.float32) + np.asarray(bias, dtype=np.float32)
    if groups > 1:
        tokens, experts = ranked.shape
        by_group = ranked.reshape(tokens, groups, experts // groups)
        best_two = -np.sort(-by_group, axis=2)[:, :, :2]
        value = best_two[:, :, 0] + best_two[:, :, 1]  # f32, as torch sums the two
        chosen_groups = np.argsort(-value, axis=1, kind="stable")[:, :top_groups]
        keep = np.zeros((tokens, groups), bool)
        np.put_along_axis(keep, chosen_groups, True, axis=1)
        ranked = np.where(np.repeat(keep, experts // groups, axis=1), ranked, np.float32(-np.inf))
    order = np.argsort(-ranked, axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(scores, order, axis=1)
    if normalize:
        chosen = chosen / (chosen.sum(axis=1, keepdims=True) + norm_eps)
    return order.astype(np.int32), (chosen * scale).astype(np.float32)


def _moe_matmul_infer(x: TensorSpec, w: TensorSpec, ids: TensorSpec) -> tuple[TensorSpec, ...]:
    specs = (x, w, ids)
    require(w.dtype in WEIGHT_DTYPES and len(w.shape) == 3, "moe_matmul", specs,
            f"experts must be [E, N, K] in one of {WEIGHT_DTYPES}")
    require(ids.dtype == "i32" and len(ids.shape) == 2, "moe_matmul", specs, "ids must be i32 [T, k]")
    tokens, k = ids.shape
    require(x.dtype == "f32" and x.shape in ((tokens, w.shape[2]), (tokens, k, w.shape[2])), "moe_matmul",
            specs, f"x must be f32 [T, K] (one row per token) or [T, k, K] (one per chosen expert), K = {w.shape[2]}")
    return (TensorSpec((tokens, k, w.shape[1]), "f32"),)


@register_op("moe_matmul", _moe_matmul_infer)
def moe_matmul(x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """y[t, j] = x[t] (or x[t, j]) @ w[ids[t, j]].T: each token through its chosen experts.

    x [T, K] feeds the same row to all k experts of a token (gate/up); x [T, k, K] gives each
    chosen expert its own row (down). Accumulated in float64 per (t, j), as `matmul` is, so a
    row's result does not depend on which other tokens chose the same expert.
    """
    values = _weight_values(w).astype(np.float64, copy=False)
    tokens, k = ids.shape
    rows = np.asarray(x, dtype=np.float64)
    if rows.ndim == 2:
        rows = np.broadcast_to(rows[:, None, :], (tokens, k, rows.shape[1]))
    out = np.zeros((tokens, k, values.shape[1]), np.float64)
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        out[t, j] = rows[t, j] @ values[int(e)].T
    return out.astype(np.float32)


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def _moe_matmul_gated_infer(x: TensorSpec, w: TensorSpec, ids: TensorSpec,
                            activation: str = "silu") -> tuple[TensorSpec, ...]:
    require(activation in GATED_ACTIVATIONS, "moe_matmul_gated", (x, w, ids), f"unknown activation {activation!r}")
    (y,) = _moe_matmul_infer(x, w, ids)
    require(w.shape[1] % 2 == 0, "moe_matmul_gated", (x, w, ids), "experts must stack [gate; up]: even rows")
    return (TensorSpec((*y.shape[:2], y.shape[2] // 2), "f32"),)


@register_op("moe_matmul_gated", _moe_matmul_gated_infer)
def moe_matmul_gated(x: np.ndarray, w: np.ndarray, ids: np.ndarray, activation: str = "silu") -> np.ndarray:
    """silu_and_mul(moe_matmul(x, w, ids)) (or gelu_tanh_and_mul) with each expert of w [E, 2F, K]
    stacking its F gate rows over its F up rows: the first half of every chosen expert's MLP."""
    return GATED_ACTIVATIONS[activation](moe_matmul(x, w, ids))


def _per_expert_infer(name: str):
    def infer(y: TensorSpec, bias: TensorSpec, ids: TensorSpec) -> tuple[TensorSpec, ...]:
        specs = (y, bias, ids)
        require(y.dtype == "f32" and len(y.shape) == 3, name, specs, "y must be f32 [T, k, N]")
        require(ids.dtype == "i32" and ids.shape == y.shape[:2], name, specs, f"ids must be i32 {list(y.shape[:2])}")
        require(bias.dtype == "f32" and len(bias.shape) == 2 and bias.shape[1] == y.shape[2], name, specs,
                f"the experts' values must be f32 [E, {y.shape[2]}]")
        return (y,)

    return infer



@register_op("moe_add_bias", _per_expert_infer("moe_add_bias"))
def moe_add_bias(y: np.ndarray, bias: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """y[t, j] + bias[ids[t, j]]: each chosen expert's own bias on its output row (gpt-oss)."""
    return (y + bias[ids]).astype(np.float32)


@register_op("moe_scale", _per_expert_infer("moe_scale"))
def moe_scale(y: np.ndarray, scale: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """y[t, j] * scale[ids[t, j]]: Gemma 4's per-expert scale of the chosen weights (y [T, k, 1])."""
    return (y * scale[ids]).astype(np.float32)


def _combine_infer(y: TensorSpec, weights: TensorSpec) -> tuple[TensorSpec, ...]:
    require(y.dtype == "f32" and len(y.shape) == 3, "moe_combine", (y, weights), "y must be f32 [T, k, N]")
    require(weights.dtype == "f32" and weights.shape == y.shape[:2], "moe_combine", (y, weights),
            f"weights must be f32 {list(y.shape[:2])}")
    return (TensorSpec((y.shape[0], y.shape[2]), "f32"),)


@register_op("moe_combine", _combine_infer)
def moe_combine(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum over j of weights[t, j] * y[t, j]: the experts' outputs mixed by their router weights,
    in slot order j = 0..k-1 (a fixed order per output element)."""
    acc = np.zeros((y.shape[0], y.shape[2]), np.float64)
    for j in range(y.shape[1]):
        acc += weights[:, j, None].astype(np.float64) * y[:, j].astype(np.float64)
    return acc.astype(np.float32)


def _combine_shared_infer(y: TensorSpec, weights: TensorSpec, shared: TensorSpec,
                          shared_logit: TensorSpec) -> tuple[TensorSpec, ...]:
    specs = (y, weights, shared, shared_logit)
    (out,) = _combine_infer(y, weights)
    require(shared.dtype == "f32" and shared.shape == out.shape, "moe_combine_shared", specs,
            f"the shared expert's output must be f32 {list(out.shape)}")
    require(shared_logit.dtype == "f32" and shared_logit.shape == (out.shape[0], 1), "moe_combine_shared", specs,
            f"the shared expert's gate logit must be f32 [{out.shape[0]}, 1]")
    return (out,)


@register_op("moe_combine_shared", _combine_shared_infer)
def moe_combine_shared(y: np.ndarray, weights: np.ndarray, shared: np.ndarray, shared_logit: np.ndarray) -> np.ndarray:
    """moe_combine(y, weights) + sigmoid(shared_logit[t]) * shared[t]: Qwen2-MoE's shared
    expert added after the routed experts (in float64, rounded once)."""
    acc = np.zeros((y.shape[0], y.shape[2]), np.float64)
    for j in range(y.shape[1]):
        acc += weights[:, j, None].astype(np.float64) * y[:, j].astype(np.float64)
    gate = 1.0 / (1.0 + np.exp(-shared_logit.astype(np.float64)))
    return (acc + gate * shared.astype(np.float64)).astype(np.float32)
