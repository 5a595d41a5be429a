"""The fusion layer (vkrt/ops/fusion.py): primitive compositions run as the fused kernel,
with the fused op's exact result; pending results run when touched, never when unused,
and before a captured step ends."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.tensor import Tensor
from vkrt.ops import fusion
from vkrt.ops.attention import rope_cos_sin

pytestmark = pytest.mark.fusion

T, K, N, EPS = 3, 64, 48, 1e-5
H, KVH, D = 2, 1, 16


def ran_ops(backend: Backend, fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, set[str], dict[str, int]]:
    """fn's result, the ops that ran natively (by selection count), the counter deltas."""
    before, counters = dict(backend.selections), backend.counters.snapshot()
    out = fn()
    ran = {op for (op, _), n in backend.selections.items() if n > before.get((op, _), 0)}
    return out, ran, backend.counters.since(counters)


@pytest.fixture
def tensors(vk_default: Backend, rng: np.random.Generator) -> dict[str, Tensor]:
    vk = vk_default
    f32 = np.float32
    return {
        "x": vk.upload(rng.standard_normal((T, K)).astype(f32)),
        "g": vk.upload((1 + 0.3 * rng.standard_normal(K)).astype(f32)),
        "w": vk.upload_weight(rng.standard_normal((N, K)).astype(f32), "f32", (N, K)),
        "w2": vk.upload_weight(rng.standard_normal((2 * N, K)).astype(f32), "f32", (2 * N, K)),
        "r": vk.upload(rng.standard_normal((T, N)).astype(f32)),
    }


def unfused(fn: Callable[[], np.ndarray]) -> np.ndarray:
    with fusion.disabled():
        return fn()


def test_matmul_of_rms_norm_runs_the_folded_kernel(vk_default: Backend, tensors: dict[str, Tensor]) -> None:
    x, g, w = tensors["x"], tensors["g"], tensors["w"]
    got, ran, delta = ran_ops(vk_default, lambda: ops.matmul(ops.rms_norm(x, g, EPS), w).numpy())
    assert ran == {"rms_norm_matmul"} and delta["dispatches"] == 1
    assert got.tobytes() == unfused(lambda: ops.rms_norm_matmul(x, g, w, EPS).numpy()).tobytes()


@pytest.mark.parametrize("branch_first", [True, False])
def test_residual_add_joins_the_projection(vk_default: Backend, tensors: dict[str, Tensor],
                                           branch_first: bool) -> None:
    x, w, r = tensors["x"], tensors["w"], tensors["r"]

    def fn() -> np.ndarray:
        y = ops.matmul(x, w)
        return (ops.add(y, r) if branch_first else ops.add(r, y)).numpy()

    got, ran, delta = ran_ops(vk_default, fn)
    assert ran == {"matmul_add"} and delta["dispatches"] == 1
    # Bit-identical to the unfused pair (f32 addition commutes exactly).
    assert got.tobytes() == unfused(lambda: ops.add(ops.matmul(x, w), r).numpy()).tobytes()


def test_bias_joins_the_projection(vk_default: Backend, rng: np.random.Generator,
                                   tensors: dict[str, Tensor]) -> None:
    """Qwen2's q/k/v bias: add(matmul(x, w), b) with b [N] is one matmul_add, and with the
    pre-norm folded too, add(matmul(rms_norm(x, g), w), b) is one rms_norm_matmul_add; both
    bit-identical to the unfused ops (rms_norm_matmul, then the broadcasting add)."""
    x, g, w = tensors["x"], tensors["g"], tensors["w"]
    bias = vk_default.upload(rng.standard_normal(N).astype(np.float32))
    got, ran, delta = ran_ops(vk_default, lambda: ops.add(ops.matmul(x, w), bias).numpy())
    assert ran == {"matmul_add"} and delta["dispatches"] == 1
    assert got.tobytes() == unfused(lambda: ops.add(ops.matmul(x, w), bias).numpy()).tobytes()
    for added in (bias, tensors["r"]):  # a bias, or a residual of the projection's shape
        got, ran, delta = ran_ops(vk_default, lambda a=added: ops.add(ops.matmul(ops.rms_norm(x, g, EPS), w), a).numpy())
        assert ran == {"rms_norm_matmul_add"} and delta["dispatches"] == 1
        want = unfused(lambda a=added: ops.add(ops.rms_norm_matmul(x, g, w, EPS), a).numpy())
        assert got.tobytes() == want.tobytes()
    # A gated projection's output has no bias epilogue: the add runs on its own.
    _, ran, delta = ran_ops(vk_default, lambda: ops.add(ops.silu_and_mul(ops.matmul(ops.rms_norm(x, g, EPS),
                                                                                    tensors["w2"])), bias).numpy())
    assert ran == {"rms_norm_matmul", "add"} and delta["dispatches"] == 2


