"""VulkanBackend: ties device, memory, pipelines, descriptors and the command batch together."""

from __future__ import annotations

import atexit
import contextlib
import logging
import struct
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from vkrt import config
from vkrt.backend.base import Backend, as_storage_array, infer_dtype
from vkrt.backend.vulkan import device as vkdevice
from vkrt.backend.vulkan.activation_pool import POOLED_PURPOSES, ActivationPool
from vkrt.backend.vulkan.batch import CommandBatch, RecordedCommands
from vkrt.backend.vulkan.descriptors import DescriptorCache
from vkrt.backend.vulkan.memory import Allocation, MemoryManager, format_bytes
from vkrt.backend.vulkan.pipelines import PipelineCache
from vkrt.core.host_weight import HostWeight
from vkrt.core.op import OpError
from vkrt.core.tensor import (
    NUMPY_DTYPES,
    Tensor,
    host_numpy_dtype,
    host_shape,
    is_block_format,
    logical_shape,
    storage_nbytes,
)
from vkrt.errors import OutOfDeviceMemory, VkrtError

log = logging.getLogger("vkrt")


class StepGraph:
    """Dispatches recorded once by `VulkanBackend.capture()`, replayed with one submit."""

    def __init__(self, backend: VulkanBackend) -> None:
        self.backend = backend
        self.tensors: list[Tensor] = []
        self.recorded: RecordedCommands | None = None
        self.epoch = backend.pipelines.epoch  # the pipelines its commands bind

    @property
    def stale(self) -> bool:
        """The backend released the pipelines this graph binds (`release_pipelines`)."""
        return self.epoch != self.backend.pipelines.epoch

    @property
    def dispatches(self) -> int:
        return self.recorded.dispatches if self.recorded else 0

    def wait_for_host(self, *tensors: Tensor) -> None:
        """While capturing: `tensors` (host-visible, purpose "inputs") are late inputs, written
        by `replay(during=...)` after the submit; the step's first dispatch reading one waits
        on an event the host sets once they are written (so it may run just before sampling)."""
        self.backend.batch.wait_for_host(t.handle for t in tensors)

    def replay(self, during: Callable[[], object] | None = None) -> None:
        """Re-submit the step and wait for it (1 submit, 1 fence wait). `during` runs after the
        submit, while the device runs the step up to its first read of a late input, and
        writes the late inputs; its exception is raised once the step has completed."""
        if self.recorded is None:
            raise VkrtError("this step graph was released")
        if self.stale:
            raise VkrtError("this step graph was recorded before the backend released its pipelines; "
                            "record it again")
        self.backend.batch.replay(self.recorded, during)

    def release(self) -> None:
        if self.recorded is not None and not self.backend._closed:
            self.backend.batch.free_recorded(self.recorded)
        self.recorded = None
        self.tensors.clear()


