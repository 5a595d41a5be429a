"""Chunked attention (Llama 4): paged_attention(window=W, chunked=True) sees the W-aligned chunk of
each position, floor(p / W) * W <= j <= p, on the reference tier and in the native kernels (both
attention kernels, unsplit and split into flash-decoding chunks with their merge)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_attention import _direct_attention, _native, _paged_case, paged_variant  # noqa: F401  (fixture)
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import attention as kernels
from vkrt.errors import VkrtError

reference = importlib.import_module("vkrt.ops.attention")
ATTENTION_NMSE = 5e-11  # tests/ops/test_attention.py's bound


def _prefill_case(rng: np.random.Generator, num_heads: int, num_kv_heads: int, head_dim: int,
                  kv_dtype: str) -> dict[str, np.ndarray]:
    """Decode tokens at positions 0, 5, 22, 40, a prefill run of sequence 3 across chunk edges, a padding row."""
    case = _paged_case(rng, [1, 6, 23, 41], num_heads, num_kv_heads, head_dim, kv_dtype)
    run = np.arange(14, 41, 3, dtype=np.int32)
    case["q"] = np.concatenate([case["q"], rng.standard_normal((run.size + 1, case["q"].shape[1]))]
                               ).astype(np.float32) * 4.0
    case["seq_index"] = np.concatenate([case["seq_index"], np.full(run.size, 3), [-1]]).astype(np.int32)
    case["positions"] = np.concatenate([case["positions"], run, [5]]).astype(np.int32)
    return case


@pytest.mark.parametrize("chunk", [1, 5, 8, 16, 64])
def test_reference_chunked_window(rng: np.random.Generator, chunk: int) -> None:
    case = _prefill_case(rng, 4, 2, 16, "f32")
    got = reference.paged_attention(**case, num_heads=4, num_kv_heads=2, scale=0.25, window=chunk, chunked=True)
    assert nmse(got, _direct_attention(case, 4, 2, 0.25, 0, 0.0, chunk=chunk)) <= 1e-12
    sliding = reference.paged_attention(**case, num_heads=4, num_kv_heads=2, scale=0.25, window=chunk)
    assert chunk in (1, 64) or not np.allclose(got, sliding), "a chunked window is not a sliding one"


@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("geometry", [(4, 4, 64), (8, 2, 128), (4, 2, 16)], ids=lambda g: "h{}kv{}d{}".format(*g))
def test_native_chunked_window(vk: Backend, rng: np.random.Generator, kv_dtype: str, geometry: tuple[int, int, int],
                               chunk: int, paged_variant: str) -> None:  # noqa: F811
    num_heads, num_kv_heads, head_dim = geometry
    case = _prefill_case(rng, num_heads, num_kv_heads, head_dim, kv_dtype)
    t = {name: vk.upload(a, kv_dtype if name.endswith("cache") else None) for name, a in case.items()}
    before = vk.counters.snapshot()
    got = ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"], t["positions"],
                              num_heads, num_kv_heads, head_dim ** -0.5, window=chunk, chunked=True).numpy()
    _native(vk, "paged_attention", before, 1)
    want = reference.paged_attention(**case, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=head_dim ** -0.5,
                                     window=chunk, chunked=True)
    assert not got[-1].any()
    assert nmse(got, want) <= ATTENTION_NMSE


@pytest.mark.parametrize("chunk", [100, 256, 300])
def test_split_chunked_window(vk: Backend, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                              paged_variant: str, chunk: int) -> None:  # noqa: F811
    """Flash-decoding splits at multiples of 256 positions: chunk-aligned windows inside, at and across them."""
    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: kernels.PAGED_CHUNK)
    case = _paged_case(rng, [1, 200, 256, 257, 700, 1000], 8, 2, 64, "f16")
    t = {name: vk.upload(a, "f16" if name.endswith("cache") else None) for name, a in case.items()}
    got = ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"], t["positions"],
                              8, 2, 0.125, window=chunk, chunked=True).numpy()
    want = reference.paged_attention(**case, num_heads=8, num_kv_heads=2, scale=0.125, window=chunk, chunked=True)
    assert nmse(got, want) <= ATTENTION_NMSE


def test_chunked_needs_a_width(ref: Backend, rng: np.random.Generator) -> None:
    case = _paged_case(rng, [4], 4, 2, 16, "f32")
    t = {name: ref.upload(a) for name, a in case.items()}
    with pytest.raises(VkrtError, match="chunked window"):
        ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"], t["positions"],
                            4, 2, 0.25, chunked=True)