@pytest.mark.parametrize("branch_first", [True, False])
def test_post_norm_joins_the_residual_add(vk_default: Backend, rng: np.random.Generator, branch_first: bool) -> None:
    """Gemma's sandwich norms: add(rms_norm(out), h) is one rms_norm_add dispatch."""
    out = vk_default.upload(rng.standard_normal((T, K)).astype(np.float32))
    g = vk_default.upload((1 + 0.3 * rng.standard_normal(K)).astype(np.float32))
    h = vk_default.upload(rng.standard_normal((T, K)).astype(np.float32))

    def fn() -> np.ndarray:
        y = ops.rms_norm(out, g, EPS)
        return (ops.add(y, h) if branch_first else ops.add(h, y)).numpy()

    got, ran, delta = ran_ops(vk_default, fn)
    assert ran == {"rms_norm_add"} and delta["dispatches"] == 1
    assert got.tobytes() == unfused(lambda: ops.add(ops.rms_norm(out, g, EPS), h).numpy()).tobytes()


def test_geglu_folds_like_swiglu(vk_default: Backend, tensors: dict[str, Tensor]) -> None:
    """Gemma's GeGLU: gelu_tanh_and_mul(matmul(rms_norm(x))) is one gated dispatch too."""
    x, g, w2 = tensors["x"], tensors["g"], tensors["w2"]
    got, ran, delta = ran_ops(vk_default, lambda: ops.gelu_tanh_and_mul(ops.matmul(ops.rms_norm(x, g, EPS), w2)).numpy())
    assert ran == {"rms_norm_matmul"} and delta["dispatches"] == 1
    want = unfused(lambda: ops.rms_norm_matmul(x, g, w2, EPS, gated=True, activation="gelu_tanh").numpy())
    assert got.tobytes() == want.tobytes()
    got, ran, _ = ran_ops(vk_default, lambda: ops.gelu_tanh_and_mul(ops.matmul(x, w2)).numpy())
    assert ran == {"matmul_gelu_tanh_and_mul"}
    assert got.tobytes() == unfused(lambda: ops.gelu_tanh_and_mul(ops.matmul(x, w2)).numpy()).tobytes()


@pytest.mark.parametrize("branch_first", [True, False])
def test_scaled_residual_joins_the_projection(vk_default: Backend, tensors: dict[str, Tensor],
                                              branch_first: bool) -> None:
    """Granite's residual multiplier: add(scale(matmul(x, w), s), r) is one matmul_add."""
    x, w, r = tensors["x"], tensors["w"], tensors["r"]

    def fn() -> np.ndarray:
        y = ops.scale(ops.matmul(x, w), 0.22)
        return (ops.add(y, r) if branch_first else ops.add(r, y)).numpy()

    got, ran, delta = ran_ops(vk_default, fn)
    assert ran == {"matmul_add"} and delta["dispatches"] == 1
    assert got.tobytes() == unfused(lambda: ops.add(ops.scale(ops.matmul(x, w), 0.22), r).numpy()).tobytes()
    alone, ran, _ = ran_ops(vk_default, lambda: ops.scale(ops.matmul(x, w), 0.22).numpy())
    assert ran == {"matmul"}
    assert alone.tobytes() == unfused(lambda: ops.scale(ops.matmul(x, w), 0.22).numpy()).tobytes()


def test_gated_mlp_input_folds_norm_matmul_and_gate(vk_default: Backend, tensors: dict[str, Tensor]) -> None:
    x, g, w2 = tensors["x"], tensors["g"], tensors["w2"]
    got, ran, delta = ran_ops(vk_default, lambda: ops.silu_and_mul(ops.matmul(ops.rms_norm(x, g, EPS), w2)).numpy())
    assert ran == {"rms_norm_matmul"} and delta["dispatches"] == 1
    assert got.tobytes() == unfused(lambda: ops.rms_norm_matmul(x, g, w2, EPS, gated=True).numpy()).tobytes()
    got, ran, _ = ran_ops(vk_default, lambda: ops.silu_and_mul(ops.matmul(x, w2)).numpy())
    assert ran == {"matmul_silu_and_mul"}
    assert got.tobytes() == unfused(lambda: ops.silu_and_mul(ops.matmul(x, w2)).numpy()).tobytes()


