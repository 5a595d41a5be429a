"""Native embedding gather: bit-exact with the numpy reference for every table format."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ops.test_matmul import FORMATS, K_QUANTS, is_block, make_weight
from vkrt import ops
from vkrt.backend.base import Backend


@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_bit_exact(vk: Backend, rng: np.random.Generator, fmt: str, t: int) -> None:
    v, d = 67, (512 if fmt in K_QUANTS else 96 if is_block(fmt) else 37)
    raw, dense = make_weight(rng, fmt, v, d)
    ids = rng.integers(0, v, size=t).astype(np.int32)
    ids[0] = v - 1  # the last row: the scales region starts right after its quants
    before = vk.selections[("embedding", "embedding")]
    got = ops.embedding(vk.upload_weight(raw, fmt, (v, d)), vk.upload(ids)).numpy()
    assert vk.selections[("embedding", "embedding")] == before + 1
    expected = ops.OPS["embedding"].reference(dense, ids)
    assert got.shape == (t, d)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
