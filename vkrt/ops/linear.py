"""Matmul against stored-format weights, embedding and row gathers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vkrt.core.op import register_op, require
from vkrt.core.quant import bf16_to_f32
from vkrt.core.tensor import BLOCK_LAYOUT, FLOAT_WEIGHT_DTYPES, TensorSpec
from vkrt.ops.elementwise import gelu_tanh_and_mul, silu_and_mul
from vkrt.ops.elementwise import scale as scale_op
from vkrt.ops.norm import rms_norm

WEIGHT_DTYPES = FLOAT_WEIGHT_DTYPES + tuple(BLOCK_LAYOUT)


def _weight_values(w: np.ndarray) -> np.ndarray:
    """Weights reach references dequantized, except bf16, which arrives as its uint16 bits."""
    return bf16_to_f32(w) if w.dtype == np.uint16 else w


def _matmul_infer(x: TensorSpec, w: TensorSpec, scale: float = 1.0) -> tuple[TensorSpec, ...]:
    specs = (x, w)
    require(bool(np.isfinite(scale)), "matmul", specs, f"scale must be finite, got {scale}")
    require(x.dtype == "f32" and len(x.shape) == 2, "matmul", specs, "x must be f32 [T, K]")
    require(w.dtype in WEIGHT_DTYPES and len(w.shape) == 2, "matmul", specs,
            f"w must be [N, K] in one of {WEIGHT_DTYPES}")
    require(x.shape[1] == w.shape[1], "matmul", specs, "x and w disagree on K")
    return (TensorSpec((x.shape[0], w.shape[0]), "f32"),)


@register_op("matmul", _matmul_infer)
def matmul(x: np.ndarray, w: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """x @ w.T with w [N, K] (PyTorch Linear layout), accumulated in float64; times `scale`
    as the scale op rounds it when given (what scale(matmul(x, w), s) fuses to).

    Weights arrive dequantized; the reference backend caches them as float64 once, so
    no per-call conversion of a large LM head happens here.
    """
    w64 = _weight_values(w).astype(np.float64, copy=False)
    y = (np.asarray(x, dtype=np.float64) @ w64.T).astype(np.float32)
    return y if scale == 1.0 else scale_op(y, scale)


def _gated_matmul_infer(name: str) -> Callable[[TensorSpec, TensorSpec], tuple[TensorSpec, ...]]:
    def infer(x: TensorSpec, w: TensorSpec) -> tuple[TensorSpec, ...]:
        _matmul_infer(x, w)
        require(w.shape[0] % 2 == 0, name, (x, w), "w must stack [gate; up]: even rows")
        return (TensorSpec((x.shape[0], w.shape[0] // 2), "f32"),)
    return infer


_matmul_silu_and_mul_infer = _gated_matmul_infer("matmul_silu_and_mul")


@register_op("matmul_silu_and_mul", _matmul_silu_and_mul_infer)
def matmul_silu_and_mul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """silu_and_mul(matmul(x, w)) with w = gate rows stacked over up rows: a SwiGLU MLP's first half."""
    return silu_and_mul(matmul(x, w))


@register_op("matmul_gelu_tanh_and_mul", _gated_matmul_infer("matmul_gelu_tanh_and_mul"))
def matmul_gelu_tanh_and_mul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """gelu_tanh_and_mul(matmul(x, w)) with w = gate rows over up rows: a GeGLU MLP's first half."""
    return gelu_tanh_and_mul(matmul(x, w))


GATED_MATMULS = {"silu": matmul_silu_and_mul, "gelu_tanh": matmul_gelu_tanh_and_mul}


def _rms_norm_matmul_infer(x: TensorSpec, g: TensorSpec, w: TensorSpec, eps: float,
                           gated: bool = False, activation: str = "silu") -> tuple[TensorSpec, ...]:
    require(activation in GATED_MATMULS, "rms_norm_matmul", (x, g, w), f"unknown activation {activation!r}")
    out = (_matmul_silu_and_mul_infer if gated else _matmul_infer)(x, w)
    require(g.dtype == "f32" and g.shape == (x.shape[1],), "rms_norm_matmul", (x, g, w),
            "the norm weight must be f32 [K]")
    return out


