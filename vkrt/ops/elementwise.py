"""Elementwise ops, gated activations and dtype casts."""

from __future__ import annotations

import numpy as np

from vkrt.core.op import register_op, require
from vkrt.core.quant import bf16_to_f32, f32_to_bf16
from vkrt.core.tensor import TensorSpec

CAST_DTYPES = ("f32", "f16", "bf16")


def _binary_infer(name: str):
    def infer(a: TensorSpec, b: TensorSpec) -> tuple[TensorSpec, ...]:
        require(a.dtype == "f32" and b.dtype == "f32", name, (a, b), "both inputs must be f32")
        require(
            b.shape == a.shape or (len(a.shape) >= 1 and b.shape == a.shape[-1:]),
            name, (a, b), "b must have a's shape or be a row broadcast over a's last dim",
        )
        return (TensorSpec(a.shape, "f32"),)

    return infer


@register_op("add", _binary_infer("add"))
def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b (b may be one row broadcast over a)."""
    return (a + b).astype(np.float32)


def _unary_infer(name: str, param: str):
    def infer(x: TensorSpec, **params: float) -> tuple[TensorSpec, ...]:
        require(x.dtype == "f32", name, (x,), "x must be f32")
        value = float(params[param])
        require(bool(np.isfinite(value)) and (name != "softcap" or value > 0.0), name, (x,),
                f"{param} must be finite{' and > 0' if name == 'softcap' else ''}, got {value}")
        return (TensorSpec(x.shape, "f32"),)

    return infer


@register_op("sigmoid_mul", _binary_infer("sigmoid_mul"))
def sigmoid_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * sigmoid(b): an output gate (Qwen3.5's gated attention)."""
    return (a * (np.float32(1) / (np.float32(1) + np.exp(-b.astype(np.float32))))).astype(np.float32)


@register_op("scale", _unary_infer("scale", "factor"))
def scale(x: np.ndarray, factor: float) -> np.ndarray:
    """x * factor in f32 (Gemma's embedding scale sqrt(hidden), rounded to f32 as HF does)."""
    return (x * np.float32(factor)).astype(np.float32)


@register_op("softcap", _unary_infer("softcap", "cap"))
def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): Gemma 2's final-logit softcapping."""
    return (cap * np.tanh(x.astype(np.float64) / cap)).astype(np.float32)


def _relu_squared_infer(x: TensorSpec) -> tuple[TensorSpec, ...]:
    require(x.dtype == "f32", "relu_squared", (x,), "x must be f32")
    return (TensorSpec(x.shape, "f32"),)


@register_op("relu_squared", _relu_squared_infer)
def relu_squared(x: np.ndarray) -> np.ndarray:
    """max(x, 0)^2: the ungated MLP activation of Nemotron-H (transformers' "relu2")."""
    r = np.maximum(x.astype(np.float32), np.float32(0))
    return (r * r).astype(np.float32)


def _gated_infer(name: str):
    def infer(x: TensorSpec) -> tuple[TensorSpec, ...]:
        # [T, 2F], or [T, k, 2F] (a MoE layer's rows per chosen expert): halves of the last dim.
        require(x.dtype == "f32" and len(x.shape) in (2, 3), name, (x,), "expects f32 [T, 2F] or [T, k, 2F]")
        require(x.shape[-1] % 2 == 0, name, (x,), "last dim must be even (gate and up halves)")
        return (TensorSpec((*x.shape[:-1], x.shape[-1] // 2), "f32"),)

    return infer


@register_op("silu_and_mul", _gated_infer("silu_and_mul"))
def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """silu(x[..., :F]) * x[..., F:] — the SwiGLU gate of Llama MLPs."""
    f = x.shape[-1] // 2
    gate, up = x[..., :f].astype(np.float64), x[..., f:]
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


@register_op("gelu_tanh_and_mul", _gated_infer("gelu_tanh_and_mul"))
def gelu_tanh_and_mul(x: np.ndarray) -> np.ndarray:
    """gelu_tanh(x[..., :F]) * x[..., F:] — the GeGLU gate of Gemma MLPs."""
    f = x.shape[-1] // 2
    g, up = x[..., :f].astype(np.float64), x[..., f:]
    gelu = 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3)))
    return (gelu * up).astype(np.float32)


