"""paged_attention's GQA kernel (shaders/paged_attention_gqa.comp) vs the numpy reference.

Every step of a model whose KV head's query heads fit a tile (two or more: 3 heads x 64 for
SmolLM2) runs the GQA kernel where the device has the subgroup split; the `gqa` fixture checks
it was dispatched. Bound: the attention NMSE of tests/ops/test_attention.py. Models whose heads
share nothing in a tile (GQA ratio 1, head_dim 256) keep the paged kernel (test_selection).
Every row of the GQA kernel equals the paged kernel's bit for bit (both fold and merge with
include/attention.glsl's functions), so which kernel a row runs never changes it
(test_gqa_rows_equal_paged_rows), and a row's chunks merge to the same bits whether each chunk
is a workgroup (decode-shaped steps) or one workgroup walks them all
(test_chunks_split_or_walked_give_the_same_bits). Caches in f32, f16 and q8_0
(vkrt/core/kv_format.py; the reference reads the same quantized cache).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.conftest import nmse, ssbo_sample
from tests.ops.test_paged_attention_split import run, upload, want
from tests.tools.conftest import load_tool
from vkrt import ops
from vkrt.backend.base import Backend

reference = importlib.import_module("vkrt.ops.attention")  # the numpy specs
prefill_case = load_tool("attention_cases").prefill_case  # random inputs (tools/attention_cases.py)

ATTENTION_NMSE = 5e-11  # tests/ops/test_attention.py's bound
GEOMETRIES = [  # (num_heads, num_kv_heads, head_dim): GQA ratios 3, 4, 8 (4 and 8 heads per tile)
    (9, 3, 64),  # SmolLM2-135M
    (8, 2, 128),
    (8, 1, 64),
    (16, 2, 32),
]
GEOMETRY_IDS = ["h{}kv{}d{}".format(*g) for g in GEOMETRIES]


class Modules:
    """Module names of the shaders the backend runs."""

    def __init__(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[str] = []
        original = backend.run_shader  # type: ignore[attr-defined]

        def spy(name: str, *args: Any) -> Any:
            self.seen.append(name)
            return original(name, *args)

        monkeypatch.setattr(backend, "run_shader", spy)

    def families(self) -> set[str]:
        return {name.split(".")[0] for name in self.seen}


@pytest.fixture
def kernels(vk: Backend) -> Any:
    from vkrt.backend.vulkan.kernels import attention

    if attention.gqa_lanes(vk.caps) is None:  # type: ignore[attr-defined]
        pytest.skip(f"{vk.caps.name}: no subgroup split, every step keeps the paged kernel")  # type: ignore[attr-defined]
    return attention


@pytest.fixture
def gqa(vk: Backend, kernels: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Modules]:
    """The test's paged_attention calls run the GQA kernel; afterwards, they did."""
    modules = Modules(vk, monkeypatch)
    yield modules
    assert modules.families() == {"paged_attention_gqa"}


def run_kernel(vk: Backend, kernels: Any, monkeypatch: pytest.MonkeyPatch, kernel: str,
               case: dict[str, np.ndarray], kv_dtype: str, *args: Any) -> np.ndarray:
    """paged_attention with `kernel` ("paged_attention" or "paged_attention_gqa") forced; checks it ran."""
    with monkeypatch.context() as patch:
        if kernel == "paged_attention":
            patch.setattr(kernels, "gqa_heads", lambda group, head_dim: 1)
        modules = Modules(vk, patch)
        got = run(vk, case, kv_dtype, *args)
    assert modules.families() == {kernel}
    return got


# Prompts and continued prefills across block (16) edges, and decode rows (one new token) at
# block edges, in one step.
BIT_SEQS = [(0, 1), (0, 17), (5, 40), (16, 16), (30, 3), (0, 70), (100, 33), (15, 1), (16, 1), (47, 1), (200, 1)]