@register_op("rms_norm_matmul", _rms_norm_matmul_infer)
def rms_norm_matmul(x: np.ndarray, g: np.ndarray, w: np.ndarray, eps: float,
                    gated: bool = False, activation: str = "silu") -> np.ndarray:
    """matmul(rms_norm(x, g, eps), w), or its gated form (SwiGLU, or GeGLU for "gelu_tanh")
    when gated: a pre-norm block's input."""
    return (GATED_MATMULS[activation] if gated else matmul)(rms_norm(x, g, eps), w)


def _require_residual(name: str, y: TensorSpec, specs: tuple[TensorSpec, ...]) -> None:
    """The added operand: y's shape (a residual) or one row [N] broadcast over y's rows (a bias)."""
    residual = specs[-1]
    require(residual.dtype == "f32" and residual.shape in (y.shape, y.shape[1:]), name, specs,
            f"residual must be f32 {list(y.shape)} or a bias f32 {list(y.shape[1:])}")


def _matmul_add_infer(x: TensorSpec, w: TensorSpec, residual: TensorSpec, scale: float = 1.0
                      ) -> tuple[TensorSpec, ...]:
    (y,) = _matmul_infer(x, w, scale)
    _require_residual("matmul_add", y, (x, w, residual))
    return (y,)


@register_op("matmul_add", _matmul_add_infer)
def matmul_add(x: np.ndarray, w: np.ndarray, residual: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """add(matmul(x, w, scale), residual): a block's output projection (times a residual
    multiplier, Granite's) added to the residual stream, or a projection plus its bias [N]."""
    return (matmul(x, w, scale) + residual).astype(np.float32)


def _rms_norm_matmul_add_infer(x: TensorSpec, g: TensorSpec, w: TensorSpec, residual: TensorSpec,
                               eps: float) -> tuple[TensorSpec, ...]:
    (y,) = _rms_norm_matmul_infer(x, g, w, eps)
    _require_residual("rms_norm_matmul_add", y, (x, g, w, residual))
    return (y,)


@register_op("rms_norm_matmul_add", _rms_norm_matmul_add_infer)
def rms_norm_matmul_add(x: np.ndarray, g: np.ndarray, w: np.ndarray, residual: np.ndarray,
                        eps: float) -> np.ndarray:
    """add(rms_norm_matmul(x, g, w, eps), residual): a pre-norm projection plus its bias [N]
    (Qwen2's q/k/v), or plus a residual [T, N]."""
    return (rms_norm_matmul(x, g, w, eps) + residual).astype(np.float32)


def _embedding_infer(table: TensorSpec, ids: TensorSpec) -> tuple[TensorSpec, ...]:
    specs = (table, ids)
    require(table.dtype in WEIGHT_DTYPES and len(table.shape) == 2, "embedding", specs,
            "table must be [V, D] in a weight format")
    require(ids.dtype == "i32" and len(ids.shape) == 1, "embedding", specs, "ids must be i32 [T]")
    return (TensorSpec((ids.shape[0], table.shape[1]), "f32"),)


@register_op("embedding", _embedding_infer)
def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of the (dequantized) table; out-of-range ids are an error of the caller."""
    return _weight_values(table)[ids.astype(np.int64)].astype(np.float32)


def _gather_rows_infer(x: TensorSpec, index: TensorSpec) -> tuple[TensorSpec, ...]:
    specs = (x, index)
    require(x.dtype == "f32" and len(x.shape) == 2, "gather_rows", specs, "x must be f32 [T, D]")
    require(index.dtype == "i32" and len(index.shape) == 1, "gather_rows", specs, "index must be i32 [R]")
    return (TensorSpec((index.shape[0], x.shape[1]), "f32"),)


@register_op("gather_rows", _gather_rows_infer)
def gather_rows(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """x[index]: picks the rows that need logits (the last token of each sequence)."""
    return x[index.astype(np.int64)].astype(np.float32)
