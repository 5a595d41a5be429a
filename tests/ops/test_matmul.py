"""Native matmul (matmul.vec / matmul.tiled, one shader) vs the numpy reference, both access paths.

The reference dequantizes exactly and multiplies in float64; the kernels decode in f32 and
accumulate in f32, so every format lands far inside its bound. Measured NMSE on these
shapes, both paths and kernels (llvmpipe), median / worst: f32 7e-15 / 8e-14, f16 7e-15 /
5e-12, bf16 8e-15 / 6e-14, q8_0 7e-15 / 2e-14, q4_0 6e-14 / 3e-13, q4_1 6e-14 / 1e-12 (the
q4 offsets, -8 and m, are folded into a per-block activation sum), q4_k 2e-14 / 4e-14,
q6_k 4e-14 / 3e-13 (random blocks; -dmin*m and -32 folded the same way), q5_0 4e-14 /
1e-12, q5_1 9e-15 / 3e-14 (random blocks; -16 / m folded the same way), iq4_nl 8e-15 /
6e-14 (random blocks), q2_k 3e-14 / 4e-13 and q3_k 4e-14 / 2e-13 (random blocks; -dmin*m
and -4 folded into the activation sums). Bound: 1e-9 for all.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import REPRESENTATIVE_FORMATS, nmse, ssbo_sample
from tests.core.test_formats import random_blocks
from vkrt import ops
from vkrt.backend.base import Backend, Kernel
from vkrt.core.formats import FORMATS as REGISTRY
from vkrt.core.quant import dequantize, f32_to_bf16, quantize
from vkrt.core.tensor import Tensor, TensorSpec

FORMATS = tuple(REGISTRY)  # every registered format runs natively
K_QUANTS = tuple(f for f in FORMATS if REGISTRY[f].block_values == 256)  # 256-value super-blocks
# Random blocks (tests.core.test_formats.random_blocks): quantize() has no encoder for them.
RANDOM_BLOCK_FORMATS = ("q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q5_k", "iq4_xs", "mxfp4")
NMSE_BOUND = {fmt: 1e-9 for fmt in FORMATS}
# (T, N, K): every T in {1, 2, 5, 33, 130} and N in {1, 7, 64, 129} with each K.
BLOCK_SHAPES = [(1, 1, 32), (2, 7, 96), (5, 64, 576), (33, 129, 32), (130, 7, 96), (1, 129, 576),
                (130, 64, 32)]
# Float K: 37 (scalar x loads, partial block), 64 (whole texels and blocks), 100 (whole
# texels, partial last block).
FLOAT_SHAPES = [(1, 1, 37), (2, 7, 64), (5, 64, 100), (33, 129, 37), (130, 7, 100), (1, 129, 64),
                (130, 64, 37)]
# K-quants: whole 256-value super-blocks (1, 2, 3 and 17 per row).
K_SHAPES = [(1, 1, 256), (2, 7, 512), (5, 64, 768), (33, 129, 256), (130, 7, 512), (1, 129, 768),
            (130, 64, 256), (3, 67, 4352)]


def is_block(fmt: str) -> bool:
    return REGISTRY[fmt].is_block


def shapes_for(fmt: str) -> list[tuple[int, int, int]]:
    return K_SHAPES if fmt in K_QUANTS else BLOCK_SHAPES if is_block(fmt) else FLOAT_SHAPES


def block_k(fmt: str, k: int = 64) -> int:
    """A K that suits `fmt`: k for 32-value block formats, the next multiple of 256 for K-quants."""
    return -(-k // 256) * 256 if fmt in K_QUANTS else k


def random_k_quant(rng: np.random.Generator, fmt: str, n: int, k: int) -> np.ndarray:
    """Random q4_k (144-byte) or q6_k (210-byte) blocks: random quants and 6-bit / int8
    scales, with small positive f16 super-block scales d (and dmin)."""
    size = 144 if fmt == "q4_k" else 210
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if fmt == "q4_k":
        blocks[..., 0:4] = d.reshape(n, k // 256, 4)
    else:
        blocks[..., 208:210] = d[..., 0:2]
    return blocks.reshape(n, -1)


def make_weight(rng: np.random.Generator, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random weights in storage format `fmt` and their exact f32 dequantization."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "f32":
        raw = w
    elif fmt == "f16":
        raw = w.astype(np.float16)
    elif fmt == "bf16":
        raw = f32_to_bf16(w)
    elif fmt in RANDOM_BLOCK_FORMATS:
        raw = random_blocks(rng, fmt, n, k // REGISTRY[fmt].block_values)
    elif fmt in K_QUANTS:
        raw = random_k_quant(rng, fmt, n, k)
    else:
        raw = quantize(w, fmt)
    return raw, dequantize(raw, fmt)


def kernel(backend: Backend, name: str) -> Kernel:
    return next(k for k in backend.kernels("matmul") if k.name == name)


def run(backend: Backend, name: str, x: Tensor, w: Tensor) -> np.ndarray:
    """Force one kernel, whatever T the selection would pick it for."""
    out = (TensorSpec((x.shape[0], w.shape[0]), "f32"),)
    return kernel(backend, name).run(backend, (x, w), {}, out)[0].numpy()


@pytest.mark.parametrize("name", ["matmul.vec", "matmul.tiled"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_matches_reference(vk: Backend, rng: np.random.Generator, fmt: str, name: str) -> None:
    for t, n, k in shapes_for(fmt):
        raw, dense = make_weight(rng, fmt, n, k)
        x = rng.standard_normal((t, k)).astype(np.float32)
        expected = ops.OPS["matmul"].reference(x, dense)
        got = run(vk, name, vk.upload(x), vk.upload_weight(raw, fmt, (n, k)))
        assert got.shape == (t, n)
        err = nmse(got, expected)
        assert err <= NMSE_BOUND[fmt], f"{fmt} {name} T={t} N={n} K={k}: NMSE {err:.3g}"
        assert np.array_equal(got.argmax(axis=1), expected.argmax(axis=1)), f"{fmt} {name} T={t} N={n} K={k}"


# Which kernel a token count selects is the host's choice, the same on both paths; every format's
# vec and tiled kernels meet the reference on both paths in test_matmul_matches_reference.
@ssbo_sample(lambda fmt: fmt in REPRESENTATIVE_FORMATS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_selection_by_token_count(vk: Backend, rng: np.random.Generator, fmt: str) -> None:
    """Few tokens take the vec kernel, many the tiled one; the op result equals the reference."""
    k = block_k(fmt) if is_block(fmt) else 37
    raw, dense = make_weight(rng, fmt, 9, k)
    w = vk.upload_weight(raw, fmt, (9, k))
    for t, expected_kernel in ((1, "matmul.vec"), (130, "matmul.tiled")):
        x = rng.standard_normal((t, k)).astype(np.float32)
        before = vk.selections[("matmul", expected_kernel)]
        got = ops.matmul(vk.upload(x), w).numpy()
        assert vk.selections[("matmul", expected_kernel)] == before + 1
        assert nmse(got, ops.OPS["matmul"].reference(x, dense)) <= NMSE_BOUND[fmt]


@ssbo_sample(lambda fmt: fmt in REPRESENTATIVE_FORMATS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_invariance(vk: Backend, rng: np.random.Generator, fmt: str) -> None:
    """Row t of a T-token matmul is bit-identical to the 1-token result for that row, for
    T = 1, 3, 64, 130, through the op's own kernel choice and through each kernel forced."""
    n = 129
    for k in (768,) if fmt in K_QUANTS else (576,) if is_block(fmt) else (37, 100):
        raw, _ = make_weight(rng, fmt, n, k)
        w = vk.upload_weight(raw, fmt, (n, k))
        x = rng.standard_normal((130, k)).astype(np.float32)
        solo = np.concatenate([ops.matmul(vk.upload(x[i : i + 1]), w).numpy() for i in range(130)])
        for t in (1, 3, 64, 130):
            xt = vk.upload(x[:t])
            results = {"selected": ops.matmul(xt, w).numpy(), "vec": run(vk, "matmul.vec", xt, w),
                       "tiled": run(vk, "matmul.tiled", xt, w)}
            for how, got in results.items():
                same = got.view(np.uint32) == solo[:t].view(np.uint32)
                assert same.all(), f"{fmt} K={k} T={t} {how}: {(~same).sum()} values differ from T=1"