class VulkanBackend(Backend):
    name = "vulkan"
    supports_replay = True

    def __init__(self) -> None:
        super().__init__()
        vk = vkdevice.load_vulkan()
        self.vk = vk
        self.instance = vkdevice.create_instance(vk)
        self.devices = vkdevice.enumerate_devices(vk, self.instance)
        physical, self.caps = vkdevice.choose(self.devices)
        self.device, self.queue, family = vkdevice.create_device(vk, physical, self.caps)
        self.memory = MemoryManager(vk, self.device, physical, self.caps, config.force_staging())
        self.pipelines = PipelineCache(vk, self.device, self.caps)
        self.descriptors = DescriptorCache(vk, self.device)
        self.activations = ActivationPool()
        self.queue_family = family
        self.batch = CommandBatch(vk, self.device, self.queue, family, self.counters, self._release_now,
                                  self._release_views,
                                  timestamp_bits=self.caps.timestamp_valid_bits,
                                  timestamp_period_ns=self.caps.timestamp_period_ns)
        self.supports_gpu_timing = self.caps.timestamp_valid_bits > 0
        self._weight_sources: dict[int, HostWeight] = {}
        self._checked_layouts: set[tuple[str, tuple[bool, ...]]] = set()
        self._closed = False
        self._graph_tensors: list[Tensor] | None = None
        from vkrt.backend.vulkan.kernels import register_all

        register_all(self)
        atexit.register(self.close)

    # -- tensors ---------------------------------------------------------------------
    def _new_tensor(self, shape: tuple[int, ...], dtype: str, purpose: str, nbytes: int | None = None) -> Tensor:
        size = nbytes if nbytes is not None else storage_nbytes(shape, dtype)
        alloc = self.activations.take(purpose, self.memory.footprint(size)) if purpose in POOLED_PURPOSES else None
        if alloc is None:
            alloc = self.memory.alloc(size, purpose)
        tensor = Tensor(shape, dtype, self, alloc)
        weakref.finalize(tensor, self._release, alloc)
        return tensor

    def _release(self, alloc: Allocation) -> None:
        if self._closed:
            return
        self._weight_sources.pop(alloc.id, None)
        # Kept whole for the next tensor of its size, descriptor sets and all. Its hazards
        # within the open batch are tracked by its id, as any tensor's; a step graph being
        # captured keeps what it binds, so nothing it needs can be pooled.
        if alloc.purpose in POOLED_PURPOSES and not alloc.block.dedicated and not self.batch.capturing:
            for evicted in self.activations.put(alloc):
                self._release_memory(evicted)
            return
        self._release_memory(alloc)

    def _release_memory(self, alloc: Allocation) -> None:
        # Device-written memory is recycled at once inside an open batch (behind a barrier),
        # so a long prefill does not hold every intermediate until its single submit. Host-
        # written memory and dedicated blocks wait for the batch to complete.
        if (alloc.purpose == "activations" and not alloc.block.dedicated
                and self.batch.recycle_early(alloc)):
            self.memory.release_range(alloc)
            return
        if not self.batch.defer_free(alloc):
            self._release_now(alloc)

    def _release_views(self, alloc: Allocation) -> None:
        self.descriptors.forget(alloc)
        self.memory.destroy_views(alloc)

    def _release_now(self, alloc: Allocation) -> None:
        self.descriptors.forget(alloc)
        self.memory.free(alloc)

    def empty(self, shape: tuple[int, ...], dtype: str, purpose: str = "activations") -> Tensor:
        return self._new_tensor(tuple(shape), dtype, purpose)

    def view(self, t: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The same Allocation under a new shape: descriptor sets, texel views and barrier
        tracking key on the allocation, so a view binds exactly as its base does. Only the
        base has a finalizer; the view's `base` reference keeps it (and the memory) alive."""
        alloc: Allocation = t.handle
        if alloc.id in self._weight_sources:
            raise OpError(f"reshape: {t} is a weight; its device layout is not a plain array")
        return Tensor(shape, t.dtype, self, alloc, base=t)

    def _host_safe(self) -> None:
        """Before the host writes into a new allocation: it must not be memory a recorded,
        unsubmitted dispatch still reads."""
        if self.batch.recycled_in_batch:
            self.batch.flush()

    def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Tensor:
        array = np.asarray(array)
        dtype = dtype or infer_dtype(array)
        if is_block_format(dtype):
            raise TypeError("block-format tensors are uploaded with upload_weight")
        data = as_storage_array(array, dtype)
        self._host_safe()
        tensor = self._new_tensor(logical_shape(data.shape, dtype), dtype, purpose)
        self._write_bytes(tensor.handle, data.view(np.uint8).reshape(-1))
        return tensor

    def upload_host_weight(self, weight: HostWeight) -> Tensor:
        """Weights keep their storage format; kernels' device layouts may repack blocks.

        Each matrix (one, or E of an expert stack) is laid out and written into its place in
        the allocation as it is read, its stacked pieces joined there, so the host holds at most
        one matrix's device image at a time; `read()` joins the pieces again from `weight`,
        which holds views of the loader's memory map, not a copy."""
        from vkrt.backend.vulkan.kernels.layouts import write_device_image

        dtype, shape = weight.dtype, weight.shape
        stored = sum(storage_nbytes((b.num_rows, shape[-1]) if len(shape) > 1 else shape, dtype)
                     for m in weight.matrices for b in m)
        if stored != storage_nbytes(shape, dtype):
            raise VkrtError(f"weight {dtype}{list(shape)} needs {storage_nbytes(shape, dtype)} bytes, got {stored}")
        matrix = len(shape) >= 2  # matrices are row-tiled for the matmul kernels, 1-D weights not
        nbytes = self.weight_nbytes(dtype, shape) - self.memory.alignment
        if len(shape) == 3:  # stacked experts [E, out, in]: E matrices one after another, each tiled
            self._check_expert_binding(nbytes, dtype, shape)
        self._host_safe()
        tensor = self._new_tensor(tuple(shape), dtype, "weights", nbytes=nbytes)
        offset = 0

        def write(start: int, piece: np.ndarray) -> None:
            self._write_bytes(tensor.handle, piece, offset + start)

        for m in range(weight.num_matrices):
            rows = as_storage_array(weight.matrix(m), dtype)
            offset += write_device_image(rows.reshape(rows.shape[0], -1) if matrix else rows.reshape(1, -1), dtype,
                                         write, tiled=matrix)
        self._weight_sources[tensor.handle.id] = weight  # for read(): joined from the loader's map
        return tensor

    def _check_expert_binding(self, nbytes: int, dtype: str, shape: tuple[int, ...]) -> None:
        """An expert weight the expert matmul could not bind whole would run every MoE layer on
        the host after a drain: refuse it at upload instead."""
        from vkrt.backend.vulkan.kernels.moe import binding_limit

        limit = binding_limit(self.caps)
        if nbytes > limit:
            raise OutOfDeviceMemory(
                f"the expert weight {dtype} {list(shape)} is {format_bytes(nbytes)} in the device layout, more "
                f"than one buffer binding holds on {self.caps.name} ({format_bytes(limit)} on the "
                f"{self.caps.access_path} access path); use a smaller quantisation or another device",
                requested=nbytes, purpose="weights")

    def reserve(self, purpose: str, nbytes: int) -> None:
        self.memory.reserve(purpose, nbytes)

    def weight_nbytes(self, dtype: str, shape: tuple[int, ...]) -> int:
        """Size in the device layout (matrices padded to whole row tiles)."""
        from vkrt.backend.vulkan.kernels.layouts import device_layout, device_nbytes

        if len(shape) == 2:
            return device_nbytes(dtype, shape[0], shape[1]) + self.memory.alignment
        if len(shape) == 3:
            return shape[0] * device_nbytes(dtype, shape[1], shape[2]) + self.memory.alignment
        row = np.zeros((1, storage_nbytes(tuple(shape), dtype)), np.uint8)
        sample = row if is_block_format(dtype) else row.view(NUMPY_DTYPES[dtype])
        return device_layout(sample, dtype, tiled=False).nbytes + self.memory.alignment

    def tensor_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return self.memory.footprint(storage_nbytes(shape, dtype))

    def _write_bytes(self, alloc: Allocation, data: np.ndarray, offset: int = 0) -> None:
        """Write `data` (uint8) into `alloc` from byte `offset` on."""
        in_flight = self.batch.in_flight
        if in_flight is not None and alloc.id not in in_flight.late_inputs:
            raise VkrtError("while a replayed step runs, the host may write only its late inputs "
                            "(declared with wait_for_host when it was recorded)")
        if alloc.id in self.batch.referenced:
            self.batch.flush()  # a recorded dispatch still needs the old contents
        if alloc.host_visible:
            alloc.host_view()[offset : offset + data.nbytes] = data
        else:
            staging = self.memory.alloc(data.nbytes, "staging")
            staging.host_view()[: data.nbytes] = data
            self.batch.copy(staging, alloc, data.nbytes, dst_offset=offset)
            self.batch.defer_free(staging)
        self.counters.bytes_up += data.nbytes

    def write(self, t: Tensor, array: np.ndarray) -> None:
        data = as_storage_array(np.asarray(array), t.dtype)
        if data.nbytes != t.nbytes:
            raise VkrtError(f"write: {t} holds {t.nbytes} bytes, got {data.nbytes}")
        self._write_bytes(t.handle, data.view(np.uint8).reshape(-1))

    def read(self, t: Tensor) -> np.ndarray:
        alloc: Allocation = t.handle
        source = self._weight_sources.get(alloc.id)
        if source is not None:  # storage-format bytes, joined from the loader's map
            return as_storage_array(source.array(), t.dtype).copy().reshape(
                (source.shape[0], -1) if is_block_format(t.dtype) else source.shape)
        nbytes = t.nbytes
        if self.batch.in_flight is not None:
            raise VkrtError("the host work of a replayed step cannot read device tensors; the "
                            "step's results are readable once replay() returns")
        if alloc.host_visible:
            if alloc.id in self.batch.referenced:
                self.batch.flush()
            raw = alloc.host_view()[:nbytes].copy()
        else:
            staging = self.memory.alloc(nbytes, "staging")
            self.batch.copy(alloc, staging, nbytes)
            self.batch.flush()
            raw = staging.host_view()[:nbytes].copy()
            self.memory.free(staging)
        self.counters.bytes_down += nbytes
        return raw.view(host_numpy_dtype(t.dtype)).reshape(host_shape(t.shape, t.dtype))

    def sync(self) -> None:
        self.run_sync_hooks()
        self.batch.flush()

    def discard(self) -> None:
        self.batch.discard()

    # -- dispatch --------------------------------------------------------------------
    def run_shader(self, module: str, bindings: list[tuple[Tensor, str, bool]],
                   groups: tuple[int, int, int], push: tuple[str, tuple] | None = None,
                   spec: dict[int, int] | None = None) -> None:
        """Record one dispatch of `module`. bindings: (tensor, texel view kind, written)."""
        pipeline = self.pipelines.get(module, spec)
        # Keyed by the written flags too: a call that passed once must not exempt a later,
        # different binding list (a short one would leave descriptors unwritten).
        signature = (module, tuple(w for _, _, w in bindings))
        if signature not in self._checked_layouts:
            manifest = [(b["type"], b["written"]) for b in pipeline.bindings]
            declared = [(manifest[i][0] if i < len(manifest) else "?", w) for i, (_, _, w) in enumerate(bindings)]
            if len(manifest) != len(bindings) or declared != manifest or any(
                    w and typ != "storage_buffer" for typ, w in manifest):
                from vkrt.backend.vulkan.pipelines import LayoutMismatch

                raise LayoutMismatch(f"{module}: kernel binds {[(k, w) for _, k, w in bindings]} but the "
                                     f"shader's manifest declares {manifest}")
            self._checked_layouts.add(signature)
        set_ptr = self.descriptors.get(pipeline, [(t.handle, kind) for t, kind, _ in bindings])
        push_size = 0
        push_data: Any = None
        if push is not None:
            packed = struct.pack(push[0], *push[1])
            push_size = len(packed)
            if push_size != pipeline.push_constant_size:
                raise VkrtError(f"{module}: {push_size} bytes of push constants, shader takes "
                                f"{pipeline.push_constant_size}")
            push_data = self.vk.ffi.new("char[]", packed)
        if self._graph_tensors is not None:
            self._graph_tensors.extend(t for t, _, _ in bindings)
        reads = tuple(t.handle.id for t, _, w in bindings if not w)
        writes = tuple(t.handle.id for t, _, w in bindings if w)
        self.batch.dispatch(pipeline, set_ptr, push_data, push_size, groups, reads, writes, module)
        if self.batch.over_cap:
            self.batch.flush()

    def copy_regions(self, src: Tensor, dst: Tensor, regions: list[tuple[int, int, int]]) -> None:
        """Record a device copy of (src byte offset, dst byte offset, size) regions of `src` into
        `dst`, in the command stream after what was recorded before it (no host round trip)."""
        for src_offset, dst_offset, size in regions:
            for tensor, offset in ((src, src_offset), (dst, dst_offset)):
                if offset < 0 or offset + size > tensor.nbytes:
                    raise VkrtError(f"copy_regions: bytes {offset}..{offset + size} are outside {tensor}")
        if self._graph_tensors is not None:
            self._graph_tensors.extend((src, dst))
        self.batch.copy_regions(src.handle, dst.handle, regions)

    # -- record once, replay -------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[StepGraph]:
        """Record the ops run inside the block once; `graph.replay()` re-submits them.

        Everything that changes per step must live in tensors written with `write()`
        before each replay; the graph keeps every tensor it binds alive.
        """
        graph = StepGraph(self)
        self._graph_tensors = graph.tensors
        self.batch.begin_capture()
        try:
            yield graph
        except BaseException:
            self._graph_tensors = None
            graph.recorded = self.batch.end_capture()
            graph.release()
            raise
        self.run_sync_hooks()  # ops still pending belong to this step: record them before it ends
        self._graph_tensors = None
        graph.recorded = self.batch.end_capture()

    # -- device timing -----------------------------------------------------------------
    def enable_profiling(self, enabled: bool = True) -> bool:
        """Per-dispatch timestamps from the next recording on (needs timestamp queries).

        Step graphs keep the mode they were captured in: one captured while profiling is
        on is profiled on every replay; one captured before reports only its total.
        """
        if self.batch.capturing:
            raise VkrtError("profiling cannot be switched while a step is being recorded")
        on = bool(enabled) and self.supports_gpu_timing
        if on != self.batch.profiling:
            self.sync()  # the open batch was recorded in the old mode
        self.batch.profiling = on
        self.batch.profiler.enabled = on
        return on

    def profile_commit(self, phase: str) -> None:
        if self.batch.profiler.enabled:  # work still open is filed with the next commit
            self.batch.profiler.commit(phase)

    def profile_report(self, reset: bool = False) -> dict[str, Any]:
        report = self.batch.profiler.report()
        if reset:
            self.batch.profiler.reset()
        return report

    def set_access_path(self, path: str) -> None:
        """Switch kernels between the texel and ssbo access paths (tests run both)."""
        if path not in ("texel", "ssbo"):
            raise VkrtError(f"access path must be 'texel' or 'ssbo', not {path!r}")
        self.sync()
        self.caps.access_path = path

    # -- reporting -------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "device": self.caps.as_dict(),
                "devices": [c.as_dict() for _, c in self.devices]}

    def describe_text(self) -> list[str]:
        c = self.caps
        lines = [f"{'*' if d.index == c.index else ' '} {d.index}: {d.name} ({d.device_type}, Vulkan {d.api_version})"
                 for _, d in self.devices]
        return lines + [
            "",
            f"chosen: {c.index} {c.name}  (override with VKRT_DEVICE=<index|name>)",
            f"  kernel access path: {c.access_path}  (override with VKRT_ACCESS=texel|ssbo)",
            f"  unified memory: {c.unified_memory}, device-local heap {c.device_local_bytes >> 20} MiB, "
            f"max allocation {c.max_allocation >> 20} MiB",
            f"  subgroup size {c.subgroup_size} ({', '.join(c.subgroup_ops)}), shared memory "
            f"{c.max_shared_memory >> 10} KiB",
            f"  16-bit storage {c.storage_buffer_16bit}, 8-bit storage {c.storage_buffer_8bit}, "
            f"float16 {c.shader_float16}, int8 {c.shader_int8}",
            f"  max storage range {c.max_storage_range >> 20} MiB, uniform range {c.max_uniform_range >> 10} KiB, "
            f"texel elements {c.max_texel_elements}",
        ]

    def memory_stats(self) -> dict[str, int]:
        """Bytes per purpose held by live tensors; `<purpose>_pooled_bytes` those released and kept for reuse."""
        stats = self.memory.stats()
        for purpose, nbytes in self.activations.nbytes_by_purpose.items():
            stats[f"{purpose}_bytes"] -= nbytes
            stats[f"{purpose}_pooled_bytes"] = nbytes
        return stats

    def release_pipelines(self) -> int:
        """Wait for the device, then destroy every pipeline (they are re-created on next use),
        returning how many: bounds the memory of a long-lived process that has run many kernel
        configurations (a test session). Step graphs recorded before it become stale."""
        self.sync()  # every submit is waited for: the device is idle after it
        return self.pipelines.release_pipelines()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.batch.close()
            self.pipelines.close()
            self.descriptors.close()
        finally:
            self._closed = True