def _clamped_swiglu_infer(x: TensorSpec, alpha: float, limit: float) -> tuple[TensorSpec, ...]:
    (y,) = _gated_infer("clamped_swiglu")(x)
    require(bool(np.isfinite(alpha)) and bool(np.isfinite(limit)) and limit > 0, "clamped_swiglu", (x,),
            f"alpha must be finite and limit > 0, got alpha {alpha}, limit {limit}")
    return (y,)


@register_op("clamped_swiglu", _clamped_swiglu_infer)
def clamped_swiglu(x: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's expert gate on [gate | up] halves: g = min(gate, limit), u = clamp(up, -limit,
    limit), g * sigmoid(alpha * g) * (u + 1), in float64, rounded once."""
    f = x.shape[-1] // 2
    g = np.minimum(x[..., :f].astype(np.float64), limit)
    u = np.clip(x[..., f:].astype(np.float64), -limit, limit)
    return (g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)).astype(np.float32)


def _concat_infer(*parts: TensorSpec) -> tuple[TensorSpec, ...]:
    require(len(parts) in (2, 3), "concat_columns", parts, "takes two or three parts")
    require(all(p.dtype == "f32" and len(p.shape) == 2 for p in parts), "concat_columns", parts,
            "parts must be f32 [T, width]")
    require(len({p.shape[0] for p in parts}) == 1, "concat_columns", parts, "parts must have the same rows")
    return (TensorSpec((parts[0].shape[0], sum(p.shape[1] for p in parts)), "f32"),)


@register_op("concat_columns", _concat_infer)
def concat_columns(*parts: np.ndarray) -> np.ndarray:
    """[a | b | c] along columns: the q, k, v (or gate, up) of projections kept apart
    because their weights are stored in different formats, stacked for the op that follows."""
    return np.concatenate(parts, axis=1)


def _gelu_slice_infer(gate: TensorSpec, x: TensorSpec, start: int) -> tuple[TensorSpec, ...]:
    specs = (gate, x)
    require(gate.dtype == x.dtype == "f32" and len(gate.shape) == len(x.shape) == 2 and gate.shape[0] == x.shape[0],
            "gelu_tanh_mul_slice", specs, "gate and x must be f32 [T, F] and [T, N]")
    require(0 <= start and start + gate.shape[1] <= x.shape[1], "gelu_tanh_mul_slice", specs,
            f"columns {start} .. {start + gate.shape[1] - 1} must lie within the {x.shape[1]} of x")
    return (gate,)


@register_op("gelu_tanh_mul_slice", _gelu_slice_infer)
def gelu_tanh_mul_slice(gate: np.ndarray, x: np.ndarray, start: int) -> np.ndarray:
    """gelu_tanh_and_mul([gate | x[:, start:start + F]]): Gemma 4's per-layer gate, which multiplies
    by the layer's slice of the per-layer inputs without copying it out."""
    return gelu_tanh_and_mul(np.concatenate([gate, x[:, start:start + gate.shape[1]]], axis=1))


def _cast_infer(x: TensorSpec, dtype: str) -> tuple[TensorSpec, ...]:
    require(x.dtype in CAST_DTYPES, "cast", (x,), f"input dtype must be one of {CAST_DTYPES}")
    require(dtype in CAST_DTYPES, "cast", (x,), f"target dtype must be one of {CAST_DTYPES}, not {dtype!r}")
    return (TensorSpec(x.shape, dtype),)


def _to_f32(x: np.ndarray) -> np.ndarray:
    return bf16_to_f32(x) if x.dtype == np.uint16 else x.astype(np.float32)


@register_op("cast", _cast_infer)
def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Convert between f32, f16 and bf16 (round to nearest even)."""
    f = _to_f32(x)
    if dtype == "f32":
        return f
    if dtype == "f16":
        return f.astype(np.float16)
    return f32_to_bf16(f)


def _copy_infer(x: TensorSpec) -> tuple[TensorSpec, ...]:
    require(x.dtype in ("f32", "f16", "bf16", "i32", "u32"), "copy", (x,), "activation dtypes only")
    return (TensorSpec(x.shape, x.dtype),)


@register_op("copy", _copy_infer)
def copy(x: np.ndarray) -> np.ndarray:
    """A new tensor with the same bytes."""
    return x.copy()
