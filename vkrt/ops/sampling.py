"""sample_top_k: one token per row from the top-k logits, tempered, min-p and top-p filtered.

The reference below is the spec, written so a shader can reproduce it bit for bit: the only
floating-point operations are float32 additions, subtractions, multiplications and
comparisons, each rounded once (no fused multiply-add, no division, no library exp), in a
fixed order over at most MAX_TOP_K candidates. Every other step (selection, floor, scaling
by a power of two) is exact. Weights below 2**-126 are defined as 0, so no subnormal arises
and a device that flushes denormals agrees too (unless two logits differ by a subnormal).
"""

from __future__ import annotations

import numpy as np

from vkrt.core.op import register_op, require
from vkrt.core.tensor import TensorSpec

MAX_TOP_K = 64
# Columns of the params operand, per row.
PARAM_COLUMNS = ("inv_temperature", "top_p", "min_p", "top_k")
LOG2E = np.float32(1.442695)  # float32(log2(e)), bits 0x3FB8AA3B
# 2**f on [0, 1) as c0 + c1 f + ... + c6 f**6 evaluated by Horner in float32; fitted by least
# squares in relative error, max relative error 8.4e-8. The shader holds the same bits.
EXP2_COEFFS = np.array([0x3F800000, 0x3F317216, 0x3E75FEAD, 0x3D634478, 0x3C1E8620, 0x3AA36993,
                        0x3962A320], np.uint32).view(np.float32)
# The largest float32 below 1: uniforms are clamped to [0, U_MAX] so u * total < total.
U_MAX = np.float32(1.0) - np.float32(2.0**-24)
ALL_ALLOWED = np.uint32(0xFFFFFFFF)  # a mask word that allows its 32 tokens


