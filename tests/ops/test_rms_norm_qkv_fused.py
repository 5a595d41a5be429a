"""rms_norm_qkv_rope_kv_write: one dispatch (matmul_vec.comp EPILOGUE=qkv) for the norm,
the stacked qkv projection, both ropes and the KV-cache write, vs the two native ops it
replaces (rms_norm_matmul then qkv_rope_kv_write): q and both caches bit-identical, for f32
and f16 caches, NeoX and interleaved rotation, full and partial rotary dims, decode (vec)
and prefill (tiled) token counts, padding slots; against the numpy reference within the
matmul bound; and shapes the fused row grouping cannot take run the unfused pair natively.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_matmul import make_weight
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.tensor import Tensor

OP = "rms_norm_qkv_rope_kv_write"
H, KVH, K, EPS = 4, 2, 64, 1e-5
MAX_POS, BLOCKS, BLOCK = 64, 10, 4
NP_KV = {"f32": np.float32, "f16": np.float16}
# (access path, weight format, kv dtype, head_dim, rot_dim, interleaved, token counts)
CASES = [
    ("texel", "q4_1", "f32", 32, 32, False, (1, 3, 13)),
    ("texel", "q4_1", "f16", 32, 16, False, (1, 13)),
    ("texel", "q4_1", "f16", 32, 32, True, (1, 13)),
    ("texel", "q4_1", "f32", 32, 24, True, (1, 13)),
    ("texel", "f32", "f16", 16, 16, False, (1, 13)),
    ("ssbo", "q4_1", "f16", 32, 32, False, (1, 13)),
]


def cos_sin(rot: int) -> np.ndarray:
    angles = np.outer(np.arange(MAX_POS), 10000.0 ** (-np.arange(rot // 2) * 2.0 / rot))
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


@pytest.fixture(params=CASES, ids=[f"{c[0]}-{c[1]}-kv{c[2]}-d{c[3]}-rot{c[4]}{'-il' if c[5] else ''}"
                                   for c in CASES])
def case(request: pytest.FixtureRequest, vk_default: Backend) -> Iterator[tuple]:
    access, *rest = request.param
    previous = vk_default.caps.access_path
    vk_default.set_access_path(access)
    try:
        yield (vk_default, *rest)
    finally:
        vk_default.set_access_path(previous)


def inputs(vk: Backend, rng: np.random.Generator, fmt: str, head_dim: int, rot: int, t: int) -> dict:
    n = (H + 2 * KVH) * head_dim
    raw, dense = make_weight(rng, fmt, n, K)
    slots = rng.permutation(BLOCKS * BLOCK)[:t].astype(np.int32)
    if t > 1:
        slots[1] = -1  # a padding row stores nothing
    return {"x": rng.standard_normal((t, K)).astype(np.float32) * 2.0,
            "g": (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32),
            "w": vk.upload_weight(raw, fmt, (n, K)), "dense": dense,
            "positions": rng.integers(0, MAX_POS, t).astype(np.int32), "cos_sin": cos_sin(rot),
            "slots": slots}


def caches(vk: Backend, rng: np.random.Generator, kv: str, head_dim: int) -> tuple[Tensor, Tensor]:
    shape = (BLOCKS, BLOCK, KVH * head_dim)
    return tuple(vk.upload(rng.standard_normal(shape).astype(NP_KV[kv]), kv) for _ in range(2))  # type: ignore[return-value]


def test_fused_equals_composed(case: tuple, rng: np.random.Generator) -> None:
    vk, fmt, kv, head_dim, rot, interleaved, token_counts = case
    for t in token_counts:
        c = inputs(vk, rng, fmt, head_dim, rot, t)
        x, g, pos, cs, slots = (vk.upload(c[k]) for k in ("x", "g", "positions", "cos_sin", "slots"))
        k1, v1 = caches(vk, rng, kv, head_dim)
        k2, v2 = vk.upload(k1.numpy()), vk.upload(v1.numpy())
        key = (OP, f"{OP}.fused")
        before, counters = vk.selections[key], vk.counters.snapshot()
        q = ops.rms_norm_qkv_rope_kv_write(x, g, c["w"], pos, cs, k1, v1, slots, EPS, H, KVH, head_dim,
                                           interleaved).numpy()
        assert vk.selections[key] == before + 1
        delta = vk.counters.since(counters)
        assert (delta["dispatches"], delta["drains"]) == (1, 0)
        want_q = ops.qkv_rope_kv_write(ops.rms_norm_matmul(x, g, c["w"], EPS), pos, cs, k2, v2, slots, H, KVH,
                                       head_dim, interleaved).numpy()
        label = f"{fmt} kv={kv} D={head_dim} rot={rot} interleaved={interleaved} T={t}"
        assert q.tobytes() == want_q.tobytes(), f"q differs: {label}"
        assert k1.numpy().tobytes() == k2.numpy().tobytes(), f"k cache differs: {label}"
        assert v1.numpy().tobytes() == v2.numpy().tobytes(), f"v cache differs: {label}"

        # Against the numpy reference, on fresh caches.
        k0, v0 = caches(vk, rng, kv, head_dim)
        ref_k, ref_v = k0.numpy().copy(), v0.numpy().copy()
        ops.rms_norm_qkv_rope_kv_write(x, g, c["w"], pos, cs, k0, v0, slots, EPS, H, KVH, head_dim, interleaved)
        ref_q = ops.OPS[OP].reference(c["x"], c["g"], c["dense"], c["positions"], c["cos_sin"], ref_k, ref_v,
                                      c["slots"], EPS, H, KVH, head_dim, interleaved)
        assert nmse(q, ref_q) <= 1e-9, label
        written = c["slots"][c["slots"] >= 0]
        untouched = np.setdiff1d(np.arange(BLOCKS * BLOCK), written)
        for got, want in ((k0.numpy(), ref_k), (v0.numpy(), ref_v)):
            got_rows, want_rows = got.reshape(BLOCKS * BLOCK, -1), want.reshape(BLOCKS * BLOCK, -1)
            # f16 caches: one rounding step of the stored value (relative 2^-11) on top.
            bound = 1e-6 if kv == "f16" else 1e-9
            assert nmse(got_rows[written], want_rows[written]) <= bound, label
            assert got_rows[untouched].tobytes() == want_rows[untouched].tobytes(), f"{label}: wrote outside its slots"


@pytest.mark.fusion
def test_shapes_the_grouping_cannot_take_run_unfused(vk_default: Backend, rng: np.random.Generator) -> None:
    """head_dim 12 (not whole 8-dim groups): the fused kernel declines, so the fusion layer
    leaves the model's primitives as rms_norm_matmul + qkv_rope_kv_write, natively, no drain."""
    vk, head_dim = vk_default, 12
    c = inputs(vk, rng, "f32", head_dim, head_dim, 3)
    k1, v1 = caches(vk, rng, "f32", head_dim)
    ref_k, ref_v = k1.numpy().copy(), v1.numpy().copy()
    x, g, positions, cos_sin, slots = (vk.upload(c[k]) for k in ("x", "g", "positions", "cos_sin", "slots"))
    before = dict(vk.selections)
    counters = vk.counters.snapshot()
    q = ops.qkv_rope_kv_write(ops.matmul(ops.rms_norm(x, g, EPS), c["w"]), positions, cos_sin, k1, v1,
                              slots, H, KVH, head_dim).numpy()
    ran = {key for key, n in vk.selections.items() if n > before.get(key, 0)}
    assert {op for op, _ in ran} == {"rms_norm_matmul", "qkv_rope_kv_write"}, ran
    assert vk.counters.since(counters)["drains"] == 0
    ref_q = ops.OPS[OP].reference(c["x"], c["g"], c["dense"], c["positions"], c["cos_sin"], ref_k, ref_v,
                                  c["slots"], EPS, H, KVH, head_dim)
    assert nmse(q, ref_q) <= 1e-9
    assert nmse(k1.numpy(), ref_k) <= 1e-9 and nmse(v1.numpy(), ref_v) <= 1e-9


def test_reference_is_the_composition(ref: Backend, rng: np.random.Generator) -> None:
    c = inputs(ref, rng, "f32", 16, 16, 3)
    k1, v1 = caches(ref, rng, "f32", 16)
    k2, v2 = ref.upload(k1.numpy()), ref.upload(v1.numpy())
    args = [ref.upload(c[k]) for k in ("positions", "cos_sin")]
    q1 = ops.rms_norm_qkv_rope_kv_write(ref.upload(c["x"]), ref.upload(c["g"]), c["w"], *args, k1, v1,
                                        ref.upload(c["slots"]), EPS, H, KVH, 16)
    qkv = ops.rms_norm_matmul(ref.upload(c["x"]), ref.upload(c["g"]), c["w"], EPS)
    q2 = ops.qkv_rope_kv_write(qkv, *args, k2, v2, ref.upload(c["slots"]), H, KVH, 16)
    assert q1.numpy().tobytes() == q2.numpy().tobytes()
    assert k1.numpy().tobytes() == k2.numpy().tobytes() and v1.numpy().tobytes() == v2.numpy().tobytes()
