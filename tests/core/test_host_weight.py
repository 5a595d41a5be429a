"""Row scales on host weights: a multiplier folded into a float weight's rows as it is read."""

from __future__ import annotations

import numpy as np
import pytest

from vkrt.core.host_weight import HostWeight, RowBlock
from vkrt.core.quant import bf16_to_f32, f32_to_bf16


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_row_scale_multiplies_each_row_in_its_own_format(dtype: str, rng: np.random.Generator) -> None:
    values = rng.standard_normal((5, 8)).astype(np.float32)
    stored = {"f32": values, "f16": values.astype(np.float16), "bf16": f32_to_bf16(values)}[dtype]
    as_f32 = bf16_to_f32(stored) if dtype == "bf16" else stored.astype(np.float32)
    scale = np.array([1.0, 2.0, 0.5, -1.5, 3.0], np.float32)
    order = np.array([4, 0, 2, 1, 3])
    rows = RowBlock(stored, order, scale[order]).rows()
    assert rows.dtype == stored.dtype and rows.shape == (5, 8)
    got = bf16_to_f32(rows) if dtype == "bf16" else rows.astype(np.float32)
    expected = as_f32[order] * scale[order][:, None]
    tolerance = {"f32": 0.0, "f16": 1e-3, "bf16": 8e-3}[dtype]  # one rounding back into the format
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=1e-6)
    assert RowBlock(stored).rows() is stored  # unscaled, unordered: the stored array itself


def test_stacked_weight_scales_only_its_scaled_piece() -> None:
    q, k = np.ones((2, 3), np.float32), np.ones((1, 3), np.float32)
    weight = HostWeight("f32", (3, 3), ((RowBlock(q), RowBlock(k, scale=np.array([0.25], np.float32))),))
    np.testing.assert_array_equal(weight.matrix(0)[:, 0], [1.0, 1.0, 0.25])


def test_block_formats_are_never_scaled() -> None:
    with pytest.raises(TypeError, match="block formats"):
        RowBlock(np.zeros((2, 18), np.uint8), scale=np.ones(2, np.float32)).rows()
