"""qkv_norm_rope_kv_write (QK-norm: per-head RMSNorm of q and k, then rope and the KV write).

Three checks: the numpy spec against RMSNorm written out in the test; the native kernel
against the spec (NMSE <= 1e-10: the spec normalises in float64, the kernel in f32; f16
caches compared after decoding, within f16 rounding); and the native kernel bit-identical to
its native composition, rms_norm over [T * heads, head_dim] views followed by
qkv_rope_kv_write. Head dims 64, 128 and 256 with GQA ratios 1, 4 and 8, decode and prefill
token counts, padding slots, partial rotary and interleaved pairs.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.conftest import nmse
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.errors import VkrtError

reference = importlib.import_module("vkrt.ops.attention")
NP_KV = {"f32": np.float32, "f16": np.float16}
EPS = 1e-6
QKV_NORM_NMSE = 1e-10
# (tokens, num_heads, num_kv_heads, head_dim, rot_dim)
CASES = [(1, 4, 4, 64, 64), (7, 8, 2, 128, 128), (5, 8, 1, 256, 256), (3, 4, 1, 256, 128),
         (16, 16, 8, 128, 64)]


def _case(rng: np.random.Generator, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
          rot_dim: int, kv_dtype: str) -> dict[str, np.ndarray]:
    blocks, block_size = 6, 4
    kv_dim = num_kv_heads * head_dim
    slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int32)
    slots[1::3] = -1  # padding rows: q is still computed, nothing is stored
    width = (num_heads + 2 * num_kv_heads) * head_dim
    return {
        "qkv": (rng.standard_normal((tokens, width)) * 10.0 ** rng.uniform(-2, 2, (tokens, 1))).astype(np.float32),
        "q_norm": (1.0 + rng.standard_normal(head_dim) * 0.3).astype(np.float32),
        "k_norm": (1.0 + rng.standard_normal(head_dim) * 0.3).astype(np.float32),
        "positions": rng.integers(0, 300, tokens).astype(np.int32),
        "cos_sin": ops.rope_cos_sin(300, rot_dim, 1e6),
        "k_cache": rng.standard_normal((blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype]),
        "v_cache": rng.standard_normal((blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype]),
        "slots": slots,
    }


def _params(case: tuple[int, ...], interleaved: bool) -> dict[str, object]:
    _, num_heads, num_kv_heads, head_dim, _ = case
    return {"eps": EPS, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "interleaved": interleaved}


def test_reference_is_rms_norm_per_head_then_rope(rng: np.random.Generator) -> None:
    tokens, num_heads, num_kv_heads, head_dim = 3, 4, 2, 16
    c = _case(rng, tokens, num_heads, num_kv_heads, head_dim, head_dim, "f32")
    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim

    def per_head(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        h = x.astype(np.float64).reshape(tokens, -1, head_dim)
        return (h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS) * w).reshape(tokens, -1).astype(np.float32)

    qkv = c["qkv"]
    normed = np.concatenate([per_head(qkv[:, :q_width], c["q_norm"]),
                             per_head(qkv[:, q_width:q_width + kv_dim], c["k_norm"]), qkv[:, q_width + kv_dim:]], 1)
    want_k, want_v = c["k_cache"].copy(), c["v_cache"].copy()
    want_q = reference.qkv_rope_kv_write(normed, c["positions"], c["cos_sin"], want_k, want_v, c["slots"],
                                         num_heads, num_kv_heads, head_dim)
    k_cache, v_cache = c["k_cache"].copy(), c["v_cache"].copy()
    got_q = reference.qkv_norm_rope_kv_write(qkv, c["q_norm"], c["k_norm"], c["positions"], c["cos_sin"],
                                             k_cache, v_cache, c["slots"], EPS, num_heads, num_kv_heads, head_dim)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_native_matches_reference_and_composition(vk: Backend, rng: np.random.Generator, case: tuple[int, ...],
                                                  kv_dtype: str, interleaved: bool) -> None:
    tokens, num_heads, num_kv_heads, head_dim, rot_dim = case
    c = _case(rng, tokens, num_heads, num_kv_heads, head_dim, rot_dim, kv_dtype)
    params = _params(case, interleaved)
    up = {name: vk.upload(a, kv_dtype if "cache" in name else None) for name, a in c.items()}
    before = vk.counters.snapshot()
    q = ops.qkv_norm_rope_kv_write(up["qkv"], up["q_norm"], up["k_norm"], up["positions"], up["cos_sin"],
                                   up["k_cache"], up["v_cache"], up["slots"], **params).numpy()
    assert vk.counters.since(before)["drains"] == 0
    assert vk.selections[("qkv_norm_rope_kv_write", "qkv_norm_rope_kv_write")] >= 1
    got_k, got_v = up["k_cache"].numpy(), up["v_cache"].numpy()

    # Against the numpy spec.
    want_k, want_v = c["k_cache"].copy(), c["v_cache"].copy()
    want_q = reference.qkv_norm_rope_kv_write(c["qkv"], c["q_norm"], c["k_norm"], c["positions"], c["cos_sin"],
                                              want_k, want_v, c["slots"], **params)
    assert nmse(q, want_q) <= QKV_NORM_NMSE
    kv_bound = QKV_NORM_NMSE if kv_dtype == "f32" else 1e-6  # f16: a value may round the other way
    assert nmse(got_k.astype(np.float32), want_k.astype(np.float32)) <= kv_bound
    np.testing.assert_array_equal(got_v, want_v)  # v is copied (and rounded like numpy)

    # Against the native composition: per-head rms_norm through views, then qkv_rope_kv_write.
    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    qkv = c["qkv"]

    def norm(x: np.ndarray, w: str) -> np.ndarray:
        heads = ops.reshape(vk.upload(np.ascontiguousarray(x)), (-1, head_dim))
        return ops.reshape(ops.rms_norm(heads, up[w], EPS), (tokens, -1)).numpy()

    normed = np.concatenate([norm(qkv[:, :q_width], "q_norm"), norm(qkv[:, q_width:q_width + kv_dim], "k_norm"),
                             qkv[:, q_width + kv_dim:]], axis=1)
    k2, v2 = vk.upload(c["k_cache"], kv_dtype), vk.upload(c["v_cache"], kv_dtype)
    q2 = ops.qkv_rope_kv_write(vk.upload(normed), up["positions"], up["cos_sin"], k2, v2, up["slots"],
                               num_heads, num_kv_heads, head_dim, interleaved).numpy()
    assert q.tobytes() == q2.tobytes()
    assert got_k.tobytes() == k2.numpy().tobytes()
    assert got_v.tobytes() == v2.numpy().tobytes()


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", [(1, 2, 1, 16, 16), (7, 8, 2, 128, 128), (5, 8, 1, 256, 256)],
                         ids=lambda c: "x".join(map(str, c)))
def test_v_norm_matches_reference_and_composition(vk: Backend, rng: np.random.Generator, case: tuple[int, ...],
                                                  kv_dtype: str) -> None:
    """Gemma 4's v_norm: each v head RMS-normed without a weight before it is cached; within the
    bound of the numpy spec, and bit for bit the v heads through rms_norm (weight ones) first."""
    tokens, num_heads, num_kv_heads, head_dim, _ = case
    c = _case(rng, *case, kv_dtype)
    params = _params(case, False) | {"v_norm": True}
    up = {name: vk.upload(a, kv_dtype if "cache" in name else None) for name, a in c.items()}
    before = vk.counters.snapshot()
    q = ops.qkv_norm_rope_kv_write(up["qkv"], up["q_norm"], up["k_norm"], up["positions"], up["cos_sin"],
                                   up["k_cache"], up["v_cache"], up["slots"], **params).numpy()
    assert vk.counters.since(before)["drains"] == 0
    want_k, want_v = c["k_cache"].copy(), c["v_cache"].copy()
    want_q = reference.qkv_norm_rope_kv_write(c["qkv"], c["q_norm"], c["k_norm"], c["positions"], c["cos_sin"],
                                              want_k, want_v, c["slots"], **params)
    kv_bound = QKV_NORM_NMSE if kv_dtype == "f32" else 1e-6
    assert nmse(q, want_q) <= QKV_NORM_NMSE
    assert nmse(up["v_cache"].numpy().astype(np.float32), want_v.astype(np.float32)) <= kv_bound
    plain_k, plain_v = c["k_cache"].copy(), c["v_cache"].copy()  # without v_norm: v cached as projected
    reference.qkv_norm_rope_kv_write(c["qkv"], c["q_norm"], c["k_norm"], c["positions"], c["cos_sin"], plain_k, plain_v,
                                     c["slots"], **_params(case, False))
    assert np.array_equal(plain_k, want_k) and not np.allclose(plain_v, want_v)

    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    v = ops.reshape(vk.upload(np.ascontiguousarray(c["qkv"][:, q_width + kv_dim:])), (-1, head_dim))
    normed_v = ops.reshape(ops.rms_norm(v, vk.upload(np.ones(head_dim, np.float32)), EPS), (tokens, -1)).numpy()
    k2, v2 = vk.upload(c["k_cache"], kv_dtype), vk.upload(c["v_cache"], kv_dtype)
    q2 = ops.qkv_norm_rope_kv_write(vk.upload(np.concatenate([c["qkv"][:, :q_width + kv_dim], normed_v], axis=1)),
                                    up["q_norm"], up["k_norm"], up["positions"], up["cos_sin"], k2, v2, up["slots"],
                                    **_params(case, False)).numpy()
    assert q.tobytes() == q2.tobytes()
    assert up["k_cache"].numpy().tobytes() == k2.numpy().tobytes()
    assert up["v_cache"].numpy().tobytes() == v2.numpy().tobytes()


def test_native_is_batch_invariant(vk: Backend, rng: np.random.Generator) -> None:
    case = (9, 8, 1, 256, 256)
    c = _case(rng, *case, "f32")
    params = _params(case, False)
    c["slots"][:] = -1  # q only

    def run(rows: slice) -> np.ndarray:
        up = {name: vk.upload(a[rows] if name in ("qkv", "positions", "slots") else a) for name, a in c.items()}
        return ops.qkv_norm_rope_kv_write(up["qkv"], up["q_norm"], up["k_norm"], up["positions"], up["cos_sin"],
                                          up["k_cache"], up["v_cache"], up["slots"], **params).numpy()

    assert run(slice(0, 9))[4:5].tobytes() == run(slice(4, 5)).tobytes()


def test_bad_norm_weights_are_refused(vk: Backend, rng: np.random.Generator) -> None:
    c = _case(rng, 2, 4, 2, 16, 16, "f32")
    up = {name: vk.upload(a) for name, a in c.items()}
    with pytest.raises(VkrtError, match="qkv_norm_rope_kv_write: q_norm and k_norm"):
        ops.qkv_norm_rope_kv_write(up["qkv"], vk.upload(np.ones(15, np.float32)), up["k_norm"], up["positions"],
                                   up["cos_sin"], up["k_cache"], up["v_cache"], up["slots"], EPS, 4, 2, 16)


@pytest.mark.parametrize("lanes", [1, 64, 256])
def test_native_at_gpu_row_widths(vk_default: Backend, rng: np.random.Generator, lanes: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs reduce a row with up to 256 lanes (norm.row_workgroup): more lanes than head_dim
    leaves some idle; the result still matches the spec and the per-head rms_norm."""
    from vkrt.backend.vulkan.kernels import norm, qkv_rope

    monkeypatch.setattr(norm, "row_workgroup", lambda caps: lanes)
    monkeypatch.setattr(qkv_rope, "row_workgroup", lambda caps: lanes)
    case = (3, 8, 2, 128, 128)
    tokens, num_heads, num_kv_heads, head_dim, _ = case
    c = _case(rng, *case, "f16")
    params = _params(case, False)
    vk = vk_default
    up = {name: vk.upload(a, "f16" if "cache" in name else None) for name, a in c.items()}
    q = ops.qkv_norm_rope_kv_write(up["qkv"], up["q_norm"], up["k_norm"], up["positions"], up["cos_sin"],
                                   up["k_cache"], up["v_cache"], up["slots"], **params).numpy()
    want_k, want_v = c["k_cache"].copy(), c["v_cache"].copy()
    want_q = reference.qkv_norm_rope_kv_write(c["qkv"], c["q_norm"], c["k_norm"], c["positions"], c["cos_sin"],
                                              want_k, want_v, c["slots"], **params)
    assert nmse(q, want_q) <= QKV_NORM_NMSE
    q_width = num_heads * head_dim
    heads = ops.reshape(vk.upload(np.ascontiguousarray(c["qkv"][:, :q_width])), (-1, head_dim))
    normed_q = ops.reshape(ops.rms_norm(heads, up["q_norm"], EPS), (tokens, -1)).numpy()
    roped = ops.rope(vk.upload(normed_q), up["positions"], up["cos_sin"], head_dim).numpy()
    assert q.tobytes() == roped.tobytes()