@ssbo_sample(lambda geometry, kv_dtype, block_size: geometry == GEOMETRIES[0] or kv_dtype == "f16")
@pytest.mark.parametrize("block_size", [4, 8, 16], ids=lambda b: f"block{b}")  # 4, 8: fewer tokens than lanes
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_gqa_rows_equal_paged_rows(vk: Backend, rng: np.random.Generator, kernels: Any,
                                     monkeypatch: pytest.MonkeyPatch, kv_dtype: str,
                                     geometry: tuple[int, int, int], block_size: int) -> None:
    """The same rows through the paged kernel and the GQA kernel: byte-equal outputs."""
    num_heads, num_kv_heads, head_dim = geometry
    case = prefill_case(rng, BIT_SEQS, num_heads, num_kv_heads, head_dim, kv_dtype, block_size)
    args = (num_heads, num_kv_heads, head_dim ** -0.5)
    paged = run_kernel(vk, kernels, monkeypatch, "paged_attention", case, kv_dtype, *args)
    gqa = run_kernel(vk, kernels, monkeypatch, "paged_attention_gqa", case, kv_dtype, *args)
    np.testing.assert_array_equal(gqa.view(np.uint32), paged.view(np.uint32))
    assert nmse(gqa, want(case, *args)) <= ATTENTION_NMSE


@ssbo_sample(lambda geometry, kv_dtype, window, softcap: kv_dtype == "f16")
@pytest.mark.parametrize(("window", "softcap"), [(7, 0.0), (40, 0.0), (0, 50.0), (5, 2.5)], ids=lambda v: str(v))
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("geometry", [(8, 2, 128), (8, 1, 64)], ids=["h8kv2d128", "h8kv1d64"])
def test_gqa_rows_equal_paged_rows_windows_softcaps(vk: Backend, rng: np.random.Generator, kernels: Any,
                                                      monkeypatch: pytest.MonkeyPatch, kv_dtype: str,
                                                      geometry: tuple[int, int, int], window: int,
                                                      softcap: float) -> None:
    """Byte-equal with sliding windows (rows of a tile start at different positions) and caps."""
    num_heads, num_kv_heads, head_dim = geometry
    case = prefill_case(rng, BIT_SEQS, num_heads, num_kv_heads, head_dim, kv_dtype)
    case["q"] *= 2.0  # peaked scores: the cap matters
    args = (num_heads, num_kv_heads, head_dim ** -0.5, window, softcap)
    paged = run_kernel(vk, kernels, monkeypatch, "paged_attention", case, kv_dtype, *args)
    gqa = run_kernel(vk, kernels, monkeypatch, "paged_attention_gqa", case, kv_dtype, *args)
    np.testing.assert_array_equal(gqa.view(np.uint32), paged.view(np.uint32))
    assert nmse(gqa, want(case, *args)) <= ATTENTION_NMSE


@ssbo_sample(lambda geometry, kv_dtype: kv_dtype == "f16")
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_mixed_prefills_in_one_step(vk: Backend, rng: np.random.Generator, gqa: Modules, kv_dtype: str,
                                    geometry: tuple[int, int, int]) -> None:
    """Fresh prompts of several lengths and prefills continuing cached prefixes (block edges
    inside and between tiles), one step."""
    num_heads, num_kv_heads, head_dim = geometry
    seqs = [(0, 1), (0, 17), (5, 40), (16, 16), (30, 3), (0, 70)]
    case = prefill_case(rng, seqs, num_heads, num_kv_heads, head_dim, kv_dtype)
    scale = head_dim ** -0.5
    before = vk.counters.snapshot()
    got = run(vk, case, kv_dtype, num_heads, num_kv_heads, scale)
    assert vk.counters.since(before)["drains"] == 0
    assert nmse(got, want(case, num_heads, num_kv_heads, scale)) <= ATTENTION_NMSE


def test_prompt_lengths(vk: Backend, rng: np.random.Generator, gqa: Modules) -> None:
    """One prompt per step, lengths on both sides of tile and block edges."""
    for length in (1, 2, 5, 15, 16, 17, 31, 33, 64, 129, 500):
        case = prefill_case(rng, [(0, length)], 9, 3, 64, "f16")
        err = nmse(run(vk, case, "f16", 9, 3, 0.125), want(case, 9, 3, 0.125))
        assert err <= ATTENTION_NMSE, f"length {length}: NMSE {err:.3g}"


def test_prompt_of_4096_tokens(vk: Backend, rng: np.random.Generator, gqa: Modules) -> None:
    """The longest prompt the CLI's default context takes, with a peaked softmax so the running
    maximum keeps moving."""
    case = prefill_case(rng, [(0, 4096)], 2, 1, 64, "f16")
    case["q"] *= 3.0
    assert nmse(run(vk, case, "f16", 2, 1, 0.125), want(case, 2, 1, 0.125)) <= ATTENTION_NMSE


