"""paged_attention split over the context (flash-decoding) vs the numpy reference.

A block table wider than PAGED_CHUNK positions splits each (token, head) into chunks of that
many positions; in a decode-shaped step each chunk writes its partial softmax state and
paged_attention_merge folds them in chunk order (a prefill-shaped step walks a row's chunks in
one workgroup instead, to the same bits: test_walked_chunks_equal_split_chunks). Only GPUs split (`paged_chunk`); these tests
make this device split. Cases cross block (16) and chunk (256) boundaries up to 4096
positions, on both kernels (the GQA kernel where a tile holds two or more heads, else the
paged kernel), both paged variants (subgroup split and one invocation per chunk) and both
access paths. Bound:
tests/ops/test_attention.py's attention NMSE. Batch invariance is bit-exact: a sequence's
output is the same alone (its own, narrower table: one chunk or fewer) as in a batch with
sequences of other lengths.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

from tests.conftest import nmse, ssbo_sample
from tests.ops.test_attention import paged_variant  # noqa: F401  (fixture: "sub" and "seq")
from tests.tools.conftest import load_tool
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import attention as kernels

_cases = load_tool("attention_cases")  # the random inputs (tools/attention_cases.py)
BLOCK, decode_case, upload = _cases.BLOCK, _cases.decode_case, _cases.upload

reference = importlib.import_module("vkrt.ops.attention")  # the numpy specs

ATTENTION_NMSE = 5e-11  # tests/ops/test_attention.py's bound
LENGTHS = [1, 15, 16, 17, 255, 256, 257, 1000, 2048, 2049, 4095, 4096]
GEOMETRIES = [  # (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3, 4, 8; head dims 64, 128, 256
    (4, 4, 64),
    (9, 3, 64),  # SmolLM2-135M
    (8, 2, 128),
    (8, 1, 256),
]


def run(vk: Backend, case: dict[str, np.ndarray], kv_dtype: str, num_heads: int, num_kv_heads: int,
        scale: float, window: int = 0, softcap: float = 0.0) -> np.ndarray:
    t = upload(vk, case, kv_dtype)
    return ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"],
                               t["positions"], num_heads, num_kv_heads, scale, window=window,
                               softcap=softcap).numpy()


def want(case: dict[str, np.ndarray], num_heads: int, num_kv_heads: int, scale: float, window: int = 0,
         softcap: float = 0.0) -> np.ndarray:
    return reference.paged_attention(**case, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
                                     window=window, softcap=softcap)


@pytest.fixture(autouse=True)
def split_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split wherever the table allows: `paged_chunk` keeps CPU devices (this one) unsplit."""
    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: kernels.PAGED_CHUNK)


