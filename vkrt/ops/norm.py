"""Normalisations. Two-pass (the row statistic, then normalise) in every implementation."""

from __future__ import annotations

import numpy as np

from vkrt.core.op import register_op, require
from vkrt.core.tensor import TensorSpec


def _check_rows(name: str, x: TensorSpec, *rest: TensorSpec) -> None:
    specs = (x, *rest)
    require(x.dtype == "f32" and len(x.shape) == 2, name, specs, "x must be f32 [T, D]")
    for w in rest:
        require(w.dtype == "f32" and w.shape == (x.shape[1],), name, specs, "weights must be f32 [D]")


def _rms_norm_infer(x: TensorSpec, w: TensorSpec, eps: float) -> tuple[TensorSpec, ...]:
    _check_rows("rms_norm", x, w)
    return (x,)


@register_op("rms_norm", _rms_norm_infer)
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w, per row."""
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    return (x64 * inv * w).astype(np.float32)


def _rms_norm_add_infer(
    x: TensorSpec, w: TensorSpec, residual: TensorSpec, eps: float
) -> tuple[TensorSpec, ...]:
    _check_rows("rms_norm_add", x, w)
    require(residual == x, "rms_norm_add", (x, w, residual), "residual must match x")
    return (x,)


@register_op("rms_norm_add", _rms_norm_add_infer)
def rms_norm_add(x: np.ndarray, w: np.ndarray, residual: np.ndarray, eps: float) -> np.ndarray:
    """residual + rms_norm(x) * w: a post-norm block's residual step (Gemma's sandwich norms),
    the fusion of add(rms_norm(x, w), residual); equal to that composition bit for bit."""
    return (residual + rms_norm(x, w, eps)).astype(np.float32)


def _layer_norm_infer(
    x: TensorSpec, w: TensorSpec, b: TensorSpec, eps: float
) -> tuple[TensorSpec, ...]:
    _check_rows("layer_norm", x, w, b)
    return (x,)


@register_op("layer_norm", _layer_norm_infer)
def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * w + b, per row."""
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    return (centered * inv * w + b).astype(np.float32)
