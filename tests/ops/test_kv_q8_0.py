"""The q8_0 KV cache (vkrt/core/kv_format.py): its numpy spec against the gguf package, the
cache-writing kernels bit-exact against the spec, and paged attention over a q8_0 cache
against the reference reading the same cache.

Bit-exact here means the cache's words: kv_write and qkv_rope_kv_write quantize as the spec
does term for term (`precise`, integer f16 encoding of the scale). Attention bound: the NMSE
of tests/ops/test_attention.py (the reference decodes the same quants, so only the kernels'
f32 summation differs). Lengths cross block (16), pair and chunk (256) edges; GQA 1, 3, 4, 8;
head dims 64, 128, 256; windows and softcaps; both paged variants, the GQA kernel and the
split-over-the-context path. The GQA kernel's bit-equality with the paged kernel on q8_0 caches
is in tests/ops/test_gqa_attention.py.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_attention import paged_variant  # noqa: F401  (fixture: "sub" and "seq")
from tests.ops.test_gqa_attention import Modules, prefill_case
from tests.ops.test_paged_attention_split import decode_case, run, upload, want
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core import kv_format
from vkrt.core.quant import dequantize
from vkrt.core.tensor import KV_Q8_0
from vkrt.errors import VkrtError

reference = importlib.import_module("vkrt.ops.attention")  # the numpy specs

ATTENTION_NMSE = 5e-11  # tests/ops/test_attention.py's bound
LENGTHS = [1, 15, 16, 17, 31, 32, 33, 64, 65, 255, 256, 257, 1000]
GEOMETRIES = [  # (num_heads, num_kv_heads, head_dim): GQA 1, 3, 4, 8; head dims 64, 128, 256
    (4, 4, 64),
    (9, 3, 64),  # SmolLM2-135M
    (8, 2, 128),
    (8, 1, 256),
]
GEOMETRY_IDS = ["h{}kv{}d{}".format(*g) for g in GEOMETRIES]


def rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values whose 32-blocks span magnitudes 1e-6..1e4, with an all-zero block, a block of
    exact quantization ties (x * (1 / d) = k + 0.5) and f16-subnormal scales."""
    magnitude = 10.0 ** rng.uniform(-6, 4, (*shape[:-1], shape[-1] // 32, 1))
    x = (rng.standard_normal((*shape[:-1], shape[-1] // 32, 32)) * magnitude).reshape(shape)
    flat = x.reshape(-1, 32)
    flat[0] = 0.0
    flat[1] = np.arange(32) - 15.5  # with max |x| = 127: d = 1, every other value a tie
    flat[1, 0] = 127.0
    flat[2] *= 1e-3 / np.abs(flat[2]).max()  # d ~ 8e-6: an f16 subnormal
    return x.astype(np.float32)


def test_spec_matches_gguf(rng: np.random.Generator) -> None:
    """Scales equal gguf's Q8_0 quantizer bit for bit and quants agree (it divides by d where
    llama.cpp's C reference, the spec, multiplies by 1 / d: they may differ by one at a tie);
    the stored words decode as GGUF Q8_0 blocks do."""
    from gguf import GGMLQuantizationType, quants

    x = rows(rng, (500, 128))
    q, d = kv_format.quantize_q8_0(x)
    theirs = quants.quantize(x, GGMLQuantizationType.Q8_0).reshape(500, 4, 34)
    assert theirs[..., :2].tobytes() == d.tobytes()
    step = np.abs(theirs[..., 2:].view(np.int8).astype(int) - q.astype(int))
    assert step.max() <= 1 and (step > 0).mean() < 1e-3
    blocks = np.concatenate([d.reshape(500, 4, 1).view(np.uint8), q.view(np.uint8)], axis=-1)  # GGUF order
    gguf_values = dequantize(blocks.reshape(500, -1), "q8_0").reshape(500, 128)
    np.testing.assert_array_equal(kv_format.decode(kv_format.encode(x, "q8_0")), gguf_values)
    assert np.abs(gguf_values - x).max() <= np.abs(x).max() / 127  # half a step, with f16 d slack


def test_formats_refuse_heads_that_do_not_fit(ref: Backend) -> None:
    """Blocks of a head (head_dim % 32) in pairs along the row (kv_dim % 64), or a clear error."""
    assert kv_format.unsupported("q8_0", 2, 16) and kv_format.unsupported("q8_0", 1, 32)
    assert kv_format.unsupported("q8_0", 2, 32) is None and kv_format.unsupported("f16", 2, 16) is None
    with pytest.raises(ValueError, match="multiple of 64"):
        ref.empty((2, 16, 32), KV_Q8_0)
    cache = ref.empty((2, 16, 64), KV_Q8_0)  # 4 heads of 16: whole pairs, but blocks across heads
    q, ids = ref.upload(np.zeros((1, 4 * 16), np.float32)), ref.upload(np.zeros(1, np.int32))
    with pytest.raises(VkrtError, match="head_dim is 16"):
        ops.paged_attention(q, cache, cache, ref.upload(np.zeros((1, 2), np.int32)), ids, ids, 4, 4, 0.25)


@pytest.mark.parametrize("kv_dim", [64, 192, 256])
def test_kv_write_bit_exact(vk: Backend, rng: np.random.Generator, kv_dim: int) -> None:
    """Two writes: the second overwrites some slots (their scale halves must be replaced, not
    merged); slots -1 are padding; untouched slots keep their words."""
    blocks, block_size = 5, 4
    k_cache = kv_format.encode(rng.standard_normal((blocks, block_size, kv_dim)), "q8_0")
    v_cache = kv_format.encode(rng.standard_normal((blocks, block_size, kv_dim)), "q8_0")
    tk, tv = upload(vk, {"k_cache": k_cache, "v_cache": v_cache}, "q8_0").values()
    for slots in (np.array([3, 4, -1, 9, 8, 19, 0, -1], np.int32), np.array([4, 11, -1, 0], np.int32)):
        k, v = rows(rng, (slots.size, kv_dim)), rows(rng, (slots.size, kv_dim))
        before = vk.counters.snapshot()
        ops.kv_write(tk, tv, vk.upload(k), vk.upload(v), vk.upload(slots))
        assert vk.counters.since(before)["drains"] == 0
        reference.kv_write(k_cache, v_cache, k, v, slots)
        np.testing.assert_array_equal(tk.numpy(), k_cache)
        np.testing.assert_array_equal(tv.numpy(), v_cache)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("geometry", [(9, 3, 64), (4, 2, 32), (8, 2, 128)], ids=lambda g: "h{}kv{}d{}".format(*g))
def test_qkv_rope_kv_write_stores_what_kv_write_stores(vk: Backend, rng: np.random.Generator,
                                                       geometry: tuple[int, int, int], interleaved: bool,
                                                       norm: bool) -> None:
    """The fused attention prologue's q8_0 cache equals (word for word) kv_write of the k and v
    the same kernel stores into an f32 cache, and its q equals the f32 variant's."""
    num_heads, num_kv_heads, head_dim = geometry
    tokens, blocks, block_size = 7, 4, 4
    kv_dim = num_kv_heads * head_dim
    qkv = rows(rng, (tokens, (num_heads + 2 * num_kv_heads) * head_dim))
    slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int32)
    slots[2] = -1
    weights = [vk.upload((1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)) for _ in range(2)]
    positions, cos_sin, slot_t = (vk.upload(a) for a in (rng.integers(0, 50, tokens).astype(np.int32),
                                                         ops.rope_cos_sin(50, head_dim, 1e4), slots))
    stored: dict[str, Any] = {}
    for kv_dtype in ("f32", "q8_0"):
        zeros = kv_format.encode(np.zeros((blocks, block_size, kv_dim)), kv_dtype)
        k, v = upload(vk, {"k_cache": zeros, "v_cache": zeros}, kv_dtype).values()
        args = (positions, cos_sin, k, v, slot_t)
        before = vk.counters.snapshot()
        if norm:
            q = ops.qkv_norm_rope_kv_write(vk.upload(qkv), *weights, *args, 1e-6, num_heads, num_kv_heads,
                                           head_dim, interleaved)
        else:
            q = ops.qkv_rope_kv_write(vk.upload(qkv), *args, num_heads, num_kv_heads, head_dim, interleaved)
        assert vk.counters.since(before)["drains"] == 0
        stored[kv_dtype] = (q.numpy(), k.numpy(), v.numpy())
    q32, k32, v32 = stored["f32"]
    np.testing.assert_array_equal(stored["q8_0"][0], q32)
    kept = slots >= 0
    want_k = kv_format.encode(np.zeros((blocks, block_size, kv_dim)), "q8_0")
    want_v = want_k.copy()
    reference.kv_write(want_k, want_v, k32.reshape(-1, kv_dim)[slots[kept]], v32.reshape(-1, kv_dim)[slots[kept]],
                       slots[kept])
    np.testing.assert_array_equal(stored["q8_0"][1], want_k)
    np.testing.assert_array_equal(stored["q8_0"][2], want_v)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_paged_attention_matches_reference(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                           geometry: tuple[int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim = geometry
    case = decode_case(rng, LENGTHS, num_heads, num_kv_heads, head_dim, "q8_0")
    case["q"] *= 2.0
    before = vk.counters.snapshot()
    got = run(vk, case, "q8_0", num_heads, num_kv_heads, head_dim ** -0.5)
    assert vk.counters.since(before)["drains"] == 0
    expected = want(case, num_heads, num_kv_heads, head_dim ** -0.5)
    for s, n in enumerate(LENGTHS):
        assert nmse(got[s], expected[s]) <= ATTENTION_NMSE, f"length {n}"


@pytest.mark.parametrize(("window", "softcap"), [(7, 0.0), (40, 0.0), (0, 50.0), (5, 2.5)], ids=lambda v: str(v))
@pytest.mark.parametrize("geometry", [(8, 2, 128), (8, 1, 256), (4, 4, 64)], ids=["h8kv2d128", "h8kv1d256", "h4kv4d64"])
def test_paged_attention_windows_and_softcaps(vk: Backend, rng: np.random.Generator, paged_variant: str,  # noqa: F811
                                              geometry: tuple[int, int, int], window: int, softcap: float) -> None:
    """Decode rows and a prefill chunk (rows of one sequence whose windows start apart)."""
    num_heads, num_kv_heads, head_dim = geometry
    case = prefill_case(rng, [(0, 23), (20, 45), (60, 1), (3, 2)], num_heads, num_kv_heads, head_dim, "q8_0")
    case["q"] *= 2.0  # peaked scores: the cap matters
    args = (num_heads, num_kv_heads, head_dim ** -0.5, window, softcap)
    assert nmse(run(vk, case, "q8_0", *args), want(case, *args)) <= ATTENTION_NMSE


def test_gqa_kernel_matches_reference(vk: Backend, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt, a continued prefill and decodes through the GQA kernel (SmolLM2's shape)."""
    from vkrt.backend.vulkan.kernels import attention as kernels

    if kernels.gqa_lanes(vk.caps) is None:  # type: ignore[attr-defined]
        pytest.skip(f"{vk.caps.name}: no subgroup split, every step keeps the paged kernel")  # type: ignore[attr-defined]
    case = prefill_case(rng, [(0, 300), (40, 33), (77, 1)], 9, 3, 64, "q8_0")
    modules = Modules(vk, monkeypatch)
    got = run(vk, case, "q8_0", 9, 3, 0.125)
    assert modules.families() == {"paged_attention_gqa"}
    assert nmse(got, want(case, 9, 3, 0.125)) <= ATTENTION_NMSE


def test_split_over_the_context_matches_reference(vk: Backend, rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Flash-decoding (what GPUs run for tables wider than PAGED_CHUNK): chunk partials and merge."""
    from vkrt.backend.vulkan.kernels import attention as kernels

    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: kernels.PAGED_CHUNK)
    lengths = [1, 255, 256, 257, 700, 2049]
    case = decode_case(rng, lengths, 8, 2, 128, "q8_0")
    case["q"] *= 3.0
    modules = Modules(vk, monkeypatch)
    got = run(vk, case, "q8_0", 8, 2, 128 ** -0.5, 300)
    kernel = "paged_attention_gqa" if kernels.gqa_lanes(vk.caps) else "paged_attention"  # type: ignore[attr-defined]
    assert modules.families() == {kernel, "paged_attention_merge"}
    expected = want(case, 8, 2, 128 ** -0.5, 300)
    for s, n in enumerate(lengths):
        assert nmse(got[s], expected[s]) <= ATTENTION_NMSE, f"length {n}"


def test_quantized_attention_is_close_to_f32(rng: np.random.Generator) -> None:
    """What the format costs, on the reference: attention over q8_0 K/V vs the same K/V in f32."""
    case = decode_case(rng, [64, 500], 9, 3, 64, "f32")
    exact = want(case, 9, 3, 0.125)
    quantized = dict(case, k_cache=kv_format.encode(case["k_cache"], "q8_0"),
                     v_cache=kv_format.encode(case["v_cache"], "q8_0"))
    assert nmse(want(quantized, 9, 3, 0.125), exact) <= 1e-3