@pytest.mark.parametrize(("window", "softcap"), [(7, 0.0), (16, 0.0), (40, 0.0), (0, 50.0), (5, 2.5)],
                         ids=lambda v: str(v))
@ssbo_sample(lambda geometry, kv_dtype, window, softcap: kv_dtype == "f16")
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("geometry", [(8, 2, 128), (8, 1, 64)], ids=["h8kv2d128", "h8kv1d64"])
def test_windows_and_softcaps(vk: Backend, rng: np.random.Generator, gqa: Modules, kv_dtype: str,
                              geometry: tuple[int, int, int], window: int, softcap: float) -> None:
    """Sliding windows (rows of one tile start their windows at different positions) and logit
    caps, as Mistral and Gemma 2/3 use them."""
    num_heads, num_kv_heads, head_dim = geometry
    case = prefill_case(rng, [(0, 23), (20, 45), (3, 2)], num_heads, num_kv_heads, head_dim, kv_dtype)
    case["q"] *= 2.0  # peaked scores: the cap matters
    scale = head_dim ** -0.5
    got = run(vk, case, kv_dtype, num_heads, num_kv_heads, scale, window, softcap)
    assert nmse(got, want(case, num_heads, num_kv_heads, scale, window, softcap)) <= ATTENTION_NMSE


def test_window_never_reads_blocks_left_behind(vk: Backend, rng: np.random.Generator, gqa: Modules) -> None:
    """A sliding group may free blocks that left the window: their table entries are garbage."""
    case = prefill_case(rng, [(60, 10)], 4, 2, 64, "f16")
    expected = want(case, 4, 2, 0.125, window=20)  # positions 60..69 see 41..69: blocks 2..4
    case["block_table"][0, :2] = 2**30  # out of any cache
    assert nmse(run(vk, case, "f16", 4, 2, 0.125, window=20), expected) <= ATTENTION_NMSE


def test_interleaved_sequences_and_padding(vk: Backend, rng: np.random.Generator, gqa: Modules) -> None:
    """Tiles need not align to sequences: tokens of two sequences alternate, with padding rows
    (seq_index -1, zero output) among them."""
    case = prefill_case(rng, [(10, 12), (0, 12)], 9, 3, 64, "f32")
    order = np.stack([np.arange(12), np.arange(12, 24)], axis=1).reshape(-1)
    for name in ("q", "seq_index", "positions"):
        case[name] = case[name][order]
    case["seq_index"][[3, 10, 11]] = -1
    got = run(vk, case, "f32", 9, 3, 0.125)
    assert not got[[3, 10, 11]].any()
    assert nmse(got, want(case, 9, 3, 0.125)) <= ATTENTION_NMSE


def test_recorded_prefill_replays_with_new_positions(vk: Backend, rng: np.random.Generator,
                                                     gqa: Modules) -> None:
    """positions, seq_index and the block table are read from buffers: a recorded step replays
    for another prefill of the same shape."""
    first = prefill_case(rng, [(0, 20), (4, 12)], 9, 3, 64, "f16")
    second = dict(first, positions=np.concatenate([np.arange(10, 30), np.arange(0, 12)]).astype(np.int32),
                  seq_index=np.concatenate([np.full(20, 1), np.zeros(12)]).astype(np.int32))
    second["block_table"] = first["block_table"][::-1].copy()
    t = upload(vk, first, "f16")
    with vk.capture() as graph:  # type: ignore[attr-defined]
        out = ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["seq_index"],
                                  t["positions"], 9, 3, 0.125)
    for case in (first, second):
        for name in ("positions", "seq_index", "block_table"):
            vk.write(t[name], case[name])  # type: ignore[attr-defined]
        graph.replay()
        assert nmse(out.numpy(), want(case, 9, 3, 0.125)) <= ATTENTION_NMSE


