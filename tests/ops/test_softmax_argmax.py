"""Native softmax and argmax vs their numpy references, on both access paths.

softmax bound: NMSE <= 1e-9 (measured <= 5e-11 for 49152 logits of scale 5 on llvmpipe: the
shader's f32 exp against float64). argmax must equal numpy exactly, ties and NaN included.
"""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from vkrt.errors import VkrtError

SOFTMAX_NMSE = 1e-9
SHAPES = [(1, 1), (3, 7), (5, 576), (2, 1000), (2, 49157)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softmax_matches_reference(vk, rng, shape: tuple[int, int]) -> None:
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    drains = vk.counters.drains
    got = ops.softmax(vk.upload(x)).numpy()
    assert vk.counters.drains == drains
    assert nmse(got, ops.OPS["softmax"].reference(x)) <= SOFTMAX_NMSE
    np.testing.assert_allclose(got.sum(axis=-1, dtype=np.float64), 1.0, rtol=1e-5)


def test_softmax_takes_minus_inf_and_large_values(vk) -> None:
    x = np.array([[-np.inf, 0.0, 1.0, -np.inf], [1e30, 1e30, -1e30, 0.0]], np.float32)
    got = ops.softmax(vk.upload(x)).numpy()
    assert nmse(got, ops.OPS["softmax"].reference(x)) <= SOFTMAX_NMSE


def test_softmax_is_batch_invariant(vk, rng) -> None:
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    batched = ops.softmax(vk.upload(x)).numpy()
    for t in (0, 17, 63):
        np.testing.assert_array_equal(batched[t], ops.softmax(vk.upload(x[t : t + 1])).numpy()[0])


@pytest.mark.parametrize("shape", SHAPES + [(64, 576), (3, 65536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_argmax_matches_reference(vk, rng, shape: tuple[int, int]) -> None:
    x = rng.standard_normal(shape).astype(np.float32)
    drains = vk.counters.drains
    got = ops.argmax(vk.upload(x)).numpy()
    assert vk.counters.drains == drains
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ops.OPS["argmax"].reference(x))


def test_argmax_ties_take_the_first_index(vk, rng) -> None:
    n = 49152
    x = rng.standard_normal((6, n)).astype(np.float32)
    x[0, [9, 10, 4000]] = 7.0          # ties within and across lanes
    x[1, [n - 1, 3]] = 7.0             # the later tie sits in the last column
    x[2, :] = 2.0                      # every column ties: index 0
    x[3, :] = -np.inf                  # all -inf: index 0, like numpy
    x[4, [100, 5]] = np.nan            # numpy: the first NaN wins
    x[5, ::2] = 7.0                    # many ties in every lane
    got = ops.argmax(vk.upload(x)).numpy()
    np.testing.assert_array_equal(got, x.argmax(axis=-1))
    small = np.array([[1.0, 3.0, 3.0], [-np.inf, -np.inf, -1.0]], np.float32)  # fewer columns than lanes
    np.testing.assert_array_equal(ops.argmax(vk.upload(small)).numpy(), small.argmax(axis=-1))


def test_softmax_argmax_reject_bad_input(vk) -> None:
    with pytest.raises(VkrtError, match="softmax"):
        ops.softmax(vk.upload(np.zeros(8, np.float32)))
    with pytest.raises(VkrtError, match="argmax"):
        ops.argmax(vk.upload(np.zeros((2, 8), np.int32)))