def test_attention_input_folds_into_one_dispatch(vk_default: Backend, rng: np.random.Generator) -> None:
    vk = vk_default
    rows = (H + 2 * KVH) * D
    x = vk.upload(rng.standard_normal((T, K)).astype(np.float32))
    g = vk.upload(np.ones(K, np.float32))
    w = vk.upload_weight(rng.standard_normal((rows, K)).astype(np.float32), "f32", (rows, K))
    positions, slots = vk.upload(np.arange(T, dtype=np.int32)), vk.upload(np.arange(T, dtype=np.int32))
    cos_sin = vk.upload(rope_cos_sin(16, D, 10000.0))

    def run() -> tuple[np.ndarray, np.ndarray]:
        kc, vc = (vk.upload(np.zeros((2, 8, KVH * D), np.float32)) for _ in range(2))
        q = ops.qkv_rope_kv_write(ops.matmul(ops.rms_norm(x, g, EPS), w), positions, cos_sin, kc, vc, slots,
                                  H, KVH, D)
        return q.numpy(), kc.numpy()

    (q, k), ran, delta = ran_ops(vk, run)
    assert ran == {"rms_norm_qkv_rope_kv_write"} and (delta["dispatches"], delta["drains"]) == (1, 0)
    q_want, k_want = unfused(run)
    assert np.allclose(q, q_want, atol=1e-5) and np.allclose(k, k_want, atol=1e-5)  # norm folding rounds


def test_pending_result_used_twice_is_right_both_times(vk_default: Backend, tensors: dict[str, Tensor]) -> None:
    x, g, w = tensors["x"], tensors["g"], tensors["w"]
    normed = ops.rms_norm(x, g, EPS)
    y = ops.matmul(normed, w).numpy()  # folded: the norm itself did not run
    assert normed.pending is not None
    want = unfused(lambda: ops.rms_norm(x, g, EPS).numpy())
    assert normed.numpy().tobytes() == want.tobytes()  # reading it runs it
    assert normed.pending is None
    assert y.tobytes() == unfused(lambda: ops.rms_norm_matmul(x, g, w, EPS).numpy()).tobytes()


def test_unused_pending_op_never_runs(vk_default: Backend, tensors: dict[str, Tensor]) -> None:
    before = vk_default.counters.dispatches
    t = ops.matmul(tensors["x"], tensors["w"])
    del t
    fusion.flush()
    vk_default.sync()
    assert vk_default.counters.dispatches == before


def test_capture_records_what_is_still_pending(vk_default: Backend, rng: np.random.Generator,
                                              tensors: dict[str, Tensor]) -> None:
    x, g, w = tensors["x"], tensors["g"], tensors["w"]
    with vk_default.capture() as graph:
        y = ops.matmul(ops.rms_norm(x, g, EPS), w)  # returned pending: the capture must record it
    assert y.pending is None and graph.dispatches == 1
    for _ in range(2):
        new_x = rng.standard_normal((T, K)).astype(np.float32)
        vk_default.write(x, new_x)
        graph.replay()
        with fusion.disabled():
            want = ops.rms_norm_matmul(vk_default.upload(new_x), g, w, EPS).numpy()
        assert y.numpy().tobytes() == want.tobytes()
    graph.release()


def test_disabled_runs_each_op_as_called(vk_default: Backend, tensors: dict[str, Tensor]) -> None:
    x, g, w = tensors["x"], tensors["g"], tensors["w"]
    _, ran, delta = ran_ops(vk_default, lambda: unfused(lambda: ops.matmul(ops.rms_norm(x, g, EPS), w).numpy()))
    assert ran == {"rms_norm", "matmul"} and delta["dispatches"] == 2


def test_reference_backend_fuses_to_the_same_bits(ref: Backend, rng: np.random.Generator) -> None:
    x = ref.upload(rng.standard_normal((T, K)).astype(np.float32))
    g = ref.upload(np.ones(K, np.float32))
    w = ref.upload_weight(rng.standard_normal((N, K)).astype(np.float32), "f32", (N, K))
    fused = ops.matmul(ops.rms_norm(x, g, EPS), w).numpy()
    assert fused.tobytes() == unfused(lambda: ops.matmul(ops.rms_norm(x, g, EPS), w).numpy()).tobytes()
