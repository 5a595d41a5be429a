"""shaders/matmul_tiled.comp, the GPUs' prefill matmul, run here on llvmpipe's storage-buffer
path by forcing the GPU's choices (as test_matmul_split.py forces split-K): `staged_device`
says yes and `config_for` answers as for a discrete GPU, so prefill runs the tiled kernel and
decode matmul_vec's split-K, both at the split a GPU runs for each K (32 lanes from K = 1024).

The kernel reduces every output in matmul_vec's split-K order, so besides the numpy
reference (NMSE bound 1e-11, the matmul family's in tests/backend/test_kernel_configs.py;
measured <= 1.6e-13 here) each case demands bit-identity with matmul_vec run one token at a
time: a token's row does not depend on T, on its place in the batch, or on which kernel ran.

Every format runs plain at K >= 1024 and K >= 4096 (odd N and T: partial row and token
tiles, and a partial last step of blocks). The epilogues are the same code for every format;
they run on f32 (no activation sums, a partial last block), q4_1 (a scalar activation sum)
and q6_k (two half-block sums): each format and epilogue is one more pipeline to JIT on
llvmpipe, seconds each.

Not verified here: the kernel's speed on a GPU (none was available), nor a GPU driver's
barrier and shared-memory behaviour beyond what llvmpipe shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tests.conftest import nmse
from tests.ops.test_matmul import FORMATS, K_QUANTS, is_block, make_weight
from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import matmul as native

NMSE_BOUND = 1e-11
EPS = 1e-5


def big_ks(fmt: str) -> tuple[int, int]:
    """A K >= 1024 and one >= 4096 for `fmt`: odd block counts where the format allows."""
    return (1024, 4352) if fmt in K_QUANTS else (1056, 4128) if is_block(fmt) else (1037, 4100)


def as_gpu(caps: Any) -> Any:
    return replace(caps, device_type="discrete")


class Shaders:
    """The (module family, spec constants) of every dispatch since the last clear()."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[int, int]]] = []

    def of(self, family: str) -> list[dict[int, int]]:
        return [spec for name, spec in self.seen if name.split(".")[0] == family]


@pytest.fixture
def gpu(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Backend, Shaders]]:
    """The Vulkan backend on the storage-buffer path making a discrete GPU's matmul choices,
    and the record of what it dispatched."""
    original = native.config_for
    monkeypatch.setattr(native, "config_for", lambda caps, *args, **kw: original(as_gpu(caps), *args, **kw))
    monkeypatch.setattr(native, "staged_device", lambda caps: True)
    shaders = Shaders()
    run_shader = vk_default.run_shader  # type: ignore[attr-defined]

    def spy(name: str, bindings: Any, groups: Any, push: Any, spec: dict[int, int]) -> Any:
        shaders.seen.append((name, dict(spec)))
        return run_shader(name, bindings, groups, push, spec)

    monkeypatch.setattr(vk_default, "run_shader", spy)
    previous = vk_default.caps.access_path  # type: ignore[attr-defined]
    vk_default.set_access_path("ssbo")  # type: ignore[attr-defined]
    try:
        yield vk_default, shaders
    finally:
        vk_default.set_access_path(previous)  # type: ignore[attr-defined]


def one_at_a_time(vk: Backend, x: np.ndarray, call: Any) -> np.ndarray:
    """`call(x_tensor, token_slice)` for each token alone (T = 1: matmul_vec), stacked."""
    return np.concatenate([call(vk.upload(x[i:i + 1]), slice(i, i + 1), False).numpy() for i in range(len(x))])


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.all(), f"{what}: {(~same).sum()} of {same.size} values differ from matmul_vec one token at a time"


@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference_and_vec(gpu: tuple[Backend, Shaders], rng: np.random.Generator, fmt: str) -> None:
    vk, shaders = gpu
    for (n, t), k in zip(((67, 21), (37, 5)), big_ks(fmt), strict=True):
        raw, dense = make_weight(rng, fmt, n, k)
        w = vk.upload_weight(raw, fmt, (n, k))
        x = rng.standard_normal((t, k)).astype(np.float32)
        shaders.seen.clear()
        got = native.dispatch_matmul(vk, vk.upload(x), w, tiled=True).numpy()
        (spec,) = shaders.of("matmul_tiled")
        assert (spec[8], spec[5]) == (32, 4), f"{fmt} K={k}: split {spec[8]}, lanes {spec[5]}"
        err = nmse(got, ops.OPS["matmul"].reference(x, dense))
        assert err <= NMSE_BOUND, f"{fmt} N={n} K={k} T={t}: NMSE {err:.3g}"
        solo = one_at_a_time(vk, x, _call(vk, w, {}))
        assert {s[8] for s in shaders.of("matmul_vec")} == {32}
        assert_same_bits(got, solo, f"{fmt} N={n} K={k} T={t}")


@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
def test_batch_invariance(gpu: tuple[Backend, Shaders], rng: np.random.Generator, fmt: str) -> None:
    """A token's row is the same bits at every T (one token tile, several, partial ones), at
    any place in the batch, through the op's own kernel choice too."""
    vk, shaders = gpu
    n, k = 67, 1024
    raw, _ = make_weight(rng, fmt, n, k)
    w = vk.upload_weight(raw, fmt, (n, k))
    x = rng.standard_normal((40, k)).astype(np.float32)
    solo = one_at_a_time(vk, x, _call(vk, w, {}))
    for t in (5, 16, 17, 40):
        shaders.seen.clear()
        assert_same_bits(native.dispatch_matmul(vk, vk.upload(x[:t]), w, tiled=True).numpy(), solo[:t], f"T={t}")
        assert shaders.of("matmul_tiled") and not shaders.of("matmul_vec")
    order = rng.permutation(40)
    assert_same_bits(native.dispatch_matmul(vk, vk.upload(x[order]), w, tiled=True).numpy(), solo[order], "shuffled")
    shaders.seen.clear()
    assert_same_bits(ops.matmul(vk.upload(x), w).numpy(), solo, "ops.matmul")
    assert shaders.of("matmul_tiled")


