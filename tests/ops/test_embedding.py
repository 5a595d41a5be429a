"""Native embedding gather: bit-exact with the numpy reference for every table format."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ops.test_matmul import K_QUANTS, random_k_quant
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.ops.quant import dequantize, f32_to_bf16, quantize

FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")


def _table(rng: np.random.Generator, fmt: str, v: int, d: int) -> np.ndarray:
    """A random table in storage format `fmt` (block formats from quantize(), K-quants random)."""
    if fmt in K_QUANTS:
        return random_k_quant(rng, fmt, v, d)
    w = rng.standard_normal((v, d)).astype(np.float32)
    if fmt == "f16":
        return w.astype(np.float16)
    if fmt == "bf16":
        return f32_to_bf16(w)
    return w if fmt == "f32" else quantize(w, fmt)


@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_bit_exact(vk: Backend, rng: np.random.Generator, fmt: str, t: int) -> None:
    v, d = 67, (512 if fmt in K_QUANTS else 96 if fmt.startswith("q") else 37)
    raw = _table(rng, fmt, v, d)
    ids = rng.integers(0, v, size=t).astype(np.int32)
    ids[0] = v - 1  # the last row: the scales region starts right after its quants
    before = vk.selections[("embedding", "embedding")]
    got = ops.embedding(vk.upload_weight(raw, fmt, (v, d)), vk.upload(ids)).numpy()
    assert vk.selections[("embedding", "embedding")] == before + 1
    expected = ops.OPS["embedding"].reference(dequantize(raw, fmt), ids)
    assert got.shape == (t, d)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
