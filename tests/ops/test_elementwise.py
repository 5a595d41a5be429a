"""Native add, scale, softcap, relu_squared, silu_and_mul, gelu_tanh_and_mul and gather_rows vs their references.

add, scale, relu_squared and gather_rows are single correctly rounded f32 operations (or moves):
bit-exact. The gated activations use the shader's f32 exp against a float64 reference:
NMSE <= 1e-10 (measured ~1e-14 on llvmpipe); softcap's f32 tanh is bounded per value.
"""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from vkrt.errors import VkrtError
from vkrt.ops import elementwise

GATED_NMSE = 1e-10
SHAPES = [(1, 1), (3, 7), (5, 576), (2, 1000)]


def _no_drain(vk, fn, *args):
    drains = vk.counters.drains
    out = fn(*args).numpy()
    assert vk.counters.drains == drains, "the op fell back to the reference tier"
    return out


@pytest.mark.parametrize("broadcast", [False, True], ids=["same", "row"])
@pytest.mark.parametrize("shape", SHAPES + [(7,)], ids=str)
def test_add_is_bit_exact(vk, rng, shape: tuple[int, ...], broadcast: bool) -> None:
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape[-1:] if broadcast else shape).astype(np.float32)
    got = _no_drain(vk, ops.add, vk.upload(a), vk.upload(b))
    np.testing.assert_array_equal(got, ops.OPS["add"].reference(a, b))


@pytest.mark.parametrize("shape", SHAPES + [(3, 4, 5)], ids=str)
def test_relu_squared_is_bit_exact(vk, rng, shape: tuple[int, ...]) -> None:
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x.flat[0] = -0.0
    got = _no_drain(vk, ops.relu_squared, vk.upload(x))
    want = ops.OPS["relu_squared"].reference(x)
    np.testing.assert_array_equal(got, want)
    assert (want >= 0).all() and (want[x <= 0] == 0).all()  # a negative input is exactly 0, never -0


GATED_CASES = [(op, shape) for op in ("silu_and_mul", "gelu_tanh_and_mul")
               for shape in [(1, 2), (3, 14), (5, 3072), (2, 2000)]
               # A lone gelu of gate < -4 loses relative precision (test below), so the
               # one-element case of gelu would measure only that.
               if (op, shape) != ("gelu_tanh_and_mul", (1, 2))]


@pytest.mark.parametrize(("op", "shape"), GATED_CASES, ids=str)
def test_gated_matches_reference(vk, rng, op: str, shape: tuple[int, int]) -> None:
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    if shape[1] >= 8:  # gates that overflow exp and saturate tanh (a lone one would dominate NMSE)
        x[0, :4] = [-100.0, 100.0, -20.0, 20.0]
    got = _no_drain(vk, getattr(ops, op), vk.upload(x))
    want = ops.OPS[op].reference(x)
    assert got.shape == want.shape
    assert nmse(got, want) <= GATED_NMSE


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_of_rows_per_chosen_expert(vk, rng, op: str) -> None:
    """[T, k, 2F] (a MoE layer's gate|up per chosen expert) is [T * k, 2F] viewed: the same bits."""
    x = (rng.standard_normal((3, 4, 38)) * 3).astype(np.float32)
    got = _no_drain(vk, getattr(ops, op), vk.upload(x))
    assert got.shape == (3, 4, 19)
    assert got.tobytes() == _no_drain(vk, getattr(ops, op), vk.upload(x.reshape(12, 38))).tobytes()
    np.testing.assert_array_equal(ops.OPS[op].reference(x), ops.OPS[op].reference(x.reshape(12, 38)).reshape(3, 4, 19))


def test_gelu_tanh_keeps_relative_precision_in_the_negative_tail(vk) -> None:
    gate = np.linspace(-5.0, -3.0, 64, dtype=np.float32)  # where the float64 reference is exact
    x = np.concatenate([gate, np.ones_like(gate)])[None, :]
    got = ops.gelu_tanh_and_mul(vk.upload(x)).numpy()
    np.testing.assert_allclose(got, ops.OPS["gelu_tanh_and_mul"].reference(x), rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (10, 576)], ids=str)
