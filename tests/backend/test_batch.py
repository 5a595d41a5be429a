"""CommandBatch: one submit per host read, barriers only on hazards, deferred frees."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.backend.vulkan.activation_pool import ActivationPool


def _settled(vk: Backend) -> dict[str, int]:
    """Counters with nothing left open from earlier tests."""
    vk.sync()
    return vk.counters.snapshot()


def test_n_ops_then_one_read_is_one_submit(vk_default: Backend, rng: np.random.Generator) -> None:
    a = rng.standard_normal((3, 37)).astype(np.float32)
    b = rng.standard_normal((37,)).astype(np.float32)
    x, w = vk_default.upload(a), vk_default.upload(b)
    n = 10
    before = _settled(vk_default)
    y = x
    for _ in range(n):
        y = ops.add(y, w)
    recorded = vk_default.counters.since(before)
    assert recorded["submits"] == 0 and recorded["fence_waits"] == 0  # nothing left the host yet
    out = y.numpy()
    delta = vk_default.counters.since(before)
    assert delta["dispatches"] == n
    assert delta["submits"] == 1
    assert delta["fence_waits"] == 1
    assert delta["drains"] == 0
    assert delta["barriers"] == n - 1  # each add reads the previous one's output
    assert delta["bytes_down"] == a.nbytes
    expected = a.copy()
    for _ in range(n):
        expected = expected + b
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-5)
    # A second read of the same tensor needs no device work.
    again = vk_default.counters.snapshot()
    y.numpy()
    assert vk_default.counters.since(again)["submits"] == 0


def test_independent_ops_need_no_barrier(vk_default: Backend, rng: np.random.Generator) -> None:
    arrays = [rng.standard_normal(129).astype(np.float32) for _ in range(4)]
    a, b, c, d = (vk_default.upload(x) for x in arrays)
    before = _settled(vk_default)
    s = ops.add(a, b)
    p = ops.add(c, d)
    t = ops.add(a, d)  # reads what the others read: read-after-read is no hazard
    assert vk_default.counters.since(before)["barriers"] == 0
    u = ops.add(s, p)  # reads both earlier outputs: one barrier covers both
    assert vk_default.counters.since(before)["barriers"] == 1
    np.testing.assert_array_equal(u.numpy(), (arrays[0] + arrays[1]) + (arrays[2] + arrays[3]))
    np.testing.assert_array_equal(t.numpy(), arrays[0] + arrays[3])
    delta = vk_default.counters.since(before)
    assert delta["dispatches"] == 4 and delta["submits"] == 1


def test_write_to_a_tensor_the_batch_reads_flushes_first(vk_default: Backend,
                                                         rng: np.random.Generator) -> None:
    old = rng.standard_normal(300).astype(np.float32)
    new = rng.standard_normal(300).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    x, w = vk_default.upload(old), vk_default.upload(b)
    before = _settled(vk_default)
    y = ops.add(x, w)
    assert vk_default.counters.since(before)["submits"] == 0
    vk_default.write(x, new)
    assert vk_default.counters.since(before)["submits"] == 1  # the recorded add ran first
    z = ops.add(x, w)
    np.testing.assert_array_equal(y.numpy(), old + b)  # saw the old contents
    np.testing.assert_array_equal(z.numpy(), new + b)
    np.testing.assert_array_equal(x.numpy(), new)


def test_write_to_an_unreferenced_tensor_does_not_flush(vk_default: Backend) -> None:
    x = vk_default.upload(np.ones(64, np.float32))
    spare = vk_default.upload(np.zeros(64, np.float32))
    before = _settled(vk_default)
    y = ops.add(x, x)
    vk_default.write(spare, np.full(64, 5, np.float32))
    assert vk_default.counters.since(before)["submits"] == 0
    np.testing.assert_array_equal(y.numpy(), np.full(64, 2, np.float32))


def _ranges_overlap(p, q) -> bool:
    return p.block is q.block and p.offset < q.offset + q.size and q.offset < p.offset + p.size


def test_host_uploads_never_land_in_memory_a_pending_dispatch_reads(
        vk_default: Backend, rng: np.random.Generator) -> None:
    n = 4096
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x, w = vk_default.upload(a), vk_default.upload(b)
    _settled(vk_default)
    y = ops.add(x, w)
    del x
    gc.collect()
    # Same size: first fit would hand out x's range; the host must not write it while the
    # recorded add still reads it, so the upload submits the batch first.
    before = vk_default.counters.snapshot()
    clobber = [vk_default.upload(np.full(n, 1e6, np.float32)) for _ in range(4)]
    assert vk_default.counters.since(before)["submits"] == 1
    np.testing.assert_array_equal(y.numpy(), a + b)
    del clobber


@pytest.fixture
def unpooled(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """The backend with its activation pool off: released memory goes back to the allocator."""
    monkeypatch.setattr(vk_default, "activations", ActivationPool(0))
    return vk_default


@pytest.fixture
def empty_pool(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """The backend with nothing pooled yet (earlier tests' tensors would be taken first)."""
    monkeypatch.setattr(vk_default, "activations", ActivationPool())
    return vk_default


def test_device_written_memory_is_recycled_inside_a_batch_behind_a_barrier(
        unpooled: Backend, rng: np.random.Generator) -> None:
    vk_default = unpooled
    n = 4096
    a = rng.standard_normal(n).astype(np.float32)
    x, w = vk_default.upload(a), vk_default.upload(a)
    _settled(vk_default)
    before = vk_default.counters.snapshot()
    t = ops.add(x, w)  # written by the device, read by the next op, then dropped
    y = ops.add(t, w)
    freed = t.handle
    del t
    gc.collect()
    assert freed.freed  # its bytes are reusable at once...
    z = ops.add(w, w)  # ...and may be this output, written after y's read of t
    assert _ranges_overlap(z.handle, freed)
    delta_barriers = vk_default.counters.since(before)["barriers"]
    np.testing.assert_array_equal(y.numpy(), (a + a) + a)
    np.testing.assert_array_equal(z.numpy(), a + a)
    assert delta_barriers == 2  # t -> y's add (read after write), then the reuse barrier
    assert vk_default.counters.since(before)["submits"] == 1


def test_a_pooled_tensor_is_taken_again_inside_a_batch_behind_a_barrier(
        empty_pool: Backend, rng: np.random.Generator) -> None:
    vk_default = empty_pool
    n = 4096
    a = rng.standard_normal(n).astype(np.float32)
    x, w = vk_default.upload(a), vk_default.upload(a)
    _settled(vk_default)
    before = vk_default.counters.snapshot()
    t = ops.add(x, w)
    y = ops.add(t, w)
    kept = t.handle
    del t
    gc.collect()
    assert not kept.freed  # kept whole, views and descriptor sets with it...
    z = ops.add(w, w)  # ...for the next tensor of its size, written after y's read of t
    assert z.handle is kept
    delta_barriers = vk_default.counters.since(before)["barriers"]
    np.testing.assert_array_equal(y.numpy(), (a + a) + a)
    np.testing.assert_array_equal(z.numpy(), a + a)
    assert delta_barriers == 2  # t -> y's add (read after write), then z's write after y's read
    assert vk_default.counters.since(before)["submits"] == 1


def test_a_pooled_input_taken_again_waits_for_the_dispatch_that_reads_it(empty_pool: Backend) -> None:
    vk_default = empty_pool
    before = _settled(vk_default)
    in_use = vk_default.memory_stats()["inputs_bytes"]
    x = vk_default.upload(np.ones(1000, np.float32), purpose="inputs")
    kept = x.handle
    y = ops.add(x, x)
    del x
    gc.collect()
    assert vk_default.memory_stats()["inputs_bytes"] == in_use  # pooled, not held by a tensor
    assert vk_default.memory_stats()["inputs_pooled_bytes"] >= 4000
    again = vk_default.upload(np.full(1000, 5, np.float32), purpose="inputs")
    assert again.handle is kept
    assert vk_default.counters.since(before)["submits"] == 1  # the add read the old bytes first
    np.testing.assert_array_equal(y.numpy(), np.full(1000, 2, np.float32))
    np.testing.assert_array_equal(again.numpy(), np.full(1000, 5, np.float32))


def test_deferred_frees_return_to_the_accounting(unpooled: Backend) -> None:
    vk_default = unpooled
    before = _settled(vk_default)
    in_use = vk_default.memory_stats()["inputs_bytes"]
    x = vk_default.upload(np.ones(1000, np.float32), purpose="inputs")  # host-written memory
    y = ops.add(x, x)
    del x, y
    gc.collect()
    assert vk_default.memory_stats()["inputs_bytes"] > in_use  # deferred until the batch ends
    vk_default.sync()
    assert vk_default.memory_stats()["inputs_bytes"] == in_use
    assert vk_default.counters.since(before)["submits"] == 1


def test_overwriting_an_input_of_an_earlier_dispatch_gets_a_barrier(vk_default: Backend) -> None:
    """Write-after-read: the second dispatch writes the buffer the first one reads."""
    from vkrt.backend.vulkan.kernels.common import grid_1d, local_size, module

    n = 100
    a = vk_default.upload(np.arange(n, dtype=np.float32))
    b = vk_default.upload(np.ones(n, np.float32))
    y = vk_default.empty((n,), "f32")
    add = module(vk_default, "elementwise", "add")
    before = _settled(vk_default)
    vk_default.run_shader(add, [(a, "f32", False), (b, "f32", False), (y, "f32", True)],
                          grid_1d(n), ("<IIf", (n, n, 0.0)), local_size())
    vk_default.run_shader(add, [(b, "f32", False), (b, "f32", False), (a, "f32", True)],
                          grid_1d(n), ("<IIf", (n, n, 0.0)), local_size())
    assert vk_default.counters.since(before)["barriers"] == 1
    np.testing.assert_array_equal(y.numpy(), np.arange(n, dtype=np.float32) + 1)
    np.testing.assert_array_equal(a.numpy(), np.full(n, 2, np.float32))
