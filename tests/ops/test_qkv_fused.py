"""qkv_rope_kv_write (rope of q and k plus the KV cache write, one dispatch) vs the unfused
rope + rope + kv_write it replaces: bit-identical q and caches on both access paths, f32 and
f16 caches, and fewer dispatches per SmolLM2 decode step with the stacked qkv matmul.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from vkrt import ops
from vkrt.backend.base import Backend

NP_KV = {"f32": np.float32, "f16": np.float16}
# (tokens, num_heads, num_kv_heads, head_dim, rot_dim): GQA ratios 1 and 3, odd token counts.
CASES = [(1, 3, 3, 16, 16), (7, 9, 3, 64, 64), (5, 4, 4, 64, 32), (3, 6, 2, 16, 16), (16, 9, 3, 64, 64)]
BASELINE_DISPATCHES = 396  # SmolLM2 decode step with three projections, 2x rope, kv_write


def _case(rng: np.random.Generator, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
          rot_dim: int, kv_dtype: str) -> dict[str, np.ndarray]:
    blocks, block_size = 6, 4
    kv_dim = num_kv_heads * head_dim
    slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int32)
    slots[1::3] = -1  # padding rows: q is still computed, nothing is stored
    scale = 10.0 ** rng.uniform(-6, 4.5, (tokens, (num_heads + 2 * num_kv_heads) * head_dim))
    return {
        "qkv": (rng.standard_normal(scale.shape) * scale).astype(np.float32),
        "positions": rng.integers(0, 200, tokens).astype(np.int32),
        "cos_sin": ops.rope_cos_sin(200, rot_dim, 10000.0),
        "k_cache": rng.standard_normal((blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype]),
        "v_cache": rng.standard_normal((blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype]),
        "slots": slots,
    }


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fused_equals_unfused(vk: Backend, rng: np.random.Generator, case: tuple[int, ...],
                              kv_dtype: str, interleaved: bool) -> None:
    tokens, num_heads, num_kv_heads, head_dim, rot_dim = case
    c = _case(rng, tokens, num_heads, num_kv_heads, head_dim, rot_dim, kv_dtype)
    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    up = {name: vk.upload(a, kv_dtype if "cache" in name else None) for name, a in c.items()}
    before = vk.counters.snapshot()
    q = ops.qkv_rope_kv_write(up["qkv"], up["positions"], up["cos_sin"], up["k_cache"], up["v_cache"],
                              up["slots"], num_heads, num_kv_heads, head_dim, interleaved)
    assert vk.counters.since(before)["drains"] == 0
    assert vk.selections[("qkv_rope_kv_write", "qkv_rope_kv_write")] >= 1

    # The unfused path on the same device: rope, rope, kv_write.
    qkv = c["qkv"]
    k_cache, v_cache = vk.upload(c["k_cache"], kv_dtype), vk.upload(c["v_cache"], kv_dtype)
    pos, table = up["positions"], up["cos_sin"]
    want_q = ops.rope(vk.upload(qkv[:, :q_width]), pos, table, head_dim, interleaved)
    k = ops.rope(vk.upload(qkv[:, q_width:q_width + kv_dim]), pos, table, head_dim, interleaved)
    ops.kv_write(k_cache, v_cache, k, vk.upload(qkv[:, q_width + kv_dim:]), up["slots"])
    assert q.numpy().tobytes() == want_q.numpy().tobytes()
    assert up["k_cache"].numpy().tobytes() == k_cache.numpy().tobytes()
    assert up["v_cache"].numpy().tobytes() == v_cache.numpy().tobytes()

    # And the numpy reference (the same composition on the host).
    ref_k, ref_v = c["k_cache"].copy(), c["v_cache"].copy()
    with np.errstate(over="ignore"):
        ref_q = ops.OPS["qkv_rope_kv_write"].reference(qkv, c["positions"], c["cos_sin"], ref_k, ref_v,
                                                       c["slots"], num_heads, num_kv_heads, head_dim,
                                                       interleaved)
    assert q.numpy().tobytes() == ref_q.tobytes()
    assert up["k_cache"].numpy().tobytes() == ref_k.tobytes()
    assert up["v_cache"].numpy().tobytes() == ref_v.tobytes()


def test_reference_backend_mutates_and_returns(ref: Backend, rng: np.random.Generator) -> None:
    """The registry's in-place-with-outputs path: caches written, q returned."""
    c = _case(rng, 3, 2, 1, 16, 16, "f32")
    k_cache, v_cache = ref.upload(c["k_cache"]), ref.upload(c["v_cache"])
    q = ops.qkv_rope_kv_write(ref.upload(c["qkv"]), ref.upload(c["positions"]), ref.upload(c["cos_sin"]),
                              k_cache, v_cache, ref.upload(c["slots"]), 2, 1, 16)
    want_q = ops.OPS["rope"].reference(c["qkv"][:, :32], c["positions"], c["cos_sin"], 16)
    np.testing.assert_array_equal(q.numpy(), want_q)
    row = c["slots"][0]
    np.testing.assert_array_equal(v_cache.numpy().reshape(-1, 16)[row], c["qkv"][0, 48:])
    assert not np.array_equal(k_cache.numpy(), c["k_cache"])


def test_odd_head_dim_falls_back_with_a_drain(vk: Backend, rng: np.random.Generator) -> None:
    """No native kernel for odd head_dim: the reference runs after a drain, caches written back."""
    c = _case(rng, 2, 1, 1, 5, 4, "f16")
    k_cache, v_cache = vk.upload(c["k_cache"], "f16"), vk.upload(c["v_cache"], "f16")
    before = vk.counters.snapshot()
    q = ops.qkv_rope_kv_write(vk.upload(c["qkv"]), vk.upload(c["positions"]), vk.upload(c["cos_sin"]),
                              k_cache, v_cache, vk.upload(c["slots"]), 1, 1, 5)
    assert vk.counters.since(before)["drains"] == 1
    ref_k, ref_v = c["k_cache"].copy(), c["v_cache"].copy()
    with np.errstate(over="ignore"):
        ref_q = ops.OPS["qkv_rope_kv_write"].reference(c["qkv"], c["positions"], c["cos_sin"], ref_k, ref_v,
                                                       c["slots"], 1, 1, 5)
    assert q.numpy().tobytes() == ref_q.tobytes()
    assert k_cache.numpy().tobytes() == ref_k.tobytes()
    assert v_cache.numpy().tobytes() == ref_v.tobytes()


def test_smollm2_decode_step_has_fewer_dispatches(vk_default: Backend, smollm2_path) -> None:
    out = subprocess.run([sys.executable, "-m", "vkrt.cli", "bench", "--model", str(smollm2_path),
                          "-p", "16", "-g", "8", "--json"], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    dispatches = report["per_step"]["dispatches"]
    # Per layer: one qkv matmul instead of three, one fused op instead of rope, rope, kv_write
    # (-4), and matmul_silu_and_mul instead of the gate_up matmul + silu_and_mul (-1): 246.
    # Then both norms fused into the matmuls that consume them and both residual adds into
    # the projections that produce them (-2 per layer; the final norm joins the LM head and
    # the residual needs no gather: -2): 184, six per layer. Then the norm, qkv matmul, rope
    # and cache write as one dispatch (-1 per layer): 154, five per layer.
    assert dispatches < BASELINE_DISPATCHES
    assert dispatches == BASELINE_DISPATCHES - 30 * 5 - 62 - 30
    # The default KV cache is f16: K and V of 30 layers x 3 KV heads x 64 dims, 2 bytes each.
    assert report["kv_cache_dtype"] == "f16" and report["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
