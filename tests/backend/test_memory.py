"""Device memory: limits, accounting per purpose, bit-exact transfers, the staging path."""

from __future__ import annotations

import base64
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.errors import OutOfDeviceMemory, VkrtError

REPO = Path(__file__).resolve().parents[2]


def _cases() -> dict[str, tuple[np.ndarray, str]]:
    """Host arrays (in storage representation) and their vkrt dtype; odd sizes on purpose."""
    rng = np.random.default_rng(7)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4028235e38, 1.0], np.float32)
    nan_payloads = np.array([0x7FC00001, 0xFFC12345, 0x7F800001], np.uint32).view(np.float32)
    return {
        "f32_1": (np.array([1.5], np.float32), "f32"),
        "f32_specials": (np.concatenate([specials, nan_payloads]), "f32"),
        "f32_odd_2d": (rng.standard_normal((3, 37)).astype(np.float32), "f32"),
        "f32_3d": (rng.standard_normal((3, 5, 7)).astype(np.float32), "f32"),
        "f16_every_pattern": (np.arange(1 << 16, dtype=np.uint16).view(np.float16), "f16"),
        "f16_odd": (rng.standard_normal(7).astype(np.float16), "f16"),
        "bf16_bits": (rng.integers(0, 1 << 16, size=1025, dtype=np.uint16), "bf16"),
        "bf16_3": (np.array([0x3F80, 0x7FC1, 0x8001], np.uint16), "bf16"),
        "i32_extremes": (np.array([0, -1, 2**31 - 1, -(2**31), 12345], np.int32), "i32"),
        "i32_odd": (rng.integers(-(2**31), 2**31 - 1, size=4099, dtype=np.int32), "i32"),
        "u32_odd": (rng.integers(0, 2**32, size=(11, 3), dtype=np.uint32), "u32"),
    }


def _op_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return (rng.standard_normal((5, 131)).astype(np.float32),
            rng.standard_normal((5, 131)).astype(np.float32),
            rng.standard_normal(131).astype(np.float32))


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def exercise(backend: Any) -> dict[str, Any]:
    """Round trips and a few ops; run in this process (direct path) and in a child (staging)."""
    out: dict[str, Any] = {"unified": backend.memory.unified}
    for name, (array, dtype) in _cases().items():
        t = backend.upload(array, dtype)
        back = t.numpy()
        out[name] = {"bytes": _b64(back), "shape": list(back.shape), "dtype": str(back.dtype)}
    a, b, w = _op_inputs()
    x, y, row = backend.upload(a), backend.upload(b), backend.upload(w)
    out["host_visible"] = x.handle.host_visible
    s = ops.add(x, y)
    out["add"] = _b64(s.numpy())
    out["add_row"] = _b64(ops.add(s, row).numpy())  # a row broadcast over an op's result
    backend.write(x, b)  # overwrite a tensor a finished op read
    out["after_write"] = _b64(ops.add(x, y).numpy())
    backend.sync()
    gc.collect()
    out["staging_bytes_after"] = backend.memory_stats()["staging_bytes"]
    return out


def _check_round_trips(result: dict[str, Any]) -> None:
    for name, (array, _) in _cases().items():
        got = result[name]
        assert base64.b64decode(got["bytes"]) == array.tobytes(), name
        assert tuple(got["shape"]) == array.shape and got["dtype"] == str(array.dtype), name


def test_round_trips_are_bit_exact(vk_default: Backend) -> None:
    _check_round_trips(exercise(vk_default))