def mask_words(vocab: int) -> int:
    """u32 words per row of a token mask over `vocab` tokens (bit j % 32 of word j // 32)."""
    return -(-vocab // 32)


def allowed_tokens(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    """bool [vocab]: which tokens one row of a token mask allows."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row, np.uint32).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def sample_params(temperature: float, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 1) -> np.ndarray:
    """One row of the params operand; temperature must be > 0 (greedy is top_k=1)."""
    inv_temperature = np.float32(1.0) / np.float32(temperature)
    return np.array([inv_temperature, top_p, min_p, top_k], np.float32)


def top_k_order(x: np.ndarray, k: int) -> np.ndarray:
    """The first k indices of row x in argmax order: NaNs first, then larger values, ties
    by lower index. Only columns at or above the k-th largest value get sorted."""
    nans = np.isnan(x)
    key = np.where(nans, np.float32(np.inf), x)  # a NaN ranks with +inf for the cut
    kth = np.partition(key, key.shape[0] - k)[key.shape[0] - k]
    columns = np.flatnonzero(key >= kth)
    order = np.lexsort((columns, -key[columns], ~nans[columns]))  # last key is the primary one
    return columns[order[:k]]


def exp2_weights(t: np.ndarray) -> np.ndarray:
    """2**t for float32 t <= 0 as the shader computes it: exact split t = n + f, Horner for
    2**f, exact scaling by 2**n; 0 where t < -126 or is NaN (no subnormal ever)."""
    t = np.asarray(t, np.float32)
    ok = t >= np.float32(-126.0)
    t = np.where(ok, t, np.float32(0.0))
    n = np.floor(t)
    f = t - n  # exact: the fractional part of a float32 is a float32
    q = np.full_like(f, EXP2_COEFFS[-1])
    for c in EXP2_COEFFS[-2::-1]:
        q = q * f + c  # two roundings, as the shader's `precise` (no contraction into fma)
    scale = ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(np.float32)
    return np.where(ok, q * scale, np.float32(0.0))


# The id of a row with no distribution to draw from: its best allowed logit is NaN or +-inf
# (NaN sorts first and +inf next, so that is any NaN or +inf it allows, or all -inf).
NONFINITE = -1


def sample_row(x: np.ndarray, params: np.ndarray, u: np.float32) -> int:
    """The token of one row; see `sample_top_k`."""
    inv_temperature, top_p, min_p, top_k = (np.float32(p) for p in params)
    k = min(max(int(top_k), 1), MAX_TOP_K, x.shape[0])
    candidates = top_k_order(x, k)
    values = x[candidates].astype(np.float32)
    if not np.isfinite(values[0]):
        return NONFINITE
    with np.errstate(invalid="ignore", over="ignore"):  # -inf - -inf, NaN rows: weight 0
        t = (values[1:] - values[0]) * (inv_temperature * LOG2E)
    weights = np.concatenate([np.ones(1, np.float32), exp2_weights(t)])  # the top candidate weighs 1
    keep = weights >= min_p  # min-p relative to the top weight, 1
    keep[0] = True
    kept = candidates[keep]
    cumulative = np.cumsum(weights[keep], dtype=np.float32)  # sequential float32 sums
    # Top-p: the smallest prefix whose mass reaches top_p of the min-p-kept mass.
    last = _first(cumulative >= top_p * cumulative[-1], default=kept.shape[0] - 1)
    target = np.clip(np.float32(u), np.float32(0.0), U_MAX) * cumulative[last]
    return int(kept[_first(cumulative[: last + 1] > target, default=last)])


def _first(mask: np.ndarray, default: int) -> int:
    return int(np.argmax(mask)) if mask.any() else default


def _sample_top_k_infer(logits: TensorSpec, params: TensorSpec, uniforms: TensorSpec,
                        mask: TensorSpec) -> tuple[TensorSpec, ...]:
    specs = (logits, params, uniforms, mask)
    require(logits.dtype == "f32" and len(logits.shape) == 2, "sample_top_k", specs, "logits must be f32 [R, V]")
    rows, vocab = logits.shape
    require(mask.dtype == "u32" and mask.shape == (rows, mask_words(vocab)), "sample_top_k", specs,
            f"mask must be u32 [R, ceil(V / 32)] = [{rows}, {mask_words(vocab)}]")
    require(params.dtype == "f32" and params.shape == (rows, 4), "sample_top_k", specs,
            f"params must be f32 [R, 4] ({', '.join(PARAM_COLUMNS)})")
    require(uniforms.dtype == "f32" and uniforms.shape == (rows,), "sample_top_k", specs, "uniforms must be f32 [R]")
    return (TensorSpec((rows,), "i32"),)


@register_op("sample_top_k", _sample_top_k_infer)
def sample_top_k(logits: np.ndarray, params: np.ndarray, uniforms: np.ndarray,
                 mask: np.ndarray | None = None) -> np.ndarray:
    """Per row, a token drawn from the top-k allowed logits after temperature, min-p and top-p.

    mask [R, ceil(V / 32)] u32 (None: all ones) allows token j of row r when bit j % 32 of
    mask[r, j // 32] is set; a token it disallows reads as -inf in every step below (so it
    weighs 0 and is never drawn while the row allows any token with a logit above -inf).
    Row r with params (s, top_p, min_p, top_k) = params[r] (s = 1 / temperature) and u =
    uniforms[r], all float32:
    1. k = clamp(int(top_k), 1, min(MAX_TOP_K, V)); candidates c_0..c_{k-1} are the first
       k indices in argmax order (NaN first, larger first, lower index on ties): c_0 is the
       argmax, so top_k=1 is greedy.
    2. Weights: w_0 = 1; w_i = exp2_weights((x[c_i] - x[c_0]) * (s * LOG2E)) for i >= 1 --
       the softmax numerators over the candidates, with the top one normalised to 1.
    3. min-p keeps candidate 0 and those with w_i >= min_p; S_j are the sequential float32
       sums of the kept weights in candidate order.
    4. top-p keeps kept candidates up to the first j with S_j >= top_p * S_last (all of
       them if none).
    5. target = clamp(u, 0, U_MAX) * S_j; the token is the first kept candidate (within the
       top-p prefix) whose S exceeds the target (the prefix's last one if rounding leaves none).
    A row whose x[c_0] is not finite (NaN, +inf, or every allowed logit -inf) gives NONFINITE (-1).
    """
    rows, vocab = logits.shape
    ids = np.empty(rows, np.int32)
    for r in range(rows):
        x = np.asarray(logits[r], np.float32)
        if mask is not None:
            x = np.where(allowed_tokens(mask[r], vocab), x, np.float32(-np.inf))
        ids[r] = sample_row(x, params[r], np.float32(uniforms[r]))
    return ids
