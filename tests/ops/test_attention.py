"""Native kv_write and paged_attention vs their numpy references, both access paths.

kv_write is a copy (bit-exact, f16 rounded like numpy). Attention kernels meet NMSE <= 5e-11
against the float64-softmax references (measured <= 4.8e-12, the 3000-position peaked
context on the sequential variant; ~1e-14 elsewhere) and must be batch invariant: a
token's output is bit-identical whatever else is in the batch. paged_attention's tests run
both its variants: "sub" (the context split over a subgroup's lanes, what devices with
subgroup arithmetic run) and "seq" (one invocation per token and head, the fallback).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tests.conftest import nmse, ssbo_sample
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.errors import VkrtError

reference = importlib.import_module("vkrt.ops.attention")  # the numpy specs

ATTENTION_NMSE = 5e-11  # 10x the worst measured (4.8e-12)
NP_KV = {"f32": np.float32, "f16": np.float16}


@pytest.fixture(params=["sub", "seq"])
def paged_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, vk: Backend) -> str:
    from vkrt.backend.vulkan.kernels import attention as kernels

    if request.param == "seq":
        monkeypatch.setattr(kernels, "paged_split", lambda caps: ("seq", kernels.ATTENTION_WORKGROUP))
    elif kernels.paged_split(vk.caps)[0] != "sub":
        pytest.skip(f"{vk.caps.name}: no subgroup arithmetic, paged_attention runs its sequential variant")
    return request.param


def _native(vk: Backend, op: str, before: dict[str, int], count: int) -> None:
    """`op` ran on its native kernel, with no drain to the reference tier."""
    assert vk.selections[(op, op)] >= count
    assert vk.counters.since(before)["drains"] == 0


def _kv_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Magnitudes from f16 subnormals to past f16 overflow, plus exact f16 rounding ties."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 5.5, shape)
    flat = x.reshape(-1)
    ties = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(2**-24) * 1.5, 2**-25, 65520.0, 65519.0, 0.0, -0.0])
    flat[: ties.size] = ties[: flat.size]
    return x.astype(np.float32)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("kv_dim", [7, 64])
def test_kv_write_bit_exact(vk: Backend, rng: np.random.Generator, kv_dtype: str, kv_dim: int) -> None:
    blocks, block_size = 5, 4
    k_cache = rng.standard_normal((blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype])
    v_cache = rng.standard_normal((blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype])
    # Adjacent slots (3, 4 and 8, 9) share a u32 word of an odd-width f16 row; -1 is padding.
    slots = np.array([3, 4, -1, 9, 8, 19, 0, -1], np.int32)
    k = _kv_values(rng, (slots.size, kv_dim))
    v = _kv_values(rng, (slots.size, kv_dim))
    tk, tv = vk.upload(k_cache, kv_dtype), vk.upload(v_cache, kv_dtype)
    before = vk.counters.snapshot()
    ops.kv_write(tk, tv, vk.upload(k), vk.upload(v), vk.upload(slots))
    with np.errstate(over="ignore"):  # numpy warns on the values that round to f16 inf
        reference.kv_write(k_cache, v_cache, k, v, slots)
    assert tk.numpy().tobytes() == k_cache.tobytes()
    assert tv.numpy().tobytes() == v_cache.tobytes()
    _native(vk, "kv_write", before, 1)


def _paged_case(rng: np.random.Generator, lengths: list[int], num_heads: int, num_kv_heads: int,
                head_dim: int, kv_dtype: str, block_size: int = 16) -> dict[str, np.ndarray]:
    """A cache holding sequences of `lengths` in shuffled (non-contiguous) blocks, one decode
    token per sequence at its last position."""
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * max_blocks + 3
    kv_dim = num_kv_heads * head_dim
    order = rng.permutation(num_blocks).astype(np.int32)
    return {
        "q": rng.standard_normal((len(lengths), num_heads * head_dim)).astype(np.float32),
        "k_cache": rng.standard_normal((num_blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype]),
        "v_cache": rng.standard_normal((num_blocks, block_size, kv_dim)).astype(NP_KV[kv_dtype]),
        "block_table": order[: len(lengths) * max_blocks].reshape(len(lengths), max_blocks),
        "seq_index": np.arange(len(lengths), dtype=np.int32),
        "positions": np.array(lengths, np.int32) - 1,
    }


def _run_paged(vk: Backend, case: dict[str, np.ndarray], kv_dtype: str, num_heads: int,
               num_kv_heads: int, scale: float) -> np.ndarray:
    tensors = {name: vk.upload(a, kv_dtype if name.endswith("cache") else None) for name, a in case.items()}
    return ops.paged_attention(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["block_table"],
                               tensors["seq_index"], tensors["positions"], num_heads, num_kv_heads,
                               scale).numpy()


GEOMETRIES = [  # (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3, 4
    (4, 4, 16),
    (9, 3, 64),  # SmolLM2-135M
    (8, 2, 80),
    (4, 1, 128),
]


# Blocks smaller than a subgroup (llvmpipe has 8 lanes or more, NVIDIA 32): a lane's
# positions then cross block edges inside one pass over the context.
BLOCK_SIZES = [4, 8, 16]


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"block{b}")
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}kv{}d{}".format(*g))
def test_paged_attention_decode(vk: Backend, rng: np.random.Generator, kv_dtype: str,
                                geometry: tuple[int, int, int], block_size: int, paged_variant: str) -> None:
    num_heads, num_kv_heads, head_dim = geometry
    case = _paged_case(rng, [1, 5, 17, 40], num_heads, num_kv_heads, head_dim, kv_dtype, block_size)
    scale = head_dim ** -0.5
    before = vk.counters.snapshot()
    got = _run_paged(vk, case, kv_dtype, num_heads, num_kv_heads, scale)
    want = reference.paged_attention(**case, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale)
    assert nmse(got, want) <= ATTENTION_NMSE
    _native(vk, "paged_attention", before, 1)


def test_paged_attention_long_context(vk: Backend, rng: np.random.Generator, paged_variant: str) -> None:
    """Thousands of positions, with a peaked softmax so the running maximum keeps moving."""
    case = _paged_case(rng, [3000, 1200], 9, 3, 64, "f16")
    case["q"] *= 6.0
    got = _run_paged(vk, case, "f16", 9, 3, 0.125)
    want = reference.paged_attention(**case, num_heads=9, num_kv_heads=3, scale=0.125)
    assert nmse(got, want) <= ATTENTION_NMSE


def test_paged_attention_long_context_wide_heads(vk: Backend, rng: np.random.Generator, paged_variant: str) -> None:
    """head_dim 256 (Gemma) deep into the context, unsplit as CPU devices run it. llvmpipe ends
    every loop of an invocation once it has run 65535 loop iterations in all; with the loops over
    head_dim rolled, lanes walking ~470 positions (the subgroup split: ~3800 of context) crossed
    that and returned garbage. The sequential variant walks every position in one invocation."""
    length = 4096 if paged_variant == "sub" else 1500
    case = _paged_case(rng, [length, 700], 4, 1, 256, "f16")
    got = _run_paged(vk, case, "f16", 4, 1, 0.0625)
    want = reference.paged_attention(**case, num_heads=4, num_kv_heads=1, scale=0.0625)
    assert nmse(got, want) <= ATTENTION_NMSE


def test_paged_attention_widest_heads(vk: Backend, rng: np.random.Generator) -> None:
    """head_dim 576 (MLA's cached row, one KV head under all query heads; the kernel cap): decode
    rows and a prefill-shaped step across blocks, against the reference. One pipeline only: one this
    wide takes llvmpipe about a minute to compile, so Gemma 4's 512 (the same code at a smaller
    specialisation) is not compiled separately here."""
    case = _paged_case(rng, [1, 19, 40], 4, 1, 576, "f16")
    before = vk.counters.snapshot()
    got = _run_paged(vk, case, "f16", 4, 1, 576 ** -0.5)
    want = reference.paged_attention(**case, num_heads=4, num_kv_heads=1, scale=576 ** -0.5)
    assert nmse(got, want) <= ATTENTION_NMSE
    _native(vk, "paged_attention", before, 1)


@pytest.mark.parametrize("head_dim", [12, 64])
def test_paged_attention_f16_texel_width(vk: Backend, rng: np.random.Generator, paged_variant: str,
                                         monkeypatch: pytest.MonkeyPatch, head_dim: int) -> None:
    """The paged kernel reads an f16 cache 8 halves per texel where head_dim is a multiple of 8
    (KV=f16x8), else 4 (KV=f16); both read the same values, so where both apply a row gets the
    same bits from either."""
    from vkrt.backend.vulkan.kernels import attention as kernels

    monkeypatch.setattr(kernels, "gqa_heads", lambda group, head_dim: 1)  # the paged kernel alone
    seen: list[str] = []
    run_shader = vk.run_shader  # type: ignore[attr-defined]
    monkeypatch.setattr(vk, "run_shader", lambda name, *args: seen.append(name) or run_shader(name, *args))
    case = _paged_case(rng, [1, 17, 40], 4, 2, head_dim, "f16")
    got = _run_paged(vk, case, "f16", 4, 2, head_dim ** -0.5)
    assert seen == [f"paged_attention.{'f16x8' if head_dim % 8 == 0 else 'f16'}.{paged_variant}.{vk.caps.access_path}"]  # type: ignore[attr-defined]
    want = reference.paged_attention(**case, num_heads=4, num_kv_heads=2, scale=head_dim ** -0.5)
    assert nmse(got, want) <= ATTENTION_NMSE
    if head_dim % 8 == 0:
        monkeypatch.setattr(kernels, "paged_kv_variant", lambda kv_dtype, head_dim: ("f16", "u32x2"))
        narrow = _run_paged(vk, case, "f16", 4, 2, head_dim ** -0.5)
        assert seen[-1] == f"paged_attention.f16.{paged_variant}.{vk.caps.access_path}"  # type: ignore[attr-defined]
        np.testing.assert_array_equal(narrow.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_chunked_prefill_through_kv_write(vk: Backend, rng: np.random.Generator, kv_dtype: str) -> None:
    """The model's order: kv_write the chunk, then paged_attention over prefix + chunk."""
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    prefix, chunk = 21, 9
    case = _paged_case(rng, [prefix + chunk], num_heads, num_kv_heads, head_dim, kv_dtype, block_size)
    positions = np.arange(prefix, prefix + chunk, dtype=np.int32)
    blocks = case["block_table"][0]
    slots = (blocks[positions // block_size] * block_size + positions % block_size).astype(np.int32)
    k = rng.standard_normal((chunk, num_kv_heads * head_dim)).astype(np.float32)
    v = rng.standard_normal((chunk, num_kv_heads * head_dim)).astype(np.float32)
    q = rng.standard_normal((chunk, num_heads * head_dim)).astype(np.float32)
    seq_index = np.zeros(chunk, np.int32)

    tk, tv = vk.upload(case["k_cache"], kv_dtype), vk.upload(case["v_cache"], kv_dtype)
    before = vk.counters.snapshot()
    ops.kv_write(tk, tv, vk.upload(k), vk.upload(v), vk.upload(slots))
    got = ops.paged_attention(vk.upload(q), tk, tv, vk.upload(case["block_table"]), vk.upload(seq_index),
                              vk.upload(positions), num_heads, num_kv_heads, 0.125).numpy()
    _native(vk, "paged_attention", before, 1)

    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    reference.kv_write(k_cache, v_cache, k, v, slots)
    want = reference.paged_attention(q, k_cache, v_cache, case["block_table"], seq_index, positions,
                                     num_heads, num_kv_heads, 0.125)
    assert nmse(got, want) <= ATTENTION_NMSE


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_paged_attention_batch_invariant(vk: Backend, rng: np.random.Generator, kv_dtype: str,
                                        paged_variant: str) -> None:
    """A sequence's rows are bit-identical alone and batched with others of other lengths."""
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    lengths = [37, 3, 70, 18]
    case = _paged_case(rng, lengths, num_heads, num_kv_heads, head_dim, kv_dtype)
    # Sequence 0: a chunk of its last 5 positions, plus one decode token of every other sequence.
    chunk = np.arange(lengths[0] - 5, lengths[0], dtype=np.int32)
    q0 = rng.standard_normal((chunk.size, num_heads * head_dim)).astype(np.float32)
    alone = dict(case, q=q0, seq_index=np.zeros(chunk.size, np.int32), positions=chunk)
    batched = dict(case, q=np.concatenate([case["q"][1:3], q0, case["q"][3:], case["q"][1:2]]),
                   seq_index=np.array([1, 2, 0, 0, 0, 0, 0, 3, -1], np.int32),
                   positions=np.concatenate([[2, 69], chunk, [17, 0]]).astype(np.int32))
    solo = _run_paged(vk, alone, kv_dtype, num_heads, num_kv_heads, 0.125)
    mixed = _run_paged(vk, batched, kv_dtype, num_heads, num_kv_heads, 0.125)
    assert mixed[2:7].tobytes() == solo.tobytes()
    one = _run_paged(vk, dict(alone, q=q0[-1:], seq_index=alone["seq_index"][-1:], positions=chunk[-1:]),
                     kv_dtype, num_heads, num_kv_heads, 0.125)
    assert one.tobytes() == solo[-1:].tobytes()


def test_paged_attention_padding_rows(vk: Backend, rng: np.random.Generator, paged_variant: str) -> None:
    case = _paged_case(rng, [20, 9, 33], 4, 2, 16, "f32")
    case["seq_index"] = np.array([0, -1, 2], np.int32)
    got = _run_paged(vk, case, "f32", 4, 2, 0.25)
    want = reference.paged_attention(**case, num_heads=4, num_kv_heads=2, scale=0.25)
    assert not got[1].any()
    assert nmse(got, want) <= ATTENTION_NMSE


def test_bad_inputs_name_the_op(vk: Backend, rng: np.random.Generator) -> None:
    case = _paged_case(rng, [4], 4, 2, 16, "f32")
    t = {name: vk.upload(a) for name, a in case.items()}
    with pytest.raises(VkrtError, match="paged_attention"):
        ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], vk.upload(case["block_table"].astype(np.float32)),
                            t["seq_index"], t["positions"], 4, 2, 0.25)
    with pytest.raises(VkrtError, match="paged_attention"):  # kv_dim does not match the heads
        ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"],
                            t["positions"], 4, 1, 0.25)
    with pytest.raises(VkrtError, match="kv_write"):
        ops.kv_write(t["k_cache"], t["v_cache"], vk.upload(np.zeros((2, 31), np.float32)),
                     vk.upload(np.zeros((2, 31), np.float32)), vk.upload(np.zeros(2, np.int32)))


