"""rms_norm_matmul, matmul_add and rms_norm_matmul_add (matmul_vec.comp's FUSE rms, add and
rms | add) vs the unfused native kernels they replace, both kernels (vec at T = 1
and 3, tiled at T = 13).

The fused prologue / epilogue is the same code for every weight format (test_matmul.py
covers each format's decode on both paths), so the cases here are the ones that take
different load paths through it: on the texel path f32 (K = 37: scalar activation and
norm-weight loads; K = 64: vec4 texels), q4_1 and q6_k (their activation sums see the
normalised x), and q4_1 on the storage-buffer path. (Every extra case is several more
pipelines to JIT-compile on a cold llvmpipe, seconds each.)

- matmul_add: bit-identical to matmul then add (the epilogue adds the same two f32 values),
  for a residual [T, N] and for a bias [N] broadcast over the tokens (Qwen2's q/k/v bias).
- rms_norm_matmul_add: bit-identical to rms_norm_matmul then add, residual or bias (the
  add is `precise`, so no compile contracts it with the 1 / rms product into an fma).
- rms_norm_matmul: scales the finished dot products by 1 / rms instead of scaling every
  activation first, so it equals rms_norm then matmul up to f32 rounding. Stated bound:
  every output within 1e-5 of the unfused one, relative to the largest |output| (measured
  ~3e-7), and NMSE <= 1e-9 against the numpy reference, as for matmul.
- Both stay batch invariant: row t of a T-token call equals the 1-token call, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_matmul import make_weight
from tests.ops.test_matmul_gated import k_for, kernel
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.tensor import Tensor, TensorSpec

CASES = [("texel", "f32"), ("texel", "q4_1"), ("texel", "q6_k"), ("ssbo", "q4_1")]
TOKENS = {"vec": (1, 3), "tiled": (13,)}
NMSE_BOUND = 1e-9
REL_BOUND = 1e-5
EPS = 1e-5


def fused(backend: Backend, op: str, path: str, inputs: tuple[Tensor, ...], n: int,
          **params: object) -> np.ndarray:
    out = (TensorSpec((inputs[0].shape[0], n), "f32"),)
    return kernel(backend, op, f"{op}.{path}").run(backend, inputs, params, out)[0].numpy()


def unfused_matmul(backend: Backend, path: str, x: Tensor, w: Tensor, n: int, gated: bool) -> Tensor:
    op = "matmul_silu_and_mul" if gated else "matmul"
    return kernel(backend, op, f"{op}.{path}").run(backend, (x, w), {}, (TensorSpec((x.shape[0], n), "f32"),))[0]


@pytest.fixture(params=CASES, ids=[f"{a}-{f}" for a, f in CASES])
def case(request: pytest.FixtureRequest, vk_default: Backend) -> Iterator[tuple[Backend, str]]:
    """(backend on the case's access path, weight format)."""
    access, fmt = request.param
    previous = vk_default.caps.access_path
    vk_default.set_access_path(access)
    try:
        yield vk_default, fmt
    finally:
        vk_default.set_access_path(previous)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("path", ["vec", "tiled"])
def test_rms_norm_matmul_matches_unfused(case: tuple[Backend, str], rng: np.random.Generator, path: str,
                                         gated: bool) -> None:
    vk, fmt = case
    n = 37  # odd: a partial last row group
    rows = 2 * n if gated else n
    for k in k_for(fmt):
        raw, dense = make_weight(rng, fmt, rows, k)
        w = vk.upload_weight(raw, fmt, (rows, k))
        g = (1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32)
        gt = vk.upload(g)
        for t in TOKENS[path]:
            x = rng.standard_normal((t, k)).astype(np.float32) * 3.0
            xt = vk.upload(x)
            got = fused(vk, "rms_norm_matmul", path, (xt, gt, w), n, eps=EPS, gated=gated)
            want = unfused_matmul(vk, path, ops.rms_norm(xt, gt, EPS), w, n, gated).numpy()
            assert got.shape == (t, n)
            scale = float(np.abs(want).max())
            worst = float(np.abs(got - want).max()) / scale
            assert worst <= REL_BOUND, f"{fmt} {path} K={k} T={t}: {worst:.3g} of max |y| from unfused"
            with np.errstate(over="ignore"):
                expected = ops.OPS["rms_norm_matmul"].reference(x, g, dense, EPS, gated=gated)
            err = nmse(got, expected)
            assert err <= NMSE_BOUND, f"{fmt} {path} K={k} T={t}: NMSE {err:.3g}"


@pytest.mark.parametrize("added", ["residual", "bias"])
@pytest.mark.parametrize("normed", [False, True], ids=["matmul_add", "rms_norm_matmul_add"])
@pytest.mark.parametrize("path", ["vec", "tiled"])
def test_matmul_add_equals_unfused(case: tuple[Backend, str], rng: np.random.Generator, path: str,
                                   normed: bool, added: str) -> None:
    vk, fmt = case
    n = 37
    for k in k_for(fmt):
        raw, _ = make_weight(rng, fmt, n, k)
        w = vk.upload_weight(raw, fmt, (n, k))
        gt = vk.upload((1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32))
        for t in TOKENS[path]:
            xt = vk.upload(rng.standard_normal((t, k)).astype(np.float32) * 3.0)
            rt = vk.upload(rng.standard_normal((t, n) if added == "residual" else n).astype(np.float32) * 10.0)
            if normed:
                got = fused(vk, "rms_norm_matmul_add", path, (xt, gt, w, rt), n, eps=EPS)
                y = kernel(vk, "rms_norm_matmul", f"rms_norm_matmul.{path}").run(
                    vk, (xt, gt, w), {"eps": EPS}, (TensorSpec((t, n), "f32"),))[0]
            else:
                got = fused(vk, "matmul_add", path, (xt, w, rt), n)
                y = unfused_matmul(vk, path, xt, w, n, False)
            want = ops.add(y, rt).numpy()
            same = got.view(np.uint32) == want.view(np.uint32)
            assert same.all(), f"{fmt} {path} K={k} T={t}: {(~same).sum()} values differ from unfused"


def test_batch_invariance(vk_default: Backend, rng: np.random.Generator) -> None:
    """The op picks vec for few tokens and tiled for many, never drains, and row t of a
    T-token result is bit-identical to the 1-token result for that row."""
    vk, fmt, n, k = vk_default, "q4_1", 67, 96
    raw, _ = make_weight(rng, fmt, 2 * n, k)
    w = vk.upload_weight(raw, fmt, (2 * n, k))
    g = vk.upload((1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32))
    x = rng.standard_normal((13, k)).astype(np.float32)
    r = rng.standard_normal((13, 2 * n)).astype(np.float32)
    bias = vk.upload(rng.standard_normal(2 * n).astype(np.float32))
    calls = {  # op -> its call on rows [i, j) of x
        "rms_norm_matmul": lambda i, j: ops.rms_norm_matmul(vk.upload(x[i:j]), g, w, EPS, gated=True),
        "matmul_add": lambda i, j: ops.matmul_add(vk.upload(x[i:j]), w, vk.upload(r[i:j])),
        "rms_norm_matmul_add": lambda i, j: ops.rms_norm_matmul_add(vk.upload(x[i:j]), g, w, bias, EPS),
    }
    for op, call in calls.items():
        solo = np.concatenate([call(i, i + 1).numpy() for i in range(13)])
        for t, name in ((1, "vec"), (8, "vec"), (13, "tiled")):
            key = (op, f"{op}.{name}")
            before, counters = vk.selections[key], vk.counters.snapshot()
            got = call(0, t).numpy()
            assert vk.selections[key] == before + 1
            assert vk.counters.since(counters)["drains"] == 0
            assert (got.view(np.uint32) == solo[:t].view(np.uint32)).all(), f"{op} {fmt} T={t}"


def test_references_are_the_compositions(ref: Backend, rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 64)).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32)
    w = rng.standard_normal((10, 64)).astype(np.float32)
    r = rng.standard_normal((3, 10)).astype(np.float32)
    xt, gt, wt = ref.upload(x), ref.upload(g), ref.upload(w)
    bias = ref.upload(rng.standard_normal(10).astype(np.float32))
    normed = ops.rms_norm(xt, gt, EPS)
    assert ops.rms_norm_matmul(xt, gt, wt, EPS).numpy().tobytes() == ops.matmul(normed, wt).numpy().tobytes()
    assert (ops.rms_norm_matmul(xt, gt, wt, EPS, gated=True).numpy().tobytes()
            == ops.matmul_silu_and_mul(normed, wt).numpy().tobytes())
    for added in (ref.upload(r), bias):
        assert ops.matmul_add(xt, wt, added).numpy().tobytes() == ops.add(ops.matmul(xt, wt), added).numpy().tobytes()
        assert (ops.rms_norm_matmul_add(xt, gt, wt, added, EPS).numpy().tobytes()
                == ops.add(ops.rms_norm_matmul(xt, gt, wt, EPS), added).numpy().tobytes())


def test_bad_operands_rejected(ref: Backend) -> None:
    x = ref.upload(np.zeros((2, 32), np.float32))
    w = ref.upload(np.zeros((4, 32), np.float32))
    with pytest.raises(ops.OpError, match="norm weight"):
        ops.rms_norm_matmul(x, ref.upload(np.zeros(31, np.float32)), w, EPS)
    with pytest.raises(ops.OpError, match="residual"):
        ops.matmul_add(x, w, ref.upload(np.zeros((2, 5), np.float32)))
    with pytest.raises(ops.OpError, match="bias f32 \\[4\\]"):
        ops.matmul_add(x, w, ref.upload(np.zeros(5, np.float32)))
    with pytest.raises(ops.OpError, match="rms_norm_matmul_add: residual"):
        ops.rms_norm_matmul_add(x, ref.upload(np.ones(32, np.float32)), w, ref.upload(np.zeros(2, np.float32)), EPS)
