"""Native rms_norm, rms_norm_add and layer_norm vs their numpy references, on both access paths.

Bound: NMSE <= 1e-10 (measured ~5e-15 on llvmpipe: f32 accumulation against a float64
reference). rms_norm_add equals rms_norm then add bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from vkrt.errors import VkrtError

NORM_NMSE = 1e-10
SHAPES = [(1, 1), (3, 7), (5, 576), (2, 1000), (1, 8192)]
EPS = 1e-5


def _inputs(rng: np.random.Generator, t: int, d: int) -> dict[str, np.ndarray]:
    f32 = np.float32
    return {"x": (rng.standard_normal((t, d)) * 3).astype(f32), "r": rng.standard_normal((t, d)).astype(f32),
            "w": rng.standard_normal(d).astype(f32), "b": rng.standard_normal(d).astype(f32)}


def _run(vk, op: str, a: dict[str, np.ndarray]):
    """Run one norm op natively on the Vulkan backend; returns the host array."""
    up = {k: vk.upload(v) for k, v in a.items()}
    if op == "rms_norm":
        return ops.rms_norm(up["x"], up["w"], EPS).numpy()
    if op == "rms_norm_add":
        return ops.rms_norm_add(up["x"], up["w"], up["r"], EPS).numpy()
    return ops.layer_norm(up["x"], up["w"], up["b"], EPS).numpy()


def _reference(op: str, a: dict[str, np.ndarray]):
    if op == "rms_norm":
        return ops.OPS[op].reference(a["x"], a["w"], EPS)
    if op == "rms_norm_add":
        return ops.OPS[op].reference(a["x"], a["w"], a["r"], EPS)
    return ops.OPS[op].reference(a["x"], a["w"], a["b"], EPS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_add", "layer_norm"])
def test_norm_matches_reference(vk, rng, op: str, shape: tuple[int, int]) -> None:
    a = _inputs(rng, *shape)
    drains = vk.counters.drains
    got, want = _run(vk, op, a), _reference(op, a)
    assert vk.counters.drains == drains, "the norm fell back to the reference tier"
    assert nmse(got, want) <= NORM_NMSE


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_add", "layer_norm"])
def test_norm_is_batch_invariant(vk, rng, op: str, rows: int) -> None:
    """Row t of a T-row call is bit-identical to a 1-row call of that row (invariant 9)."""
    a = _inputs(rng, rows, 576)
    batched = _run(vk, op, a)
    for t in range(rows):
        single = _run(vk, op, {**a, "x": a["x"][t : t + 1], "r": a["r"][t : t + 1]})
        np.testing.assert_array_equal(batched[t : t + 1], single)


def test_norm_rejects_bad_shapes(vk) -> None:
    x = vk.upload(np.zeros((2, 8), np.float32))
    with pytest.raises(VkrtError, match="rms_norm"):
        ops.rms_norm(x, vk.upload(np.zeros(7, np.float32)), EPS)
    with pytest.raises(VkrtError, match="rms_norm_add"):
        ops.rms_norm_add(x, vk.upload(np.zeros(8, np.float32)), vk.upload(np.zeros((2, 7), np.float32)), EPS)
    with pytest.raises(VkrtError, match="layer_norm"):
        ops.layer_norm(vk.upload(np.zeros((2, 8), np.float16)), vk.upload(np.zeros(8, np.float32)),
                       vk.upload(np.zeros(8, np.float32)), EPS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rms_norm_add_is_rms_norm_then_add_bit_for_bit(vk, rng, shape: tuple[int, int]) -> None:
    """The fusion of add(rms_norm(x), r) may replace the pair only if it changes no bit."""
    a = _inputs(rng, *shape)
    up = {k: vk.upload(v) for k, v in a.items()}
    composed = ops.add(ops.rms_norm(up["x"], up["w"], EPS), up["r"]).numpy()
    np.testing.assert_array_equal(_run(vk, "rms_norm_add", a), composed)