def test_gather_rows_is_bit_exact(vk, rng, shape: tuple[int, int]) -> None:
    x = rng.standard_normal(shape).astype(np.float32)
    rows = shape[0]
    index = np.array([rows - 1, 0, rows - 1, rows // 2], np.int32)  # repeats and the last row
    got = _no_drain(vk, ops.gather_rows, vk.upload(x), vk.upload(index))
    np.testing.assert_array_equal(got, ops.OPS["gather_rows"].reference(x, index))


def test_elementwise_rejects_bad_input(vk) -> None:
    a = vk.upload(np.zeros((2, 8), np.float32))
    with pytest.raises(VkrtError, match="add"):
        ops.add(a, vk.upload(np.zeros((2, 7), np.float32)))
    with pytest.raises(VkrtError, match="add"):
        ops.add(a, vk.upload(np.zeros((2, 8), np.int32)))
    with pytest.raises(VkrtError, match="silu_and_mul"):
        ops.silu_and_mul(vk.upload(np.zeros((2, 7), np.float32)))
    with pytest.raises(VkrtError, match="gelu_tanh_and_mul"):
        ops.gelu_tanh_and_mul(vk.upload(np.zeros(8, np.float32)))
    with pytest.raises(VkrtError, match="gather_rows"):
        ops.gather_rows(a, vk.upload(np.zeros(2, np.float32)))


def test_scale_and_softcap_references() -> None:
    """The specs against arithmetic done here: f32 products, and cap * tanh(x / cap)."""
    x = np.array([[0.0, 1.5, -3.25, 1e-30, 100.0, -1e4]], np.float32)
    np.testing.assert_array_equal(ops.OPS["scale"].reference(x, factor=24.0),
                                  x * np.float32(24.0))
    got = ops.OPS["softcap"].reference(x, cap=30.0)
    want = np.array([[0.0, 30 * np.tanh(0.05), -30 * np.tanh(3.25 / 30), 1e-30, 30 * np.tanh(100 / 30), -30.0]])
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)


@pytest.mark.parametrize("shape", SHAPES + [(7,)], ids=str)
def test_scale_is_bit_exact(vk, rng, shape: tuple[int, ...]) -> None:
    x = rng.standard_normal(shape).astype(np.float32)
    factor = 640 ** 0.5  # Gemma-3-270M's embedding scale, rounded to f32 by the op
    got = _no_drain(vk, ops.scale, vk.upload(x), factor)
    np.testing.assert_array_equal(got, x * np.float32(factor))


SOFTCAP_REL = 1e-6  # f32 tanh vs the float64 reference, relative per value (measured <= 5.2e-7 over 3e5)


@pytest.mark.parametrize("cap", [30.0, 50.0, 1.0])
def test_softcap_matches_reference(vk, rng, cap: float) -> None:
    """Relative error per value, from tiny inputs (where tanh(x) ~ x) to saturation."""
    x = (rng.standard_normal((3, 1001)) * 10.0 ** rng.uniform(-6, 3, (3, 1001))).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 1e-30, cap * 0.25, -cap * 0.25, 1e30]  # zeros, tiny, the branch edge, huge
    got = _no_drain(vk, ops.softcap, vk.upload(x), cap)
    want = ops.OPS["softcap"].reference(x, cap=cap).astype(np.float64)
    rel = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    assert float(rel.max()) <= SOFTCAP_REL
    assert np.all(np.abs(got) <= cap)