# (rows, token tile, workgroup) of one-invocation-per-row matmul_vec beside the baseline (the
# device's own choice here: 8 rows x 8 tokens): small tiles, and the widest a CPU device selects
# (config_for: block formats take 32 rows from 2560 rows up). That one runs on the texel path
# only, the one CPU devices take: 32 rows x 8 tokens of unrolled block dots cost ~20 s of JIT per
# format on llvmpipe's storage-buffer path, where no device selects it (GPUs take split-K:
# tests/ops/test_matmul_split.py, tests/backend/test_kernel_configs.py).
ACROSS_CONFIGS = ((1, 1, 8), (2, 2, 16), (8, 4, 8))
WIDEST_CPU_TILE = (32, 8, 8)


@ssbo_sample(lambda fmt: fmt in REPRESENTATIVE_FORMATS)
@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                                 "iq4_xs"])
def test_batch_invariance_across_configs(vk: Backend, rng: np.random.Generator, fmt: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every specialisation the device config may pick (rows, token tile, workgroup) gives
    bit-identical rows: the per-output reduction order never depends on them."""
    from vkrt.backend.vulkan.kernels import matmul as native

    n, k, t = 67, block_k(fmt, 96) if is_block(fmt) else 37, 11
    raw, _ = make_weight(rng, fmt, n, k)
    w = vk.upload_weight(raw, fmt, (n, k))
    x = vk.upload(rng.standard_normal((t, k)).astype(np.float32))
    baseline = native.dispatch_matmul(vk, x, w, tiled=False).numpy()
    configs = ACROSS_CONFIGS
    if is_block(fmt) and vk.caps.access_path == "texel":  # type: ignore[attr-defined]
        configs += (WIDEST_CPU_TILE,)
    for rows, tokens, workgroup in configs:
        cfg = native.MatmulConfig(workgroup=workgroup, rows=rows, tokens=tokens)
        monkeypatch.setattr(native, "config_for", lambda *args, cfg=cfg, **kw: cfg)
        got = native.dispatch_matmul(vk, x, w, tiled=False).numpy()
        monkeypatch.undo()
        same = got.view(np.uint32) == baseline.view(np.uint32)
        assert same.all(), f"{fmt} rows={rows} tokens={tokens} wg={workgroup}: {(~same).sum()} differ"


def test_oversized_weight_falls_back_to_reference(vk: Backend, rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight the device cannot bind whole (beyond its texel / storage range) has no native
    kernel: the reference tier runs it after exactly one drain."""
    n, k = 7, 512
    raw, dense = make_weight(rng, "q4_k", n, k)
    w = vk.upload_weight(raw, "q4_k", (n, k))
    x = rng.standard_normal((3, k)).astype(np.float32)
    xt = vk.upload(x)
    caps = vk.caps  # type: ignore[attr-defined]
    monkeypatch.setattr(caps, "max_texel_elements", w.handle.size // 4 - 1)
    monkeypatch.setattr(caps, "max_storage_range", w.handle.size - 1)
    drains = vk.counters.drains
    got = ops.matmul(xt, w).numpy()
    assert vk.counters.drains == drains + 1
    expected = ops.OPS["matmul"].reference(x, dense)
    assert np.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_format_without_kernel_runs_on_the_reference(vk_default: Backend, rng: np.random.Generator,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered format with no device layout (every format has one today: q2_k's is taken
    away here) is uploaded as its raw blocks, no kernel claims it, and the reference tier
    computes the matmul after exactly one drain."""
    from vkrt.backend.vulkan.kernels import layouts
    from vkrt.backend.vulkan.kernels import matmul as native

    fmt, n, k = "q2_k", 5, 512
    monkeypatch.delitem(layouts.LAYOUTS, fmt)
    monkeypatch.setattr(native, "FORMATS", tuple(layouts.LAYOUTS))
    raw = random_blocks(rng, fmt, n, k // 256)
    w = vk_default.upload_weight(raw, fmt, (n, k))
    x = rng.standard_normal((2, k)).astype(np.float32)
    drains = vk_default.counters.drains
    got = ops.matmul(vk_default.upload(x), w).numpy()
    assert vk_default.counters.drains == drains + 1
    assert np.array_equal(w.numpy(), raw)
    assert np.allclose(got, ops.OPS["matmul"].reference(x, dequantize(raw, fmt)), rtol=1e-6, atol=1e-6)