def test_staging_path_matches_the_direct_path(vk_default: Backend) -> None:
    direct = exercise(vk_default)
    code = ("import json; from vkrt.backend import get_backend; "
            "from tests.backend.test_memory import exercise; "
            "print(json.dumps(exercise(get_backend('vulkan'))))")
    env = {**os.environ, "VKRT_FORCE_STAGING": "1"}
    env.pop("VKRT_DISABLE_VULKAN", None)
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    staged = json.loads(child.stdout.strip().splitlines()[-1])
    assert staged["unified"] is False and staged["host_visible"] is False  # really staged
    _check_round_trips(staged)
    a, b, w = _op_inputs()
    assert base64.b64decode(staged["add"]) == (a + b).tobytes()  # IEEE f32 add is exact
    assert base64.b64decode(staged["add_row"]) == ((a + b) + w).tobytes()
    assert base64.b64decode(staged["after_write"]) == (b + b).tobytes()
    for key in ("add", "add_row", "after_write"):
        assert staged[key] == direct[key], key
    assert staged["staging_bytes_after"] == 0  # staging buffers are returned


def test_allocation_beyond_the_device_limit_raises(vk_default: Backend) -> None:
    limit = vk_default.caps.max_allocation
    nbytes = limit + (1 << 30)
    stats = vk_default.memory_stats()
    with pytest.raises(OutOfDeviceMemory) as info:
        vk_default.empty((nbytes // 4,), "f32", purpose="kv")
    exc = info.value
    assert isinstance(exc, VkrtError)
    assert exc.requested >= nbytes and exc.purpose == "kv"
    message = str(exc)
    assert f"{nbytes / (1 << 30):.1f} GiB" in message, message
    assert "for kv" in message, message
    assert vk_default.memory_stats() == stats  # nothing was accounted or reserved


@pytest.mark.parametrize("purpose", ["weights", "kv", "activations", "inputs"])
def test_accounting_per_purpose_rises_and_falls(vk_default: Backend, purpose: str) -> None:
    vk_default.sync()
    gc.collect()
    before = vk_default.memory_stats()
    t = vk_default.empty((1001,), "f32", purpose=purpose)
    during = vk_default.memory_stats()
    grown = during[f"{purpose}_bytes"] - before[f"{purpose}_bytes"]
    assert 1001 * 4 <= grown < 1001 * 4 + vk_default.memory.alignment
    others = [k for k in before if not k.startswith((purpose, "reserved", "peak"))]
    assert [during[k] for k in others] == [before[k] for k in others]
    del t
    gc.collect()
    assert vk_default.memory_stats()[f"{purpose}_bytes"] == before[f"{purpose}_bytes"]


def test_weights_are_accounted_as_weights(vk_default: Backend) -> None:
    vk_default.sync()
    before = vk_default.memory_stats()["weights_bytes"]
    w = vk_default.upload_weight(np.ones((7, 32), np.float32), "f32", (7, 32))
    assert vk_default.memory_stats()["weights_bytes"] - before >= 7 * 32 * 4
    del w
    gc.collect()
    assert vk_default.memory_stats()["weights_bytes"] == before


def test_large_allocation_gets_its_own_block_and_gives_it_back(vk_default: Backend) -> None:
    vk_default.sync()
    gc.collect()
    before = vk_default.memory_stats()
    size = 2 * vk_default.memory.block_size  # larger than any block: a dedicated allocation
    t = vk_default.empty((size // 4,), "f32", purpose="kv")
    during = vk_default.memory_stats()
    assert during["reserved_bytes"] - before["reserved_bytes"] >= size
    assert during["kv_bytes"] - before["kv_bytes"] == size
    del t
    gc.collect()
    after = vk_default.memory_stats()
    assert after["reserved_bytes"] == before["reserved_bytes"]
    assert after["kv_bytes"] == before["kv_bytes"]


class _RoundingDriver:
    """The real binding, except that buffers report a larger memory requirement than their
    size, as drivers with coarse allocation granularity do (llvmpipe does not)."""

    def __init__(self, vk: Any, extra: int) -> None:
        self._vk, self._extra = vk, extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vk, name)

    def vkGetBufferMemoryRequirements(self, device: Any, buffer: Any) -> Any:
        real = self._vk.vkGetBufferMemoryRequirements(device, buffer)
        return SimpleNamespace(size=real.size + self._extra, alignment=real.alignment,
                               memoryTypeBits=real.memoryTypeBits)


def test_reserved_bytes_return_to_zero_when_the_driver_rounds_up(vk_default: Any) -> None:
    from vkrt.backend.vulkan.memory import MemoryManager

    physical, _ = vk_default.devices[vk_default.caps.index]
    manager = MemoryManager(_RoundingDriver(vk_default.vk, 1 << 16), vk_default.device, physical,
                            vk_default.caps, force_staging=False)
    big = manager.alloc(manager.block_size, "kv")  # dedicated
    assert manager.reserved == manager.block_size + (1 << 16)
    manager.free(big)
    assert manager.reserved == 0
    small = manager.alloc(100, "activations")  # a pooled block
    manager.free(small)
    manager.close()
    assert manager.reserved == 0


def test_a_models_reserved_block_goes_back_when_its_tensors_do(vk_default: Any) -> None:
    """Loading and dropping a model again and again must not grow the memory held: the
    weights' exact-size block is destroyed once its last tensor is freed."""
    from vkrt.backend.vulkan.memory import MemoryManager

    physical, _ = vk_default.devices[vk_default.caps.index]
    manager = MemoryManager(vk_default.vk, vk_default.device, physical, vk_default.caps, force_staging=False)
    for _ in range(3):
        manager.reserve("weights", 3 << 20)
        held = manager.reserved
        tensors = [manager.alloc(1 << 20, "weights") for _ in range(3)]
        assert manager.reserved == held  # they packed into the reservation
        for a in tensors:
            manager.free(a)
        assert manager.reserved == 0
    scratch = manager.alloc(100, "activations")
    manager.free(scratch)
    assert manager.reserved > 0  # short-lived memory keeps its block for the next step
    manager.close()


def test_a_reservation_beyond_one_allocation_is_left_to_the_tensors(vk_default: Any) -> None:
    """A model's weights may exceed the largest single allocation and still fit the heap
    (a large MoE): reserve() then makes no block, the tensors take blocks as they come, and a
    reservation beyond the heap is still refused."""
    from dataclasses import replace

    from vkrt.backend.vulkan.memory import MemoryManager

    physical, _ = vk_default.devices[vk_default.caps.index]
    caps = replace(vk_default.caps, max_allocation=4 << 20)
    manager = MemoryManager(vk_default.vk, vk_default.device, physical, caps, force_staging=False)
    manager.reserve("weights", 10 << 20)
    assert manager.reserved == 0
    tensors = [manager.alloc(3 << 20, "weights") for _ in range(3)]
    assert manager.in_use["weights"] >= 9 << 20
    with pytest.raises(OutOfDeviceMemory, match="for weights"):
        manager.reserve("weights", max(manager._heaps) + 1)
    for a in tensors:
        manager.free(a)
    assert manager.reserved == 0
    manager.close()


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_kv_cache_reserves_what_its_tensors_take(vk_default: Backend, kv_dtype: str) -> None:
    """allocate_kv_cache reserves one block of exactly its tensors' footprint (it once reserved
    weight-layout sizes: [blocks, 16, kv_dim] padded to 64-row tiles, 4x the cache)."""
    from tests.conftest import FIXTURES
    from vkrt.loader import load_model
    from vkrt.models import build_model

    model = build_model(load_model(FIXTURES / "tiny_llama_hd32"), vk_default)
    model.allocate_kv_cache(1, 16, kv_dtype)  # the first one also makes the RoPE tables
    before = vk_default.memory.reserved  # type: ignore[attr-defined]
    kv = model.allocate_kv_cache(300, 16, kv_dtype)
    grown = vk_default.memory.reserved - before  # type: ignore[attr-defined]
    assert kv.nbytes <= grown <= kv.nbytes + 2 * len(kv.keys) * vk_default.memory.alignment + (64 << 10)  # type: ignore[attr-defined]