def test_scale_and_softcap_reject_bad_input(vk) -> None:
    x = vk.upload(np.zeros((2, 3), np.float32))
    with pytest.raises(VkrtError, match="softcap"):
        ops.softcap(x, 0.0)
    with pytest.raises(VkrtError, match="scale"):
        ops.scale(x, float("nan"))
    with pytest.raises(VkrtError, match="scale"):
        ops.scale(vk.upload(np.zeros(3, np.int32)), 2.0)


@pytest.mark.parametrize("widths", [(1, 1), (64, 16), (7, 3, 5), (576, 192, 192)], ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_concat_columns_is_bit_exact(vk, rng, rows: int, widths: tuple[int, ...]) -> None:
    parts = [rng.standard_normal((rows, w)).astype(np.float32) for w in widths]
    got = _no_drain(vk, ops.concat_columns, *(vk.upload(p) for p in parts))
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=1))


@pytest.mark.parametrize(("width", "start", "columns"), [(1, 0, 1), (48, 16, 8), (48, 40, 8), (35, 3, 29)], ids=str)
@pytest.mark.parametrize("rows", [1, 5])
def test_gelu_tanh_mul_slice_equals_the_gated_op_on_the_slice(vk, rng, rows: int, width: int, start: int,
                                                               columns: int) -> None:
    """Bit for bit what the gated kernel gives [gate | the slice]; within the gated ops' bound of
    the numpy reference."""
    gate = rng.standard_normal((rows, columns)).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    stacked = np.concatenate([gate, x[:, start:start + columns]], axis=1)
    got = _no_drain(vk, ops.gelu_tanh_mul_slice, vk.upload(gate), vk.upload(x), start)
    np.testing.assert_array_equal(got, _no_drain(vk, ops.gelu_tanh_and_mul, vk.upload(stacked)))
    assert nmse(got, elementwise.gelu_tanh_and_mul(stacked)) <= GATED_NMSE


def test_gelu_tanh_mul_slice_rejects_a_window_past_the_columns(vk) -> None:
    gate, x = vk.upload(np.zeros((2, 5), np.float32)), vk.upload(np.zeros((2, 8), np.float32))
    with pytest.raises(VkrtError, match="within the 8"):
        ops.gelu_tanh_mul_slice(gate, x, 4)
    with pytest.raises(VkrtError, match="gate and x"):
        ops.gelu_tanh_mul_slice(gate, vk.upload(np.zeros((3, 8), np.float32)), 0)


def test_concat_columns_rejects_bad_input(vk) -> None:
    a, b = vk.upload(np.zeros((2, 3), np.float32)), vk.upload(np.zeros((3, 3), np.float32))
    with pytest.raises(VkrtError, match="same rows"):
        ops.concat_columns(a, b)
    with pytest.raises(VkrtError, match="two or three"):
        ops.concat_columns(a)


@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (2, 3, 66), (4, 2000)], ids=str)
def test_clamped_swiglu_matches_reference(vk, rng, shape: tuple[int, ...]) -> None:
    """gpt-oss's gate: the clamps bite (limit 0.7 against values of ~3), and the reference is the
    formula written out here; the kernel's f32 exp is held to the gated bound."""
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    f = shape[-1] // 2
    g = np.minimum(x[..., :f].astype(np.float64), 0.7)
    u = np.clip(x[..., f:].astype(np.float64), -0.7, 0.7)
    want = ops.OPS["clamped_swiglu"].reference(x, 1.702, 0.7)
    np.testing.assert_allclose(want, g * (1.0 / (1.0 + np.exp(-1.702 * g))) * (u + 1.0), rtol=1e-6, atol=1e-7)
    got = _no_drain(vk, ops.clamped_swiglu, vk.upload(x), 1.702, 0.7)
    assert got.shape == want.shape
    assert nmse(got, want) <= GATED_NMSE


def test_clamped_swiglu_refuses_a_limit_of_zero(ref) -> None:
    with pytest.raises(VkrtError, match="limit > 0"):
        ops.clamped_swiglu(ref.upload(np.zeros((1, 4), np.float32)), 1.702, 0.0)