def test_paged_split_policy() -> None:
    """The subgroup-split variant only where a workgroup of subgroup_size lanes is one subgroup."""
    from types import SimpleNamespace

    from vkrt.backend.vulkan.kernels.attention import paged_split

    def caps(device_type: str, vendor: int, size: int, ops_: list[str]) -> SimpleNamespace:
        return SimpleNamespace(device_type=device_type, vendor_id=vendor, subgroup_size=size, subgroup_ops=ops_)

    arith = ["basic", "arithmetic"]
    assert paged_split(caps("cpu", 0x10005, 8, arith)) == ("sub", 8)  # llvmpipe
    assert paged_split(caps("discrete", 0x10DE, 32, arith)) == ("sub", 32)  # NVIDIA
    assert paged_split(caps("discrete", 0x1002, 64, arith)) == ("seq", 8)  # AMD: wave32 or 64
    assert paged_split(caps("integrated", 0x8086, 32, arith)) == ("seq", 8)  # Intel: 8-32 per shader
    assert paged_split(caps("cpu", 0x10005, 8, ["basic"])) == ("seq", 8)  # no subgroup arithmetic


def _direct_attention(case: dict[str, np.ndarray], num_heads: int, num_kv_heads: int, scale: float,
                      window: int, softcap: float, chunk: int = 0) -> np.ndarray:
    """Sliding-window / softcapped attention written out in float64, independently of the spec:
    token t at position p sees cached positions j with p - window < j <= p (all j <= p if 0);
    with `chunk` (Llama 4's chunked layers), those of its chunk, p - p % chunk <= j <= p."""
    q, block_table = case["q"], case["block_table"]
    block_size, kv_dim = case["k_cache"].shape[1:]
    keys = case["k_cache"].reshape(-1, kv_dim).astype(np.float64)
    values = case["v_cache"].reshape(-1, kv_dim).astype(np.float64)
    hd = q.shape[1] // num_heads
    out = np.zeros(q.shape, np.float64)
    for t, (seq, p) in enumerate(zip(case["seq_index"], case["positions"], strict=True)):
        if seq < 0:
            continue
        js = (list(range(p - p % chunk, p + 1)) if chunk else
              [j for j in range(p + 1) if window == 0 or j > p - window])
        slots = [block_table[seq][j // block_size] * block_size + j % block_size for j in js]
        for h in range(num_heads):
            kvh = h // (num_heads // num_kv_heads)
            qh = q[t, h * hd:(h + 1) * hd].astype(np.float64)
            s = keys[slots, kvh * hd:(kvh + 1) * hd] @ qh * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = (w / w.sum()) @ values[slots, kvh * hd:(kvh + 1) * hd]
    return out


WINDOW_CASES = [  # (window, softcap)
    (0, 0.0), (1, 0.0), (5, 0.0), (16, 0.0), (33, 0.0), (4096, 0.0), (0, 50.0), (0, 2.0), (7, 3.0),
]


@pytest.mark.parametrize(("window", "softcap"), WINDOW_CASES, ids=lambda v: str(v))
def test_paged_attention_reference_window_and_softcap(rng: np.random.Generator, window: int,
                                                      softcap: float) -> None:
    """The spec against the test's own float64 arithmetic (decode + a prefill chunk + padding)."""
    case = _paged_case(rng, [1, 5, 17, 40], 4, 2, 16, "f32")
    case["q"] = np.concatenate([case["q"], case["q"][:3]]) * 3.0
    case["seq_index"] = np.array([0, 1, 2, 3, 3, -1, 3], np.int32)
    case["positions"] = np.array([0, 4, 16, 39, 20, 3, 1], np.int32)
    want = _direct_attention(case, 4, 2, 0.25, window, softcap)
    got = reference.paged_attention(**case, num_heads=4, num_kv_heads=2, scale=0.25, window=window,
                                    softcap=softcap)
    assert nmse(got, want) <= 1e-12


def test_paged_attention_refuses_bad_window_and_softcap(ref: Backend, rng: np.random.Generator) -> None:
    case = _paged_case(rng, [4], 4, 2, 16, "f32")
    t = {name: ref.upload(a) for name, a in case.items()}
    args = (t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"], t["positions"], 4, 2, 0.25)
    with pytest.raises(VkrtError, match="paged_attention: window"):
        ops.paged_attention(*args, window=-1)
    with pytest.raises(VkrtError, match="paged_attention: softcap"):
        ops.paged_attention(*args, softcap=-1.0)


FAMILY_GEOMETRIES = [  # (num_heads, num_kv_heads, head_dim): head dims 64, 128, 256; GQA 1, 4, 8
    (4, 4, 64),
    (8, 2, 128),
    (8, 1, 256),
    (4, 1, 256),  # Gemma-3-270M
]


# The window and cap are the same arithmetic on both access paths; the storage-buffer path's
# loads of every cache format and head size are held to the reference by the decode tests above.
@ssbo_sample(lambda geometry, kv_dtype, window, softcap, **_: kv_dtype == "f16")
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (7, 0.0), (16, 0.0), (0, 50.0), (5, 2.5)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("geometry", FAMILY_GEOMETRIES, ids=lambda g: "h{}kv{}d{}".format(*g))
def test_paged_attention_window_softcap_native(vk: Backend, rng: np.random.Generator, kv_dtype: str,
                                               geometry: tuple[int, int, int], window: int, softcap: float,
                                               paged_variant: str) -> None:
    """Decode tokens, a prefill chunk crossing the window and block edges, and a padding row."""
    num_heads, num_kv_heads, head_dim = geometry
    case = _paged_case(rng, [1, 6, 23, 41], num_heads, num_kv_heads, head_dim, kv_dtype)
    chunk = np.arange(14, 41, 3, dtype=np.int32)  # sequence 3's positions 14..38: a prefill chunk
    case["q"] = np.concatenate([case["q"], rng.standard_normal((chunk.size + 1, case["q"].shape[1]))]
                               ).astype(np.float32) * 4.0  # peaked scores: the cap matters
    case["seq_index"] = np.concatenate([case["seq_index"], np.full(chunk.size, 3), [-1]]).astype(np.int32)
    case["positions"] = np.concatenate([case["positions"], chunk, [5]]).astype(np.int32)
    scale = head_dim ** -0.5
    tensors = {name: vk.upload(a, kv_dtype if name.endswith("cache") else None) for name, a in case.items()}
    before = vk.counters.snapshot()
    got = ops.paged_attention(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["block_table"],
                              tensors["seq_index"], tensors["positions"], num_heads, num_kv_heads, scale,
                              window=window, softcap=softcap).numpy()
    _native(vk, "paged_attention", before, 1)
    want = reference.paged_attention(**case, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
                                     window=window, softcap=softcap)
    assert not got[-1].any()
    assert nmse(got, want) <= ATTENTION_NMSE


def test_paged_attention_window_never_reads_blocks_left_behind(vk: Backend, rng: np.random.Generator,
                                                              paged_variant: str) -> None:
    """A sliding group may free blocks that left the window: their table entries are garbage."""
    case = _paged_case(rng, [70], 4, 2, 64, "f16")
    window = 20  # position 69 sees 50..69: blocks 3 and 4 of 16 positions
    want = reference.paged_attention(**case, num_heads=4, num_kv_heads=2, scale=0.125, window=window)
    case["block_table"][0, :3] = 2**30  # out of any cache
    got = _run_paged_window(vk, case, "f16", 4, 2, 0.125, window)
    assert nmse(got, want) <= ATTENTION_NMSE


def _run_paged_window(vk: Backend, case: dict[str, np.ndarray], kv_dtype: str, num_heads: int,
                      num_kv_heads: int, scale: float, window: int) -> np.ndarray:
    tensors = {name: vk.upload(a, kv_dtype if name.endswith("cache") else None) for name, a in case.items()}
    return ops.paged_attention(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["block_table"],
                               tensors["seq_index"], tensors["positions"], num_heads, num_kv_heads,
                               scale, window=window).numpy()


@pytest.mark.parametrize("window", [0, 9])
def test_paged_attention_window_batch_invariant(vk: Backend, rng: np.random.Generator, window: int,
                                               paged_variant: str) -> None:
    lengths = [37, 3, 70]
    case = _paged_case(rng, lengths, 8, 2, 128, "f16")
    chunk = np.arange(30, 37, dtype=np.int32)
    q0 = rng.standard_normal((chunk.size, case["q"].shape[1])).astype(np.float32)
    alone = dict(case, q=q0, seq_index=np.zeros(chunk.size, np.int32), positions=chunk)
    batched = dict(case, q=np.concatenate([case["q"][1:], q0]),
                   seq_index=np.concatenate([[1, 2], np.zeros(chunk.size)]).astype(np.int32),
                   positions=np.concatenate([[2, 69], chunk]).astype(np.int32))
    solo = _run_paged_window(vk, alone, "f16", 8, 2, 0.1, window)
    mixed = _run_paged_window(vk, batched, "f16", 8, 2, 0.1, window)
    assert mixed[2:].tobytes() == solo.tobytes()
