"""Native rope vs its numpy reference, NeoX and interleaved, full and partial rotary.

With `precise` (no FMA contraction) every element is one f32 multiply-add sequence rounded
like numpy's, so the kernel is bit-exact on llvmpipe; the contract is NMSE <= 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

import vkrt.ops as ops
from tests.conftest import nmse
from vkrt.errors import VkrtError

ROPE_NMSE = 1e-12
# (tokens, heads, head_dim, rot_dim)
CASES = [(1, 1, 2, 2), (5, 9, 64, 64), (3, 3, 64, 32), (7, 2, 10, 4), (64, 4, 128, 128)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_rope_matches_reference(vk, rng, case: tuple[int, int, int, int], interleaved: bool) -> None:
    t, heads, head_dim, rot_dim = case
    x = rng.standard_normal((t, heads * head_dim)).astype(np.float32)
    positions = rng.integers(0, 300, t).astype(np.int32)
    table = ops.rope_cos_sin(300, rot_dim, 10000.0)
    drains = vk.counters.drains
    got = ops.rope(vk.upload(x), vk.upload(positions), vk.upload(table), head_dim, interleaved).numpy()
    assert vk.counters.drains == drains
    want = ops.OPS["rope"].reference(x, positions, table, head_dim, interleaved)
    assert nmse(got, want) <= ROPE_NMSE
    np.testing.assert_array_equal(got, want)  # measured bit-exact on llvmpipe


def test_rope_reads_positions_from_the_buffer(vk, rng) -> None:
    """A decode step rewrites the positions buffer in place; the kernel must see the new values."""
    x = vk.upload(rng.standard_normal((2, 64)).astype(np.float32))
    table_host = ops.rope_cos_sin(64, 64, 10000.0)
    table = vk.upload(table_host)
    positions = vk.upload(np.array([3, 5], np.int32))
    first = ops.rope(x, positions, table, 64).numpy()
    vk.write(positions, np.array([40, 7], np.int32))
    second = ops.rope(x, positions, table, 64).numpy()
    host_x = x.numpy()
    for got, pos in ((first, [3, 5]), (second, [40, 7])):
        want = ops.OPS["rope"].reference(host_x, np.array(pos, np.int32), table_host, 64)
        np.testing.assert_array_equal(got, want)


def test_rope_rejects_bad_input(vk) -> None:
    x = vk.upload(np.zeros((2, 64), np.float32))
    table = vk.upload(ops.rope_cos_sin(8, 64, 10000.0))
    with pytest.raises(VkrtError, match="rope"):
        ops.rope(x, vk.upload(np.zeros(2, np.float32)), table, 64)  # positions must be i32
    with pytest.raises(VkrtError, match="rope"):
        ops.rope(x, vk.upload(np.zeros(3, np.int32)), table, 64)  # one position per token
