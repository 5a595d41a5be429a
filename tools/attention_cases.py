"""Random paged-attention inputs: a decode step over sequences of given lengths, a prefill
step over (cached, new) positions, each sequence's K/V blocks shuffled over the cache.

Shared by tools/bench_attention.py and the attention tests (tests/ops), which load it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vkrt.backend.base import Backend
from vkrt.core import kv_format

BLOCK = 16  # tokens per cache block in decode_case, by default


def prefill_case(rng: np.random.Generator, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                 head_dim: int, kv_dtype: str, block_size: int = 16) -> dict[str, np.ndarray]:
    """Sequences given as (cached positions, new tokens): every position's K/V is in the cache
    (the model writes a chunk's K/V before attending), in shuffled blocks; the step's tokens are
    each sequence's new positions, sequence after sequence."""
    max_blocks = max(-(-(cached + new) // block_size) for cached, new in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    kv_dim = num_kv_heads * head_dim
    order = rng.permutation(num_blocks).astype(np.int32)
    positions = np.concatenate([np.arange(cached, cached + new) for cached, new in seqs]).astype(np.int32)
    return {
        "q": rng.standard_normal((positions.size, num_heads * head_dim)).astype(np.float32) * 2.0,
        "k_cache": kv_format.encode(rng.standard_normal((num_blocks, block_size, kv_dim)), kv_dtype),
        "v_cache": kv_format.encode(rng.standard_normal((num_blocks, block_size, kv_dim)), kv_dtype),
        "block_table": order[: len(seqs) * max_blocks].reshape(len(seqs), max_blocks),
        "seq_index": np.concatenate([np.full(new, s) for s, (_, new) in enumerate(seqs)]).astype(np.int32),
        "positions": positions,
    }


def decode_case(rng: np.random.Generator, lengths: list[int], num_heads: int, num_kv_heads: int,
                head_dim: int, kv_dtype: str, width: int | None = None,
                block_size: int = BLOCK) -> dict[str, np.ndarray]:
    """One decode token per sequence at its last position; each sequence's blocks shuffled over
    the cache; table rows `width` blocks wide (default: the longest sequence's), padded with 0."""
    counts = [-(-n // block_size) for n in lengths]
    width = width or max(counts)
    num_blocks = sum(counts) + 3
    order = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(lengths), width), np.int32)
    start = 0
    for s, count in enumerate(counts):
        table[s, :count] = order[start:start + count]
        start += count
    kv_dim = num_kv_heads * head_dim
    return {
        "q": rng.standard_normal((len(lengths), num_heads * head_dim)).astype(np.float32),
        "k_cache": kv_format.encode(rng.standard_normal((num_blocks, block_size, kv_dim)), kv_dtype),
        "v_cache": kv_format.encode(rng.standard_normal((num_blocks, block_size, kv_dim)), kv_dtype),
        "block_table": table,
        "seq_index": np.arange(len(lengths), dtype=np.int32),
        "positions": np.array(lengths, np.int32) - 1,
    }


def upload(vk: Backend, case: dict[str, np.ndarray], kv_dtype: str) -> dict[str, Any]:
    """The case's arrays as tensors; the caches in format `kv_dtype` (f32, f16, q8_0)."""
    cache = kv_format.tensor_dtype(kv_dtype)
    return {name: vk.upload(a, cache if name.endswith("cache") else None) for name, a in case.items()}
