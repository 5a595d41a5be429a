"""paged_attention_sinks (gpt-oss's attention sinks) vs its numpy reference and vs transformers' rule.

The reference is checked against the softmax over [scores, sink] with the sink's column dropped
(transformers' eager gpt-oss attention), written out here. The kernels (the paged kernel in both
variants, the GQA tile kernel, decode and prefill-shaped steps, chunks split with the merge pass
or walked) are held to tests/ops/test_attention.py's attention NMSE; chunks split and walked give
the same bits with sinks as without. A -inf sink is no sink: the op then equals paged_attention.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_attention import paged_variant  # noqa: F401  (fixture: "sub" and "seq")
from tests.tools.conftest import load_tool
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import attention as kernels

_cases = load_tool("attention_cases")
decode_case, prefill_case, upload = _cases.decode_case, _cases.prefill_case, _cases.upload
reference = importlib.import_module("vkrt.ops.attention")

ATTENTION_NMSE = 5e-11  # tests/ops/test_attention.py's bound
GEOMETRIES = [(4, 4, 16), (9, 3, 64), (8, 2, 128), (6, 1, 256)]  # the paged kernel; GQA tiles of 3, 4 and 1


def sinks_for(rng: np.random.Generator, num_heads: int) -> np.ndarray:
    """Logits of the scores' size, so a sink takes a real share of some rows and little of others."""
    return (3.0 * rng.standard_normal(num_heads)).astype(np.float32)


def run(vk: Backend, case: dict[str, np.ndarray], sinks: np.ndarray, kv_dtype: str, heads: int, kv_heads: int,
        scale: float, window: int = 0) -> np.ndarray:
    t = upload(vk, case, kv_dtype)
    return ops.paged_attention_sinks(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"],
                                     t["positions"], vk.upload(sinks), heads, kv_heads, scale,
                                     window=window).numpy()


def want(case: dict[str, np.ndarray], sinks: np.ndarray, heads: int, kv_heads: int, scale: float,
         window: int = 0) -> np.ndarray:
    return reference.paged_attention_sinks(**case, sinks=sinks, num_heads=heads, num_kv_heads=kv_heads,
                                           scale=scale, window=window)


def test_reference_is_transformers_rule(rng: np.random.Generator) -> None:
    """One prompt, contiguous: softmax over the scores and the sink, the sink's weight dropped."""
    heads, kv_heads, hd, n = 4, 2, 8, 11
    case = prefill_case(rng, [(0, n)], heads, kv_heads, hd, "f32", block_size=4)
    sinks = sinks_for(rng, heads)
    got = want(case, sinks, heads, kv_heads, 0.5)
    slots = case["block_table"][0][np.arange(n) // 4] * 4 + np.arange(n) % 4
    keys, values = case["k_cache"].reshape(-1, kv_heads * hd)[slots], case["v_cache"].reshape(-1, kv_heads * hd)[slots]
    for h in range(heads):
        g = h // (heads // kv_heads)
        q = case["q"][:, h * hd:(h + 1) * hd].astype(np.float64)
        scores = q @ keys[:, g * hd:(g + 1) * hd].T.astype(np.float64) * 0.5
        scores[np.triu_indices(n, 1)] = -np.inf
        logits = np.concatenate([scores, np.full((n, 1), float(sinks[h]))], axis=1)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        expected = p[:, :-1] @ values[:, g * hd:(g + 1) * hd].astype(np.float64)
        np.testing.assert_allclose(got[:, h * hd:(h + 1) * hd], expected, rtol=1e-5, atol=1e-6)


def test_no_sink_is_paged_attention(rng: np.random.Generator) -> None:
    case = decode_case(rng, [1, 17, 40], 9, 3, 16, "f32")
    plain = reference.paged_attention(**case, num_heads=9, num_kv_heads=3, scale=0.25)
    np.testing.assert_array_equal(want(case, np.full(9, -np.inf, np.float32), 9, 3, 0.25), plain)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}kv{}d{}".format(*g))
def test_decode_matches_reference(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                  kv_dtype: str, geometry: tuple[int, int, int]) -> None:
    heads, kv_heads, hd = geometry
    lengths = [1, 7, 16, 33, 70]
    case = decode_case(rng, lengths, heads, kv_heads, hd, kv_dtype)
    case["q"] *= 3.0
    sinks = sinks_for(rng, heads)
    got, expected = run(vk, case, sinks, kv_dtype, *geometry[:2], hd ** -0.5), want(case, sinks, heads, kv_heads,
                                                                                    hd ** -0.5)
    for s, n in enumerate(lengths):
        assert nmse(got[s], expected[s]) <= ATTENTION_NMSE, f"length {n}"


@pytest.mark.parametrize("window", [0, 5])
def test_prefill_matches_reference(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                   window: int) -> None:
    """Prompt-shaped steps (the GQA kernel's 2-token tiles where there is no window), windows too."""
    case = prefill_case(rng, [(0, 37), (5, 12)], 9, 3, 64, "f16")
    sinks = sinks_for(rng, 9)
    got, expected = run(vk, case, sinks, "f16", 9, 3, 0.125, window), want(case, sinks, 9, 3, 0.125, window)
    assert nmse(got, expected) <= ATTENTION_NMSE


@pytest.mark.parametrize("geometry", [(4, 4, 64), (8, 2, 64)], ids=["paged", "gqa"])
def test_split_chunks_equal_walked_chunks(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                          monkeypatch: pytest.MonkeyPatch, geometry: tuple[int, int, int]) -> None:
    """Chunks split (each a workgroup; the merge pass adds the sink) and walked (the kernel adds
    it): the same bits, both within the bound."""
    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: kernels.PAGED_CHUNK)
    heads, kv_heads, hd = geometry
    lengths = [1, 255, 257, 700]
    case = decode_case(rng, lengths, heads, kv_heads, hd, "f16")
    sinks = sinks_for(rng, heads)
    split = run(vk, case, sinks, "f16", heads, kv_heads, hd ** -0.5)
    monkeypatch.setattr(kernels, "SPLIT_TOKENS", 0)  # never split: walk
    walked = run(vk, case, sinks, "f16", heads, kv_heads, hd ** -0.5)
    np.testing.assert_array_equal(walked.view(np.uint32), split.view(np.uint32))
    assert nmse(walked, want(case, sinks, heads, kv_heads, hd ** -0.5)) <= ATTENTION_NMSE