def test_selection(vk: Backend, rng: np.random.Generator, kernels: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA steps, prefill- and decode-shaped, take the GQA kernel; heads that share nothing in a
    tile (GQA ratio 1, head_dim 256: Gemma-3-270M) the paged one; all match the reference."""
    modules = Modules(vk, monkeypatch)
    for seqs, geometry in (([(0, 40), (3, 30)], (4, 2, 64)), ([(0, 1), (9, 1), (40, 1)], (4, 2, 64)),
                           ([(0, 40)], (4, 4, 64)), ([(0, 40)], (4, 1, 256))):
        case = prefill_case(rng, seqs, *geometry, "f32")
        got = run(vk, case, "f32", geometry[0], geometry[1], 0.125)
        assert nmse(got, want(case, geometry[0], geometry[1], 0.125)) <= ATTENTION_NMSE
    assert [name.split(".")[0] for name in modules.seen] == ["paged_attention_gqa"] * 2 + ["paged_attention"] * 2


# Rows across chunk edges (chunks of CHUNK positions, forced here: CPU devices do not chunk):
# long prompts continued, decode rows deep in the context, a padding row.
CHUNK = 32
CHUNK_SEQS = [(0, 1), (31, 1), (32, 1), (100, 1), (0, 70), (60, 40), (250, 3), (300, 1)]


@ssbo_sample(lambda kernel, kv_dtype, window, softcap: kv_dtype == "f16")
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (0, 20.0)], ids=lambda v: str(v))
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("kernel", ["paged_attention_gqa", "paged_attention", "seq"])
def test_chunks_split_or_walked_give_the_same_bits(vk: Backend, rng: np.random.Generator, kernels: Any,
                                                   monkeypatch: pytest.MonkeyPatch, kernel: str, kv_dtype: str,
                                                   window: int, softcap: float) -> None:
    """With chunks, a step that gives each chunk a workgroup (and merges the partials in a
    second pass) and one that walks a row's chunks in one workgroup (merging in registers) give
    byte-equal rows: same chunk order, same weights. Per kernel (GQA, paged subgroup split,
    paged one invocation per row)."""
    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: CHUNK)
    if kernel != "paged_attention_gqa":
        monkeypatch.setattr(kernels, "gqa_heads", lambda group, head_dim: 1)
    if kernel == "seq":
        monkeypatch.setattr(kernels, "paged_split", lambda caps: ("seq", kernels.ATTENTION_WORKGROUP))
    case = prefill_case(rng, CHUNK_SEQS, 8, 2, 64, kv_dtype)
    case["q"] *= 2.0  # peaked: chunks' maxima differ, so the merge rescales
    case["seq_index"][5] = -1
    args = (8, 2, 0.125, window, softcap)
    got = {}
    for split, tokens in (("split", 1 << 30), ("walked", 0)):
        monkeypatch.setattr(kernels, "SPLIT_TOKENS", tokens)
        modules = Modules(vk, monkeypatch)
        got[split] = run(vk, case, kv_dtype, *args)
        merged = modules.families() == {kernel.replace("seq", "paged_attention"), "paged_attention_merge"}
        assert merged == (split == "split"), modules.seen
    np.testing.assert_array_equal(got["split"].view(np.uint32), got["walked"].view(np.uint32))
    assert not got["walked"][5].any()
    assert nmse(got["walked"], want(case, *args)) <= ATTENTION_NMSE


def run_tiles(vk: Backend, kernels: Any, monkeypatch: pytest.MonkeyPatch, tokens: int,
              case: dict[str, np.ndarray], kv_dtype: str, *args: Any) -> np.ndarray:
    """paged_attention with the GQA kernel and `tokens` tokens per tile forced; checks they ran."""
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "gqa_tokens", lambda heads, head_dim, window: tokens)
        specs: list[dict[int, int]] = []
        original = vk.run_shader  # type: ignore[attr-defined]

        def spy(name: str, *rest: Any) -> Any:
            specs.append(rest[-1] if name.startswith("paged_attention_gqa") else {})
            return original(name, *rest)

        patch.setattr(vk, "run_shader", spy)
        got = run(vk, case, kv_dtype, *args)
    assert [spec.get(5) for spec in specs] == [tokens], specs
    return got


# Tiles of two tokens meet every pairing: neighbours of one prompt (same walk), a prompt's last
# token beside the next sequence's first, decode rows beside decode rows, a padding row, and an
# odd count (the last tile's second token is past the step).
PAIR_SEQS = [(0, 17), (5, 40), (16, 1), (0, 2), (30, 3), (47, 1), (100, 33), (200, 1), (0, 1)]


@pytest.mark.parametrize(("geometry", "kv_dtype"), [(g, "f16") for g in GEOMETRIES] + [(GEOMETRIES[0], "f32"),
                                                                                     (GEOMETRIES[0], "q8_0")],
                         ids=[f"{g}-f16" for g in GEOMETRY_IDS] + [f"{GEOMETRY_IDS[0]}-f32", f"{GEOMETRY_IDS[0]}-q8_0"])
@ssbo_sample(lambda geometry, kv_dtype: geometry == GEOMETRIES[0] and kv_dtype == "f16")
def test_two_token_tiles_equal_one_token_tiles(vk: Backend, rng: np.random.Generator, kernels: Any,
                                               monkeypatch: pytest.MonkeyPatch, kv_dtype: str,
                                               geometry: tuple[int, int, int]) -> None:
    """A prefill step in tiles of 2 tokens and of 1: byte-equal rows (each row folds its own
    positions on the same lanes in the same order; a partner's extra positions leave it as it
    was)."""
    num_heads, num_kv_heads, head_dim = geometry
    case = prefill_case(rng, PAIR_SEQS, num_heads, num_kv_heads, head_dim, kv_dtype)
    case["seq_index"][20] = -1
    assert case["positions"].size % 2 == 1
    args = (num_heads, num_kv_heads, head_dim ** -0.5)
    one = run_tiles(vk, kernels, monkeypatch, 1, case, kv_dtype, *args)
    two = run_tiles(vk, kernels, monkeypatch, 2, case, kv_dtype, *args)
    np.testing.assert_array_equal(two.view(np.uint32), one.view(np.uint32))
    assert not two[20].any()
    assert nmse(two, want(case, *args)) <= ATTENTION_NMSE


@pytest.mark.parametrize(("window", "softcap", "chunk"), [(7, 0.0, 0), (40, 0.0, 0), (0, 50.0, 0), (0, 0.0, CHUNK),
                                                          (40, 0.0, CHUNK)], ids=lambda v: str(v))
@ssbo_sample(lambda window, softcap, chunk: (window, softcap, chunk) == (40, 0.0, CHUNK))
def test_two_token_tiles_windows_softcaps_chunks(vk: Backend, rng: np.random.Generator, kernels: Any,
                                                 monkeypatch: pytest.MonkeyPatch, window: int, softcap: float,
                                                 chunk: int) -> None:
    """Byte-equal too where neighbours' windows start apart (they walk one after the other),
    with a cap, and where a prefill walks chunks of CHUNK positions in one workgroup (a token
    whose partner ends in the next chunk)."""
    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: chunk)
    case = prefill_case(rng, PAIR_SEQS + [(0, 70), (60, 40)], 9, 3, 64, "f16")
    case["q"] *= 2.0  # peaked scores: the cap matters and chunks' maxima differ
    args = (9, 3, 0.125, window, softcap)
    one = run_tiles(vk, kernels, monkeypatch, 1, case, "f16", *args)
    two = run_tiles(vk, kernels, monkeypatch, 2, case, "f16", *args)
    np.testing.assert_array_equal(two.view(np.uint32), one.view(np.uint32))
    assert nmse(two, want(case, *args)) <= ATTENTION_NMSE


def test_gqa_policy() -> None:
    """The GQA kernel runs where the paged kernel's subgroup split does, with its lanes, and
    takes as many heads of a GQA group as fit GQA_ROW_FLOATS (head_dim a multiple of 8)."""
    from types import SimpleNamespace

    from vkrt.backend.vulkan.kernels.attention import gqa_heads, gqa_lanes, gqa_tokens

    def caps(device_type: str, vendor: int, size: int, subgroup_ops: list[str]) -> Any:
        return SimpleNamespace(device_type=device_type, vendor_id=vendor, subgroup_size=size,
                               subgroup_ops=subgroup_ops)

    arith = ["basic", "arithmetic"]
    assert gqa_lanes(caps("cpu", 0x10005, 8, arith)) == 8  # llvmpipe
    assert gqa_lanes(caps("discrete", 0x10DE, 32, arith)) == 32  # NVIDIA
    assert gqa_lanes(caps("discrete", 0x1002, 64, arith)) is None  # AMD: the paged kernel's seq split
    assert gqa_lanes(caps("cpu", 0x10005, 8, ["basic"])) is None
    assert [gqa_heads(g, d) for g, d in ((3, 64), (4, 64), (8, 64), (4, 128), (6, 64), (4, 256), (1, 64), (4, 36))] \
        == [3, 4, 4, 2, 3, 1, 1, 1]
    assert [gqa_tokens(h, d, w) for h, d, w in ((3, 64, 0), (2, 64, 0), (3, 64, 4096), (4, 64, 0), (2, 128, 0))] \
        == [2, 2, 1, 1, 1]
