"""matmul_silu_and_mul (one dispatch: matmul_vec.comp with GATES = 2) vs the unfused native
matmul + silu_and_mul it replaces: bit-identical on both access paths, both kernels (vec,
tiled), every weight format, T in {1, 3, 8, 13}; and NMSE vs the numpy reference (the
composition of the two references). Bound: 1e-9 as for matmul (the gate multiplies
relative errors by at most ~2; measured worst here is far below).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import REPRESENTATIVE_FORMATS, nmse, ssbo_sample
from tests.ops.test_matmul import FORMATS, K_QUANTS, is_block, make_weight
from vkrt import ops
from vkrt.backend.base import Backend, Kernel
from vkrt.core.tensor import Tensor, TensorSpec

NMSE_BOUND = 1e-9
TOKENS = (1, 3, 8, 13)


def k_for(fmt: str) -> tuple[int, ...]:
    """Ks per format: whole super-blocks for K-quants, whole blocks for the block formats,
    and a partial block / scalar-load K as well as a texel-aligned one for float weights."""
    return (512,) if fmt in K_QUANTS else (96,) if is_block(fmt) else (37, 64)


def kernel(backend: Backend, op: str, name: str) -> Kernel:
    return next(k for k in backend.kernels(op) if k.name == name)


def run(backend: Backend, op: str, name: str, x: Tensor, w: Tensor, n: int) -> Tensor:
    out = (TensorSpec((x.shape[0], n), "f32"),)
    return kernel(backend, op, name).run(backend, (x, w), {}, out)[0]


@ssbo_sample(lambda fmt, path: fmt in REPRESENTATIVE_FORMATS)
@pytest.mark.parametrize("path", ["vec", "tiled"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_equals_unfused(vk: Backend, rng: np.random.Generator, fmt: str, path: str) -> None:
    f = 37  # odd: a partial last row group
    for k in k_for(fmt):
        raw, dense = make_weight(rng, fmt, 2 * f, k)
        w = vk.upload_weight(raw, fmt, (2 * f, k))
        for t in TOKENS:
            x = rng.standard_normal((t, k)).astype(np.float32) * 4.0  # gates well into both tails
            xt = vk.upload(x)
            got = run(vk, "matmul_silu_and_mul", f"matmul_silu_and_mul.{path}", xt, w, f).numpy()
            h = run(vk, "matmul", f"matmul.{path}", xt, w, 2 * f)
            want = ops.silu_and_mul(h).numpy()  # the native elementwise.silu_mul kernel
            assert got.shape == (t, f)
            same = got.view(np.uint32) == want.view(np.uint32)
            assert same.all(), f"{fmt} {path} K={k} T={t}: {(~same).sum()} values differ from unfused"
            with np.errstate(over="ignore"):
                expected = ops.OPS["matmul_silu_and_mul"].reference(x, dense)
            err = nmse(got, expected)
            assert err <= NMSE_BOUND, f"{fmt} {path} K={k} T={t}: NMSE {err:.3g}"


@pytest.mark.parametrize("path", ["vec", "tiled"])
@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q4_k"])
def test_gelu_fused_equals_unfused(vk: Backend, rng: np.random.Generator, fmt: str, path: str) -> None:
    """matmul_gelu_tanh_and_mul (GeGLU: spec constant 10 of the same modules) vs matmul then
    the native gelu_tanh_and_mul, bit for bit; the activation is independent of the format."""
    f = 37
    for k in k_for(fmt):
        raw, dense = make_weight(rng, fmt, 2 * f, k)
        w = vk.upload_weight(raw, fmt, (2 * f, k))
        for t in TOKENS:
            x = rng.standard_normal((t, k)).astype(np.float32) * 4.0
            xt = vk.upload(x)
            got = run(vk, "matmul_gelu_tanh_and_mul", f"matmul_gelu_tanh_and_mul.{path}", xt, w, f).numpy()
            want = ops.gelu_tanh_and_mul(run(vk, "matmul", f"matmul.{path}", xt, w, 2 * f)).numpy()
            same = got.view(np.uint32) == want.view(np.uint32)
            assert same.all(), f"{fmt} {path} K={k} T={t}: {(~same).sum()} values differ from unfused"
            with np.errstate(over="ignore"):
                expected = ops.OPS["matmul_gelu_tanh_and_mul"].reference(x, dense)
            assert nmse(got, expected) <= NMSE_BOUND, f"{fmt} {path} K={k} T={t}"


@pytest.mark.parametrize("fmt", ["f32", "q4_1"])
def test_selection_and_batch_invariance(vk: Backend, rng: np.random.Generator, fmt: str) -> None:
    """The op picks vec for few tokens and tiled for many, never drains, and row t of a
    T-token result is bit-identical to the 1-token result for that row."""
    f, k = 67, 96
    raw, _ = make_weight(rng, fmt, 2 * f, k)
    w = vk.upload_weight(raw, fmt, (2 * f, k))
    x = rng.standard_normal((13, k)).astype(np.float32)
    solo = np.concatenate([ops.matmul_silu_and_mul(vk.upload(x[i : i + 1]), w).numpy() for i in range(13)])
    for t, name in ((1, "vec"), (8, "vec"), (13, "tiled")):
        key = ("matmul_silu_and_mul", f"matmul_silu_and_mul.{name}")
        before, counters = vk.selections[key], vk.counters.snapshot()
        got = ops.matmul_silu_and_mul(vk.upload(x[:t]), w).numpy()
        assert vk.selections[key] == before + 1
        assert vk.counters.since(counters)["drains"] == 0
        assert (got.view(np.uint32) == solo[:t].view(np.uint32)).all(), f"{fmt} T={t}"


def test_reference_is_the_composition(ref: Backend, rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal((10, 64)).astype(np.float32)
    got = ops.matmul_silu_and_mul(ref.upload(x), ref.upload(w)).numpy()
    want = ops.silu_and_mul(ops.matmul(ref.upload(x), ref.upload(w))).numpy()
    assert got.tobytes() == want.tobytes()


def test_odd_rows_rejected(ref: Backend) -> None:
    with pytest.raises(ops.OpError, match="even rows"):
        ops.matmul_silu_and_mul(ref.upload(np.zeros((1, 32), np.float32)),
                                ref.upload(np.zeros((3, 32), np.float32)))
