"""matmul_vec.comp's split-K mode (SPLIT > 1, the configuration GPUs get), run here on
llvmpipe by forcing that configuration: the matmul parity, batch-invariance and
fused-versus-unfused tests of the other modules, collected again under it.

Split-K sums each output in a different order from the one-invocation-per-row kernel
(per-lane strided partial sums, then a fixed halving tree in shared memory), so it is held
to the same bounds against the numpy reference, and to bit-identity with itself across
token counts, kernels (vec / tiled) and fused-versus-unfused compositions.

It runs on the storage-buffer path, the one GPUs take. Parity with the reference and the
properties built on the shared reduction (batch invariance, gated and fused compositions equal to
unfused ones) run on SPLIT_FORMATS, one of each decode family (float, 32-value blocks with an
offset folded into the activation sums, 256-value super-blocks, a non-linear table, MXFP4's shared
exponents): every format's split-K decode is held to the reference at each lane count GPUs select
by tests/backend/test_kernel_configs.py. llvmpipe's JIT of these kernels on that path is the
suite's largest cost (a cold run spent 164 s compiling the parity cases of all sixteen formats
here, which that module's cases already run), which is why nothing here is multiplied by every
format.

Not verified here: how fast it is on a GPU (none was available), nor a GPU driver's
shared-memory and barrier behaviour beyond what llvmpipe shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPRESENTATIVE_FORMATS
from tests.ops.test_matmul import make_weight
from tests.ops.test_matmul import test_batch_invariance as _batch_invariance
from tests.ops.test_matmul import test_matmul_matches_reference as _matches_reference
from tests.ops.test_matmul_fused_norm import test_batch_invariance as test_fused_batch_invariance  # noqa: F401
from tests.ops.test_matmul_fused_norm import (  # noqa: F401
    test_matmul_add_equals_unfused,
    test_rms_norm_matmul_matches_unfused,
)
from tests.ops.test_matmul_gated import test_fused_equals_unfused as _gated_equals_unfused
from tests.ops.test_matmul_gated import test_selection_and_batch_invariance  # noqa: F401
from tests.ops.test_rms_norm_qkv_fused import case as qkv_case  # noqa: F401
from tests.ops.test_rms_norm_qkv_fused import (
    test_fused_equals_composed as _qkv_fused_equals_composed,
)
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.kernels import matmul as native

SPLIT_FORMATS = REPRESENTATIVE_FORMATS


@pytest.fixture(params=["f32", "q4_1", "q6_k"])
def case(request: pytest.FixtureRequest, vk: Backend) -> tuple[Backend, str]:
    """The fused-norm tests' (backend, weight format), on the storage-buffer path."""
    return vk, request.param


@pytest.fixture
def vk(vk_default: Backend) -> Iterator[Backend]:
    """The Vulkan backend on the storage-buffer path (this module's tests, imported ones too)."""
    backend = vk_default
    previous = backend.caps.access_path
    backend.set_access_path("ssbo")
    try:
        yield backend
    finally:
        backend.set_access_path(previous)


@pytest.fixture(autouse=True)
def split_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every matmul dispatch gets the CPU token tile, 4 rows and split-K over up to 8 lanes."""
    original = native.config_for

    def config(caps: Any, dtype: str, n: int, t: int, prefill: bool = False) -> native.MatmulConfig:
        return native.MatmulConfig(workgroup=8, rows=4, tokens=original(caps, dtype, n, t, prefill).tokens, split=8)

    monkeypatch.setattr(native, "config_for", config)


def test_qkv_fused_equals_composed(qkv_case: tuple, rng: Any) -> None:  # noqa: F811
    _qkv_fused_equals_composed(qkv_case, rng)


@pytest.mark.parametrize("name", ["matmul.vec", "matmul.tiled"])
@pytest.mark.parametrize("fmt", SPLIT_FORMATS)
def test_matmul_matches_reference(vk: Backend, rng: np.random.Generator, fmt: str, name: str) -> None:
    _matches_reference(vk, rng, fmt, name)


@pytest.mark.parametrize("fmt", SPLIT_FORMATS)
def test_batch_invariance(vk: Backend, rng: np.random.Generator, fmt: str) -> None:
    _batch_invariance(vk, rng, fmt)


@pytest.mark.parametrize("path", ["vec", "tiled"])
@pytest.mark.parametrize("fmt", SPLIT_FORMATS)
def test_fused_equals_unfused(vk: Backend, rng: np.random.Generator, fmt: str, path: str) -> None:
    _gated_equals_unfused(vk, rng, fmt, path)


def test_split_is_clamped_to_the_blocks(vk_default: Any, rng: Any) -> None:
    """K = 96 has 3 blocks: split-K uses 2 lanes (a power of two no larger than 3)."""
    raw, dense = make_weight(rng, "q4_1", 9, 96)
    w = vk_default.upload_weight(raw, "q4_1", (9, 96))
    x = rng.standard_normal((2, 96)).astype(np.float32)
    seen: list[dict[int, int]] = []
    run_shader = vk_default.run_shader

    def spy(name: str, bindings: Any, groups: Any, push: Any, spec: dict[int, int]) -> Any:
        seen.append(spec)
        return run_shader(name, bindings, groups, push, spec)

    vk_default.run_shader = spy
    try:
        got = native.dispatch_matmul(vk_default, vk_default.upload(x), w, tiled=False).numpy()
    finally:
        del vk_default.run_shader
    assert seen[-1][8] == 2 and seen[-1][0] == 2
    assert np.allclose(got, x @ dense.T, rtol=1e-5, atol=1e-5)
