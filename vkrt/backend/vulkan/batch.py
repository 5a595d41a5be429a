"""CommandBatch: records dispatches into one command buffer, submits when bytes are needed.

Everything here runs per dispatch, so it calls `vulkan.lib` directly with structs built once
(the binding's convenience wrappers measured ~8x slower). Submission always blocks in
vkWaitForFences: fence polling passed on llvmpipe but gave wrong reads on other drivers.

A recorded step may have *late inputs*: tensors the host writes after the step is submitted
(the token masks of structured output, computed while the device runs the forward). The
first dispatch that reads one waits on a VkEvent that the host sets once it has written them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vkrt.backend.base import Counters
from vkrt.backend.vulkan.memory import Allocation
from vkrt.backend.vulkan.profile import COPY_LABEL, Profiler, QueryTimeline
from vkrt.errors import DeviceLostError, NotReplayable, OutOfDeviceMemory, VkrtError

UINT64_MAX = 0xFFFFFFFFFFFFFFFF
# Fence waits block without limit (a step may legitimately take long on a CPU device); tests
# lower it so a driver that never sees a host-set event fails instead of hanging.
FENCE_TIMEOUT_NS = UINT64_MAX
# Memory freed while a batch is open is recycled only after it completes; past this many
# bytes the batch is submitted early so a long prefill cannot exhaust the device.
DEFERRED_FREE_CAP = 256 << 20
# The VkResult codes a running step can meet (the Vulkan spec's values).
VK_TIMEOUT = 2
VK_ERROR_OUT_OF_HOST_MEMORY = -1
VK_ERROR_OUT_OF_DEVICE_MEMORY = -2
VK_ERROR_DEVICE_LOST = -4


def check_result(result: int, call: str) -> None:
    """Raise the typed error for `call`'s failed VkResult: DeviceLostError (unrecoverable),
    OutOfDeviceMemory (the work was refused; the device still runs), VkrtError otherwise."""
    if result == 0:
        return
    if result == VK_ERROR_DEVICE_LOST:
        raise DeviceLostError(f"{call} returned VK_ERROR_DEVICE_LOST: the device stopped running work (a driver "
                              "reset or a hang); restart vkrt, and see the system log if it happens again")
    if result in (VK_ERROR_OUT_OF_DEVICE_MEMORY, VK_ERROR_OUT_OF_HOST_MEMORY):
        memory = "device" if result == VK_ERROR_OUT_OF_DEVICE_MEMORY else "host"
        raise OutOfDeviceMemory(f"{call} ran out of {memory} memory (VkResult {result}); lower --max-num-seqs "
                                "or --kv-cache-memory, or free memory other processes hold", purpose=call)
    if result == VK_TIMEOUT:
        raise VkrtError(f"{call} timed out: the submitted work did not complete")
    raise VkrtError(f"{call} failed with VkResult {result}")


@dataclass(eq=False)
class RecordedCommands:
    """A command buffer recorded once and re-submitted per step."""

    cmd: Any
    cmd_array: Any
    submit: Any
    dispatches: int
    barriers: int
    timeline: QueryTimeline | None = None  # its start/end (and per-dispatch) timestamps
    # Allocation ids the host writes after the submit (late inputs), and the VkEvent the first
    # dispatch reading one waits on (None: no dispatch reads one). Left set between replays.
    late_inputs: frozenset[int] = frozenset()
    gate: Any = None


class CommandBatch:
    def __init__(self, vk: Any, device: Any, queue: Any, family: int, counters: Counters,
                 release: Callable[[Allocation], None], release_views: Callable[[Allocation], None], timestamp_bits: int = 0,
                 timestamp_period_ns: float = 1.0) -> None:
        self.vk, self.device, self.queue = vk, device, queue
        self.lib, self.ffi = vk.lib, vk.ffi
        self.counters = counters
        self._release = release
        self._release_views = release_views
        self.pool = vk.vkCreateCommandPool(device, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=family), None)
        self.cmd = vk.vkAllocateCommandBuffers(device, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self.fence = vk.vkCreateFence(device, vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
        ffi = self.ffi
        self._begin_info = ffi.new("VkCommandBufferBeginInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            "flags": vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT})
        self._cmd_array = ffi.new("VkCommandBuffer[1]", [self.cmd])
        self._fence_array = ffi.new("VkFence[1]", [self.fence])
        self._submit = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                 "commandBufferCount": 1, "pCommandBuffers": self._cmd_array})
        access = (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
                  | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
        self._barrier = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                     "srcAccessMask": access, "dstAccessMask": access})
        self._host_barrier = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, "srcAccessMask": access,
            "dstAccessMask": vk.VK_ACCESS_HOST_READ_BIT})
        # Host writes made after the submit (before vkSetEvent) -> the waiting dispatches' reads.
        self._late_barrier = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, "srcAccessMask": vk.VK_ACCESS_HOST_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_UNIFORM_READ_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT})
        self._stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        self._bind_point = vk.VK_PIPELINE_BIND_POINT_COMPUTE
        self._compute_stage = vk.VK_SHADER_STAGE_COMPUTE_BIT
        self._copy_region = ffi.new("VkBufferCopy*")
        self._replay_begin_info = ffi.new("VkCommandBufferBeginInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO})
        self.capturing = False
        self.recording = False
        self.recorded = 0
        # The capture's late inputs (all, and those no recorded dispatch has waited for yet)
        # and its event; the replayed step whose host work is running, if any.
        self._late_inputs: set[int] = set()
        self._late_unwaited: set[int] = set()
        self._gate: Any = None
        self.in_flight: RecordedCommands | None = None
        self.referenced: set[int] = set()  # allocation ids the open batch touches
        self._written: set[int] = set()  # written since the last barrier
        self._read: set[int] = set()
        self._deferred: list[Allocation] = []
        self._deferred_bytes = 0
        # Allocations whose bytes were recycled inside the open batch; their views and
        # descriptor sets die only when it completes. A barrier orders the old readers
        # before the new writers of recycled bytes.
        self._deferred_views: list[Allocation] = []
        self._reuse_barrier = False
        self._bound_pipeline: Any = None
        self.keepalive: list[Any] = []
        # GPU time per submit from timestamp queries (0 valid bits: the queue has none).
        self.timestamp_bits = timestamp_bits
        self.timestamp_period_ns = timestamp_period_ns
        self.profiler = Profiler()
        self.profiling = False  # a timestamp after every dispatch (set through the backend)
        self._timeline = self._new_timeline()
        self._batch_timeline = self._timeline  # the open batch's, while a graph is captured
        self._gpu_ns_rest = 0

    def _new_timeline(self) -> QueryTimeline | None:
        if not self.timestamp_bits:
            return None
        return QueryTimeline(self.vk, self.device, self.timestamp_bits, self.timestamp_period_ns)

    # -- recording -----------------------------------------------------------------
    def _begin(self) -> None:
        if not self.recording:
            self.lib.vkBeginCommandBuffer(self.cmd, self._begin_info)
            self.recording = True
            self._bound_pipeline = None
            if self._timeline is not None:
                self._timeline.begin(self.cmd, self.profiling)

    def _hazards(self, reads: tuple[int, ...], writes: tuple[int, ...]) -> None:
        """Insert a barrier only when this dispatch touches what an earlier one wrote (or
        writes what an earlier one read): RAW, WAW and WAR on the same allocation. The first
        dispatch of a capture that reads a late input first waits for the host."""
        if self._late_unwaited and any(r in self._late_unwaited for r in reads):
            self._wait_for_host()
        if self._reuse_barrier or any(r in self._written for r in reads) or any(
                w in self._written or w in self._read for w in writes):
            self._reuse_barrier = False
            self.lib.vkCmdPipelineBarrier(self.cmd, self._stages, self._stages, 0, 1, self._barrier,
                                          0, self.ffi.NULL, 0, self.ffi.NULL)
            self.counters.barriers += 1
            self._written.clear()
            self._read.clear()
        self._read.update(reads)
        self._written.update(writes)
        self.referenced.update(reads)
        self.referenced.update(writes)

    def dispatch(self, pipeline: Any, set_ptr: Any, push: Any, push_size: int,
                 groups: tuple[int, int, int], reads: tuple[int, ...], writes: tuple[int, ...],
                 label: str = "dispatch") -> None:
        self._begin()
        self._hazards(reads, writes)
        lib, cmd = self.lib, self.cmd
        if self._bound_pipeline is not pipeline:
            lib.vkCmdBindPipeline(cmd, self._bind_point, pipeline.pipeline)
            self._bound_pipeline = pipeline
        lib.vkCmdBindDescriptorSets(cmd, self._bind_point, pipeline.layout, 0, 1, set_ptr, 0, self.ffi.NULL)
        if push_size:
            lib.vkCmdPushConstants(cmd, pipeline.layout, self._compute_stage, 0, push_size, push)
        lib.vkCmdDispatch(cmd, *groups)
        if self.profiling and self._timeline is not None:
            self._timeline.mark(cmd, label)
        self.recorded += 1
        self.counters.dispatches += 1

    def copy(self, src: Allocation, dst: Allocation, size: int, dst_offset: int = 0) -> None:
        """Record a copy of `size` bytes from the start of `src` to `dst` at byte `dst_offset`."""
        self._begin()
        self._hazards((src.id,), (dst.id,))
        region = self._copy_region
        region.srcOffset, region.dstOffset, region.size = src.offset, dst.offset + dst_offset, size
        self.lib.vkCmdCopyBuffer(self.cmd, src.block.buffer, dst.block.buffer, 1, region)
        if self.profiling and self._timeline is not None:
            self._timeline.mark(self.cmd, COPY_LABEL)
        self.recorded += 1

    def copy_regions(self, src: Allocation, dst: Allocation, regions: list[tuple[int, int, int]]) -> None:
        """Record one copy of (src byte offset, dst byte offset, size) regions from `src` to `dst`
        (the same allocation may be both: no source region may overlap a destination one)."""
        if not regions:
            return
        self._begin()
        self._hazards((src.id,), (dst.id,))
        array = self.ffi.new("VkBufferCopy[]", len(regions))
        for entry, (src_offset, dst_offset, size) in zip(array, regions, strict=True):
            entry.srcOffset, entry.dstOffset, entry.size = src.offset + src_offset, dst.offset + dst_offset, size
        self.lib.vkCmdCopyBuffer(self.cmd, src.block.buffer, dst.block.buffer, len(regions), array)
        if self.profiling and self._timeline is not None:
            self._timeline.mark(self.cmd, COPY_LABEL)
        self.recorded += 1

    def defer_free(self, alloc: Allocation) -> bool:
        """Hold `alloc` until the open batch completes; False if nothing is open."""
        if not self.recording:
            return False
        self._deferred.append(alloc)
        self._deferred_bytes += alloc.size
        return True

    def recycle_early(self, alloc: Allocation) -> bool:
        """Let `alloc`'s bytes be reused within the open batch (behind a barrier); its views
        and descriptor sets are kept until the batch completes. False if nothing is open."""
        if not self.recording or self.capturing:
            return False
        self._deferred_views.append(alloc)
        self._reuse_barrier = True
        return True

    @property
    def recycled_in_batch(self) -> bool:
        """True when memory freed in the open batch may already belong to a new tensor."""
        return bool(self._deferred_views)

    @property
    def over_cap(self) -> bool:
        return self._deferred_bytes > DEFERRED_FREE_CAP

    def _wait_for_host(self) -> None:
        """Record a wait on the capture's event: later commands start only once the host has
        set it, and see the host's writes made before it did (vkCmdWaitEvents, host stage)."""
        vk, lib, ffi = self.vk, self.lib, self.ffi
        if self._gate is None:
            event = ffi.new("VkEvent*")
            info = ffi.new("VkEventCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_EVENT_CREATE_INFO})
            if lib.vkCreateEvent(self.device, info, ffi.NULL, event) != 0:
                raise VkrtError("vkCreateEvent failed: the device cannot make the event a recorded step "
                                "waits on for its late inputs")
            self._gate = ffi.new("VkEvent[1]", [event[0]])
        lib.vkCmdWaitEvents(self.cmd, 1, self._gate, vk.VK_PIPELINE_STAGE_HOST_BIT, self._stages,
                            1, self._late_barrier, 0, ffi.NULL, 0, ffi.NULL)
        self._late_unwaited.clear()  # commands after the wait all come after it in submission order

    # -- record once, replay ----------------------------------------------------------
    def wait_for_host(self, allocs: Iterable[Allocation]) -> None:
        """While capturing: the host writes `allocs` during each replay, after the submit
        (`replay(during=...)`); the step's first dispatch that reads one waits until it has."""
        if not self.capturing:
            raise VkrtError("late inputs are declared while a step is being recorded for replay")
        for alloc in allocs:
            if not alloc.host_visible:
                raise VkrtError(f"a late input must be host-visible memory (purpose 'inputs'), not {alloc.purpose}")
            self._late_inputs.add(alloc.id)
            self._late_unwaited.add(alloc.id)

    def begin_capture(self) -> None:
        """Record the following dispatches into a command buffer of their own, kept for replay."""
        self.flush()
        vk = self.vk
        self._batch_cmd = self.cmd
        self.cmd = vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self.lib.vkBeginCommandBuffer(self.cmd, self._replay_begin_info)
        self.recording = True
        self.capturing = True
        self._bound_pipeline = None
        # The graph's timestamps are recorded into it, into query pools of its own, so a
        # replay is still one submit and is timed (per dispatch when captured profiling).
        self._batch_timeline = self._timeline
        self._timeline = self._new_timeline()
        if self._timeline is not None:
            self._timeline.begin(self.cmd, self.profiling)
        self._capture_start = (self.counters.dispatches, self.counters.barriers)

    def end_capture(self) -> RecordedCommands:
        lib = self.lib
        lib.vkCmdPipelineBarrier(self.cmd, self._stages, self.vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                                 self._host_barrier, 0, self.ffi.NULL, 0, self.ffi.NULL)
        timeline = self._timeline
        if timeline is not None:
            timeline.end(self.cmd)
        lib.vkEndCommandBuffer(self.cmd)
        cmd_array = self.ffi.new("VkCommandBuffer[1]", [self.cmd])
        submit = self.ffi.new("VkSubmitInfo*", {"sType": self.vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                "commandBufferCount": 1, "pCommandBuffers": cmd_array})
        gate, self._gate = self._gate, None
        if gate is not None:  # set: replays without host work pass
            check_result(lib.vkSetEvent(self.device, gate[0]), "vkSetEvent")
        recorded = RecordedCommands(self.cmd, cmd_array, submit,
                                    self.counters.dispatches - self._capture_start[0],
                                    self.counters.barriers - self._capture_start[1], timeline,
                                    frozenset(self._late_inputs), gate)
        self._late_inputs.clear()
        self._late_unwaited.clear()
        # Recording executed nothing: count the dispatches when they are replayed.
        self.counters.dispatches -= recorded.dispatches
        self.counters.barriers -= recorded.barriers
        self.cmd = self._batch_cmd
        self._timeline = self._batch_timeline
        self.capturing = False
        self.recording = False
        self.recorded = 0
        self.referenced.clear()
        self._written.clear()
        self._read.clear()
        return recorded

    def replay(self, recorded: RecordedCommands, during: Callable[[], object] | None = None) -> None:
        """Submit a recorded step again and wait for it: one submit, one fence wait.

        `during` runs after the submit, while the device runs the step up to its wait for
        the host; it writes the late inputs (and nothing else). The event is set after it
        returns or raises, so the device never waits forever; its exception is re-raised
        once the step has completed."""
        self.flush()
        self.counters.dispatches += recorded.dispatches
        self.counters.barriers += recorded.barriers
        if during is None:
            self.submit_and_wait(recorded.submit, recorded.timeline)
            return
        lib, gate = self.lib, recorded.gate
        if gate is not None:
            check_result(lib.vkResetEvent(self.device, gate[0]), "vkResetEvent")
        self._queue_submit(recorded.submit)
        self.counters.host_overlaps += 1
        self.in_flight = recorded
        try:
            during()
        finally:
            self.in_flight = None
            if gate is not None:  # without it the submitted step cannot complete
                check_result(lib.vkSetEvent(self.device, gate[0]), "vkSetEvent")
            self._wait(recorded.timeline)

    def free_recorded(self, recorded: RecordedCommands) -> None:
        self.vk.vkFreeCommandBuffers(self.device, self.pool, 1, [recorded.cmd])
        if recorded.gate is not None:
            self.lib.vkDestroyEvent(self.device, recorded.gate[0], self.ffi.NULL)
            recorded.gate = None
        if recorded.timeline is not None:
            recorded.timeline.destroy()
            recorded.timeline = None

    # -- submission -----------------------------------------------------------------
    def flush(self) -> None:
        """Submit what was recorded and block until the device finishes it."""
        if self.capturing:
            raise NotReplayable("the host needs device results while a step is being recorded for "
                                "replay; recorded steps must not read back or upload mid-step")
        if self.in_flight is not None:
            raise VkrtError("the host work of a replayed step needs device results; it may only "
                            "write the step's late inputs")
        if not self.recording:
            return
        lib = self.lib
        lib.vkCmdPipelineBarrier(self.cmd, self._stages, self.vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                                 self._host_barrier, 0, self.ffi.NULL, 0, self.ffi.NULL)
        if self._timeline is not None:
            self._timeline.end(self.cmd)
        lib.vkEndCommandBuffer(self.cmd)
        self.recording = False
        if self.recorded:
            try:
                self.submit_and_wait(self._submit, self._timeline)
            except OutOfDeviceMemory:
                self._reset_open()  # refused, so nothing of it is pending: the next batch starts clean
                raise
        self._reset_open()

    def discard(self) -> None:
        """Drop the open batch unsubmitted (a step failed; its results are not wanted), so the
        next step records into a clean command buffer. Every submit is waited for, so nothing
        is pending on the device and the frees deferred under the batch can be released."""
        if self.capturing or self.in_flight is not None:
            return  # a capture ends itself (VulkanBackend.capture); a replay always waits
        if self.recording:
            self.lib.vkEndCommandBuffer(self.cmd)
            self.recording = False
        self._reset_open()

    def _reset_open(self) -> None:
        """Make the open command buffer empty again and release what waited on its completion."""
        self.recorded = 0
        self.lib.vkResetCommandBuffer(self.cmd, 0)
        self.referenced.clear()
        self._written.clear()
        self._read.clear()
        self.keepalive.clear()
        deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        for alloc in deferred:
            self._release(alloc)
        views, self._deferred_views, self._reuse_barrier = self._deferred_views, [], False
        for alloc in views:
            self._release_views(alloc)

    def submit_and_wait(self, submit_info: Any, timeline: QueryTimeline | None = None) -> None:
        self._queue_submit(submit_info)
        self._wait(timeline)

    def _queue_submit(self, submit_info: Any) -> None:
        check_result(self.lib.vkQueueSubmit(self.queue, 1, submit_info, self.fence), "vkQueueSubmit")
        self.counters.submits += 1

    def _wait(self, timeline: QueryTimeline | None) -> None:
        """Block until the submitted work completes (the fence), then take its GPU time."""
        lib = self.lib
        waited = time.perf_counter_ns()
        result = lib.vkWaitForFences(self.device, 1, self._fence_array, 1, FENCE_TIMEOUT_NS)
        self.counters.wait_us += (time.perf_counter_ns() - waited) // 1000
        self.counters.fence_waits += 1
        check_result(result, "vkWaitForFences")  # on failure the work may be pending: the fence stays set
        lib.vkResetFences(self.device, 1, self._fence_array)
        if timeline is not None:
            # The fence has signalled, so the queries are available: no waiting here.
            ns = self.profiler.add(timeline) if self.profiler.enabled else timeline.span_ns()
            ns += self._gpu_ns_rest
            self.counters.gpu_us += ns // 1000
            self._gpu_ns_rest = ns % 1000

    def close(self) -> None:
        self.flush()
        vk = self.vk
        if self._timeline is not None:
            self._timeline.destroy()
        vk.vkDestroyFence(self.device, self.fence, None)
        vk.vkDestroyCommandPool(self.device, self.pool, None)
