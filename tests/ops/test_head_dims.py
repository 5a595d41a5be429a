"""The attention prologue at the head sizes of the new families: head_dim 64, 128 and 256
(Gemma 3) with GQA ratios 1, 4 and 8 (Gemma-3-270M: 4 heads, 1 KV head), decode and
prefill token counts, padding slots, f32 and f16 caches, on both access paths.

rope and kv_write are bit-exact (as in test_rope.py / test_attention.py); qkv_rope_kv_write
and the fused rms_norm_qkv_rope_kv_write meet the bounds of their own test files against
the numpy references. paged_attention at these sizes is in test_attention.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_matmul import make_weight
from vkrt import ops
from vkrt.backend.base import Backend

NP_KV = {"f32": np.float32, "f16": np.float16}
GEOMETRIES = [(4, 4, 64), (8, 2, 128), (8, 1, 256), (4, 1, 256)]  # (num_heads, num_kv_heads, head_dim)
TOKENS = [1, 13]
BLOCKS, BLOCK, MAX_POS, K, EPS = 6, 4, 300, 64, 1e-6


def _ids(g: tuple[int, int, int]) -> str:
    return "h{}kv{}d{}".format(*g)


def _slots(rng: np.random.Generator, tokens: int) -> np.ndarray:
    slots = rng.permutation(BLOCKS * BLOCK)[:tokens].astype(np.int32)
    slots[1::4] = -1  # padding rows store nothing
    return slots


def _caches(rng: np.random.Generator, kv_dim: int, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    shape = (BLOCKS, BLOCK, kv_dim)
    return (rng.standard_normal(shape).astype(NP_KV[kv_dtype]), rng.standard_normal(shape).astype(NP_KV[kv_dtype]))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_ids)
def test_rope(vk: Backend, rng: np.random.Generator, geometry: tuple[int, int, int], tokens: int) -> None:
    num_heads, _, head_dim = geometry
    x = rng.standard_normal((tokens, num_heads * head_dim)).astype(np.float32)
    positions = rng.integers(0, MAX_POS, tokens).astype(np.int32)
    table = ops.rope_cos_sin(MAX_POS, head_dim, 1e6)
    got = ops.rope(vk.upload(x), vk.upload(positions), vk.upload(table), head_dim).numpy()
    np.testing.assert_array_equal(got, ops.OPS["rope"].reference(x, positions, table, head_dim))


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_ids)
def test_kv_write(vk: Backend, rng: np.random.Generator, geometry: tuple[int, int, int], kv_dtype: str) -> None:
    _, num_kv_heads, head_dim = geometry
    kv_dim = num_kv_heads * head_dim
    k_cache, v_cache = _caches(rng, kv_dim, kv_dtype)
    slots = _slots(rng, 13)
    k, v = (rng.standard_normal((13, kv_dim)).astype(np.float32) for _ in range(2))
    tk, tv = vk.upload(k_cache, kv_dtype), vk.upload(v_cache, kv_dtype)
    ops.kv_write(tk, tv, vk.upload(k), vk.upload(v), vk.upload(slots))
    ops.OPS["kv_write"].reference(k_cache, v_cache, k, v, slots)
    assert tk.numpy().tobytes() == k_cache.tobytes() and tv.numpy().tobytes() == v_cache.tobytes()


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_ids)
def test_qkv_rope_kv_write(vk: Backend, rng: np.random.Generator, geometry: tuple[int, int, int], tokens: int,
                           kv_dtype: str) -> None:
    num_heads, num_kv_heads, head_dim = geometry
    kv_dim = num_kv_heads * head_dim
    qkv = rng.standard_normal((tokens, (num_heads + 2 * num_kv_heads) * head_dim)).astype(np.float32)
    positions = rng.integers(0, MAX_POS, tokens).astype(np.int32)
    table = ops.rope_cos_sin(MAX_POS, head_dim, 1e6)
    k_cache, v_cache = _caches(rng, kv_dim, kv_dtype)
    slots = _slots(rng, tokens)
    tk, tv = vk.upload(k_cache, kv_dtype), vk.upload(v_cache, kv_dtype)
    drains = vk.counters.drains
    q = ops.qkv_rope_kv_write(vk.upload(qkv), vk.upload(positions), vk.upload(table), tk, tv, vk.upload(slots),
                              num_heads, num_kv_heads, head_dim).numpy()
    assert vk.counters.drains == drains
    want_q = ops.OPS["qkv_rope_kv_write"].reference(qkv, positions, table, k_cache, v_cache, slots, num_heads,
                                                    num_kv_heads, head_dim)
    np.testing.assert_array_equal(q, want_q)  # rope is bit-exact, the cache write a copy
    assert tk.numpy().tobytes() == k_cache.tobytes() and tv.numpy().tobytes() == v_cache.tobytes()


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_ids)
def test_rms_norm_qkv_rope_kv_write_fused(vk: Backend, rng: np.random.Generator, geometry: tuple[int, int, int],
                                          tokens: int, kv_dtype: str) -> None:
    num_heads, num_kv_heads, head_dim = geometry
    kv_dim = num_kv_heads * head_dim
    raw, dense = make_weight(rng, "q8_0", (num_heads + 2 * num_kv_heads) * head_dim, K)
    x = rng.standard_normal((tokens, K)).astype(np.float32)
    g = (1.0 + 0.5 * rng.standard_normal(K)).astype(np.float32)
    positions = rng.integers(0, MAX_POS, tokens).astype(np.int32)
    table = ops.rope_cos_sin(MAX_POS, head_dim, 1e6)
    k_cache, v_cache = _caches(rng, kv_dim, kv_dtype)
    slots = _slots(rng, tokens)
    tk, tv = vk.upload(k_cache, kv_dtype), vk.upload(v_cache, kv_dtype)
    op = "rms_norm_qkv_rope_kv_write"
    before, drains = vk.selections[(op, f"{op}.fused")], vk.counters.drains
    q = ops.rms_norm_qkv_rope_kv_write(vk.upload(x), vk.upload(g), vk.upload_weight(raw, "q8_0", dense.shape),
                                       vk.upload(positions), vk.upload(table), tk, tv, vk.upload(slots), EPS,
                                       num_heads, num_kv_heads, head_dim).numpy()
    assert vk.selections[(op, f"{op}.fused")] == before + 1 and vk.counters.drains == drains
    want_q = ops.OPS[op].reference(x, g, dense, positions, table, k_cache, v_cache, slots, EPS, num_heads,
                                   num_kv_heads, head_dim)
    assert nmse(q, want_q) <= 1e-9
    bound = 1e-6 if kv_dtype == "f16" else 1e-9  # f16: one rounding of the stored value on top
    for got, want in ((tk.numpy(), k_cache), (tv.numpy(), v_cache)):
        assert nmse(got.astype(np.float32), want.astype(np.float32)) <= bound