def kernel_for(variant: str, num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """The attention kernel a step of this geometry runs under `variant` (tests.ops.test_attention)."""
    tiles = variant == "sub" and kernels.gqa_heads(num_heads // num_kv_heads, head_dim) > 1
    return "paged_attention_gqa" if tiles else "paged_attention"


class Modules:
    """Module families of the shaders the backend runs."""

    def __init__(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[str] = []
        original = backend.run_shader  # type: ignore[attr-defined]

        def spy(name: str, *args: Any) -> Any:
            self.seen.append(name.split(".")[0])
            return original(name, *args)

        monkeypatch.setattr(backend, "run_shader", spy)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}kv{}d{}".format(*g))
def test_split_matches_reference(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                 monkeypatch: pytest.MonkeyPatch, kv_dtype: str,
                                 geometry: tuple[int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim = geometry
    case = decode_case(rng, LENGTHS, num_heads, num_kv_heads, head_dim, kv_dtype)
    case["q"] *= 3.0  # a peaked softmax: chunks' maxima differ, so the merge rescales
    modules = Modules(vk, monkeypatch)
    got = run(vk, case, kv_dtype, num_heads, num_kv_heads, head_dim ** -0.5)
    assert modules.seen == [kernel_for(paged_variant, *geometry), "paged_attention_merge"]
    expected = want(case, num_heads, num_kv_heads, head_dim ** -0.5)
    for s, n in enumerate(LENGTHS):
        assert nmse(got[s], expected[s]) <= ATTENTION_NMSE, f"length {n}"


@pytest.mark.parametrize("block_size", [4, 8], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("geometry", [(9, 3, 64), (8, 1, 256)], ids=lambda g: "h{}kv{}d{}".format(*g))
def test_split_with_blocks_smaller_than_a_subgroup(vk: Backend, rng: np.random.Generator,
                                                   paged_variant: str,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch, geometry: tuple[int, int, int],
                                                   block_size: int) -> None:
    """Blocks of 4 and 8 tokens (fewer than llvmpipe's or NVIDIA's lanes), chunks of many blocks."""
    num_heads, num_kv_heads, head_dim = geometry
    lengths = [1, 3, 4, 5, 8, 9, 255, 257, 1000, 2049]
    case = decode_case(rng, lengths, num_heads, num_kv_heads, head_dim, "f16", block_size=block_size)
    case["q"] *= 3.0
    modules = Modules(vk, monkeypatch)
    got = run(vk, case, "f16", num_heads, num_kv_heads, head_dim ** -0.5)
    assert modules.seen == [kernel_for(paged_variant, *geometry), "paged_attention_merge"]
    expected = want(case, num_heads, num_kv_heads, head_dim ** -0.5)
    for s, n in enumerate(lengths):
        assert nmse(got[s], expected[s]) <= ATTENTION_NMSE, f"length {n}"


@ssbo_sample(lambda geometry, kv_dtype, **_: geometry == GEOMETRIES[0])
@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}kv{}d{}".format(*g))
def test_walked_chunks_equal_split_chunks(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                          monkeypatch: pytest.MonkeyPatch, kv_dtype: str,
                                          geometry: tuple[int, int, int]) -> None:
    """The same decode rows with each chunk a workgroup (partials, merge pass) and with one
    workgroup walking all of a row's chunks (what prefill-shaped steps do): byte-equal, at every
    length up to 4096."""
    num_heads, num_kv_heads, head_dim = geometry
    case = decode_case(rng, LENGTHS, num_heads, num_kv_heads, head_dim, kv_dtype)
    case["q"] *= 3.0
    args = (num_heads, num_kv_heads, head_dim ** -0.5)
    split = run(vk, case, kv_dtype, *args)
    monkeypatch.setattr(kernels, "SPLIT_TOKENS", 0)  # never split: walk
    modules = Modules(vk, monkeypatch)
    walked = run(vk, case, kv_dtype, *args)
    assert modules.seen == [kernel_for(paged_variant, *geometry)]
    np.testing.assert_array_equal(walked.view(np.uint32), split.view(np.uint32))
    assert nmse(walked, want(case, *args)) <= ATTENTION_NMSE


@pytest.mark.parametrize(("window", "softcap"), [(100, 0.0), (300, 0.0), (1000, 0.0), (0, 30.0), (300, 20.0)],
                         ids=lambda v: str(v))
def test_split_windows_and_softcaps(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                    window: int, softcap: float) -> None:
    """Sliding windows start inside, at and across chunks (chunks before the window are neutral)."""
    lengths = [1, 200, 256, 257, 700, 2049, 4096]
    case = decode_case(rng, lengths, 8, 2, 64, "f16")
    got = run(vk, case, "f16", 8, 2, 0.125, window, softcap)
    expected = want(case, 8, 2, 0.125, window, softcap)
    for s, n in enumerate(lengths):
        assert nmse(got[s], expected[s]) <= ATTENTION_NMSE, f"length {n}"


def test_split_is_batch_invariant(vk: Backend, rng: np.random.Generator, paged_variant: str) -> None:  # noqa: F811
    """Each sequence alone (its own table, so a short one runs unsplit) equals itself in a
    batch with sequences of other lengths and a padding row, bit for bit, at depths > 2048."""
    lengths = [3000, 100, 2500, 4096, 257, 2049]
    case = decode_case(rng, lengths + [1], 9, 3, 64, "f16")
    case["seq_index"][-1] = -1  # a padding row: zeros
    batch = run(vk, case, "f16", 9, 3, 0.125)
    assert not batch[-1].any()
    for s, n in enumerate(lengths):
        alone = dict(case, q=case["q"][s:s + 1], positions=case["positions"][s:s + 1],
                     block_table=case["block_table"][s:s + 1, :-(-n // BLOCK)].copy(),
                     seq_index=np.zeros(1, np.int32))
        got = run(vk, alone, "f16", 9, 3, 0.125)
        np.testing.assert_array_equal(got[0], batch[s], err_msg=f"length {n}")
    assert nmse(batch[:-1], want(case, 9, 3, 0.125)[:-1]) <= ATTENTION_NMSE


def test_split_replays_with_new_lengths(vk: Backend, rng: np.random.Generator, paged_variant: str) -> None:  # noqa: F811
    """The grid is sized by the table's width at record time; lengths and tables come from
    buffers, so a recorded decode step replays for other lengths (chunks past a length exit)."""
    first = decode_case(rng, [4096, 10, 3000, 600], 9, 3, 64, "f16")
    second = dict(first, positions=np.array([5, 4095, 2048, 256], np.int32),
                  block_table=first["block_table"][::-1].copy())
    t = upload(vk, first, "f16")
    with vk.capture() as graph:  # type: ignore[attr-defined]
        out = ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"],
                                  t["positions"], 9, 3, 0.125)
    for case in (first, second):
        for name in ("positions", "block_table"):
            vk.write(t[name], case[name])  # type: ignore[attr-defined]
        graph.replay()
        got = out.numpy()
        assert nmse(got, want(case, 9, 3, 0.125)) <= ATTENTION_NMSE
        np.testing.assert_array_equal(got, run(vk, case, "f16", 9, 3, 0.125))


def test_split_in_token_slabs(vk: Backend, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 decode rows deep into one shared context: with scratch for only 7 tokens at a time
    the split runs in slabs, bit-identical to one slab."""
    n, rows = 2100, 40
    case = decode_case(rng, [n], 4, 2, 64, "f32")
    case.update(q=rng.standard_normal((rows, 4 * 64)).astype(np.float32),
                block_table=np.repeat(case["block_table"], rows, axis=0),
                positions=(n - 1 - 7 * np.arange(rows)).astype(np.int32), seq_index=np.arange(rows, dtype=np.int32))
    whole = run(vk, case, "f32", 4, 2, 0.125)
    per_token = 4 * -(-n // kernels.PAGED_CHUNK) * (64 // 4 + 1) * 16
    monkeypatch.setattr(kernels, "PAGED_SCRATCH_BYTES", 7 * per_token)
    modules = Modules(vk, monkeypatch)
    slabs = run(vk, case, "f32", 4, 2, 0.125)
    assert modules.seen.count("paged_attention_merge") == -(-rows // 7)
    np.testing.assert_array_equal(slabs, whole)
    assert nmse(whole, want(case, 4, 2, 0.125)) <= ATTENTION_NMSE
