"""latent_kv_write, multi-head latent attention's cache write from kv_a [latent, k_rope]: on Vulkan the
row's bytes equal those of rope, rms_norm, concat_columns and kv_write run one after another on
kv_a's two column ranges (the kernel shares their expressions), in every cache format, both access
paths and both RoPE pairings; against the numpy reference (float64 norm) within its rounding."""

from __future__ import annotations

import numpy as np
import pytest

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core import kv_format
from vkrt.core.op import OpError

BLOCKS, BLOCK, MAX_POS, EPS = 5, 4, 300, 1e-5
# (rank, rope): the tiny MLA fixtures' 32 + 8, and the released models' 512 + 64 (q8_0 needs rows of
# whole 64-value block pairs)
SHAPES = {"f32": [(32, 8), (512, 64)], "f16": [(32, 8), (512, 64)], "q8_0": [(512, 64)]}
CASES = [(kv, rank, rope) for kv, shapes in SHAPES.items() for rank, rope in shapes]


def _inputs(rng: np.random.Generator, tokens: int, rank: int, rope: int) -> dict[str, np.ndarray]:
    slots = rng.permutation(BLOCKS * BLOCK)[:tokens].astype(np.int32)
    slots[1::4] = -1  # padding rows store nothing
    return {"kv_a": rng.standard_normal((tokens, rank + rope)).astype(np.float32),
            "w": (1.0 + 0.1 * rng.standard_normal(rank)).astype(np.float32),
            "positions": rng.integers(0, MAX_POS, tokens).astype(np.int32),
            "cos_sin": ops.rope_cos_sin(MAX_POS, rope, 1e4), "slots": slots}


def _cache(rng: np.random.Generator, width: int, kv: str) -> np.ndarray:
    rows = rng.standard_normal((BLOCKS * BLOCK, width)).astype(np.float32)
    if kv == "q8_0":
        return kv_format.encode(rows, "q8_0").reshape(BLOCKS, BLOCK, -1)
    return rows.astype(np.float16 if kv == "f16" else np.float32).reshape(BLOCKS, BLOCK, width)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize(("kv", "rank", "rope"), CASES)
def test_equals_its_unfused_ops(vk: Backend, rng: np.random.Generator, kv: str, rank: int, rope: int, tokens: int,
                                interleaved: bool) -> None:
    a = _inputs(rng, tokens, rank, rope)
    start = _cache(rng, rank + rope, kv)
    dtype = kv_format.tensor_dtype(kv)
    up = {k: vk.upload(v) for k, v in a.items()}
    latent, k_rope = vk.upload(np.ascontiguousarray(a["kv_a"][:, :rank])), vk.upload(np.ascontiguousarray(a["kv_a"][:, rank:]))
    fused, unfused = vk.upload(start, dtype), vk.upload(start, dtype)
    drains = vk.counters.drains
    ops.latent_kv_write(up["kv_a"], up["w"], up["positions"], up["cos_sin"], fused, up["slots"], EPS,
                        interleaved=interleaved)
    row = ops.concat_columns(ops.rope(k_rope, up["positions"], up["cos_sin"], rope, interleaved=interleaved),
                             ops.rms_norm(latent, up["w"], EPS))
    ops.kv_write(unfused, unfused, row, row, up["slots"])
    assert fused.numpy().tobytes() == unfused.numpy().tobytes()
    assert vk.counters.drains == drains
    expected = start.copy()
    ops.OPS["latent_kv_write"].reference(a["kv_a"], a["w"], a["positions"], a["cos_sin"], expected, a["slots"], EPS,
                                         interleaved)
    got, want = (kv_format.read_rows(c, np.arange(BLOCKS * BLOCK)) for c in (fused.numpy(), expected))
    untouched = np.setdiff1d(np.arange(BLOCKS * BLOCK), a["slots"])
    np.testing.assert_array_equal(got[untouched], want[untouched])  # padding and other slots keep their bytes
    np.testing.assert_allclose(got, want, rtol=0, atol={"f32": 2e-6, "f16": 4e-3, "q8_0": 0.05}[kv])


def test_bad_shapes_are_refused(ref: Backend, rng: np.random.Generator) -> None:
    a = _inputs(rng, 3, 32, 8)
    cache = ref.upload(np.zeros((BLOCKS, BLOCK, 48), np.float32))  # not 32 + 8 wide
    with pytest.raises(OpError, match="rank \\+ rope = 40"):
        ops.latent_kv_write(*(ref.upload(a[k]) for k in ("kv_a", "w", "positions", "cos_sin")), cache,
                            ref.upload(a["slots"]), EPS)