# Each epilogue as (weight rows per output row, the call through dispatch_matmul, the
# reference); `call(x, tokens, tiled)` gets the token slice for the per-token operands.
def _epilogues(rng: np.random.Generator, k: int, n: int, t: int) -> dict[str, tuple[int, Any, Any]]:
    g = (1.0 + 0.5 * rng.standard_normal(k)).astype(np.float32)
    r = (rng.standard_normal((t, n)) * 10.0).astype(np.float32)
    refs = ops.OPS
    return {
        "silu": (2, dict(gated=True), lambda x, d: refs["matmul_silu_and_mul"].reference(x, d)),
        "gelu": (2, dict(gated=True, activation="gelu_tanh"),
                 lambda x, d: refs["matmul_gelu_tanh_and_mul"].reference(x, d)),
        "scale": (1, dict(scale=0.22), lambda x, d: refs["matmul"].reference(x, d, 0.22)),
        "add": (1, dict(residual=r, scale=0.22), lambda x, d: refs["matmul_add"].reference(x, d, r, 0.22)),
        "bias": (1, dict(residual=r[0]), lambda x, d: refs["matmul_add"].reference(x, d, r[0])),
        "rms": (1, dict(norm=g), lambda x, d: refs["rms_norm_matmul"].reference(x, g, d, EPS)),
        "rms_gated": (2, dict(norm=g, gated=True), lambda x, d: refs["rms_norm_matmul"].reference(x, g, d, EPS, True)),
    }


def _call(vk: Backend, w: Any, params: dict[str, Any]) -> Any:
    def call(xt: Any, tokens: slice, tiled: bool) -> Any:
        kw = dict(params)
        if "residual" in kw:  # a residual [T, N] is per token, a bias [N] is not
            r = kw["residual"]
            kw["residual"] = vk.upload(np.ascontiguousarray(r[tokens] if r.ndim == 2 else r))
        if "norm" in kw:
            kw["norm"] = (vk.upload(kw["norm"]), EPS)
        return native.dispatch_matmul(vk, xt, w, tiled=tiled, **kw)
    return call


@pytest.mark.parametrize("epilogue", ["silu", "gelu", "scale", "add", "bias", "rms", "rms_gated"])
@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q6_k"])
def test_epilogues(gpu: tuple[Backend, Shaders], rng: np.random.Generator, fmt: str, epilogue: str) -> None:
    """Each fused prologue / epilogue matmul_vec has (but the qkv one): the reference, and
    bit-identity with matmul_vec one token at a time."""
    vk, shaders = gpu
    n, t = 37, 19
    for k in big_ks(fmt):
        gates, params, reference = _epilogues(rng, k, n, t)[epilogue]
        raw, dense = make_weight(rng, fmt, gates * n, k)
        w = vk.upload_weight(raw, fmt, (gates * n, k))
        x = (rng.standard_normal((t, k)) * 3.0).astype(np.float32)
        call = _call(vk, w, params)
        shaders.seen.clear()
        got = call(vk.upload(x), slice(0, t), True).numpy()
        assert got.shape == (t, n) and len(shaders.of("matmul_tiled")) == 1
        with np.errstate(over="ignore"):
            err = nmse(got, reference(x, dense))
        assert err <= NMSE_BOUND, f"{fmt} {epilogue} K={k}: NMSE {err:.3g}"
        assert_same_bits(got, one_at_a_time(vk, x, call), f"{fmt} {epilogue} K={k}")


def test_selection(vk_default: Backend) -> None:
    """Prefill takes the tiled kernel on GPUs on the storage-buffer path, at matmul_vec's
    split for the K; never on CPU devices (llvmpipe here), on the texel path, for decode
    sizes or for the fused qkv op."""
    caps = vk_default.caps  # type: ignore[attr-defined]
    discrete = replace(caps, device_type="discrete", access_path="ssbo")
    for device in (discrete, replace(discrete, device_type="integrated")):
        for k, split in ((32, 1), (96, 2), (576, 16), (1024, 32), (4100, 32)):
            cfg = native.dispatch_config(device, "q4_1", 1536, k, 64, tiled=True)
            vec = native.dispatch_config(device, "q4_1", 1536, k, 1, tiled=False)
            assert (cfg.shader, cfg.split, vec.shader, vec.split) == ("matmul_tiled", split, "matmul_vec", split)
            assert cfg.lanes == min(4, split) and cfg.workgroup == cfg.lanes * 32
        gated = native.dispatch_config(device, "q4_1", 3072, 576, 64, tiled=True, gated=True)
        assert (gated.rows, gated.lane_rows, gated.workgroup) == (4, 1, 128)
        assert native.dispatch_config(device, "q4_1", 256, 576, 64, tiled=True, qkv=True).shader == "matmul_vec"
        assert native.dispatch_config(device, "q4_1", 256, 576, 64, tiled=True, norm_and_add=True).shader == "matmul_vec"
    for device in (replace(discrete, access_path="texel"), replace(discrete, device_type="virtual"),
                   replace(caps, device_type="cpu")):
        assert native.dispatch_config(device, "q4_1", 1536, 1024, 64, tiled=True).shader == "matmul_vec"
    if caps.device_type == "cpu":
        assert native.dispatch_config(caps, "q4_1", 1536, 1024, 64, tiled=True).shader == "matmul_vec"
