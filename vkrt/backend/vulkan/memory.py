"""Device memory: large blocks, sub-allocated, accounted per purpose.

Unified-memory devices (llvmpipe, iGPUs, GB10) use one host-visible device-local type for
everything, written and read through persistent mappings. Elsewhere weights, KV and
activations live in device-local memory and move through host-visible staging; small
per-step inputs live in host-visible memory so a replayed step only needs a memcpy.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.errors import OutOfDeviceMemory

log = logging.getLogger("vkrt")

PURPOSES = ("weights", "kv", "activations", "inputs", "staging")
HOST_PURPOSES = ("inputs", "staging")
DEFAULT_BLOCK = 64 << 20
# Activations, step inputs and staging are small and short-lived: smaller blocks waste less.
TRANSIENT_BLOCK = 8 << 20
_ids = itertools.count(1)


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(eq=False)
class Block:
    memory: Any
    buffer: Any
    size: int
    host_visible: bool
    mapped: np.ndarray | None  # uint8 view of the persistent mapping
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, size), sorted
    dedicated: bool = False
    reserved: int = 0  # bytes of VkDeviceMemory behind it (the driver may round `size` up)


@dataclass(eq=False)
class Allocation:
    """A range of one block. `views` caches the texel-buffer views made on it."""

    block: Block
    offset: int
    size: int
    purpose: str
    id: int = field(default_factory=lambda: next(_ids))
    views: dict[str, Any] = field(default_factory=dict)
    freed: bool = False

    @property
    def host_visible(self) -> bool:
        return self.block.host_visible

    def host_view(self) -> np.ndarray:
        assert self.block.mapped is not None
        return self.block.mapped[self.offset : self.offset + self.size]


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


class MemoryManager:
    def __init__(self, vk: Any, device: Any, physical: Any, caps: DeviceCaps, force_staging: bool) -> None:
        self.vk, self.device, self.caps = vk, device, caps
        props = vk.vkGetPhysicalDeviceMemoryProperties(physical)
        self._types = [(props.memoryTypes[i].propertyFlags, props.memoryTypes[i].heapIndex)
                       for i in range(props.memoryTypeCount)]
        self._heaps = [props.memoryHeaps[i].size for i in range(props.memoryHeapCount)]
        self.unified = caps.unified_memory and not force_staging
        self.alignment = max(caps.min_storage_align, caps.min_texel_align, caps.min_uniform_align, 64)
        self.block_size = min(DEFAULT_BLOCK, caps.max_allocation)
        self._pools: dict[tuple[bool, str], list[Block]] = {}
        self.in_use: dict[str, int] = dict.fromkeys(PURPOSES, 0)
        self.reserved = 0  # bytes of VkDeviceMemory held
        self.peak_reserved = 0
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_UNIFORM_TEXEL_BUFFER_BIT
                 | vk.VK_BUFFER_USAGE_UNIFORM_BUFFER_BIT | vk.VK_BUFFER_USAGE_STORAGE_TEXEL_BUFFER_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        self._usage = usage

    # -- memory types ---------------------------------------------------------------
    def _memory_type(self, type_bits: int, host_visible: bool) -> int:
        vk = self.vk
        host = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        local = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
        if host_visible:
            prefs = [host | local, host] if self.unified else [host | vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT, host]
        else:
            prefs = [local]
        for want in prefs:
            for i, (flags, _heap) in enumerate(self._types):
                if type_bits & (1 << i) and (flags & want) == want:
                    return i
        raise OutOfDeviceMemory(f"{self.caps.name} has no suitable memory type", requested=0)

    def _check_heap(self, size: int, purpose: str) -> None:
        if self.reserved + size > max(self._heaps):
            self._refuse(size, purpose)

    def _refuse(self, size: int, purpose: str) -> NoReturn:
        raise OutOfDeviceMemory(
            f"cannot allocate {format_bytes(size)} for {purpose} on {self.caps.name}: "
            f"{format_bytes(self.reserved)} of {format_bytes(max(self._heaps))} already reserved, "
            f"max single allocation {format_bytes(self.caps.max_allocation)}; use a smaller model, "
            "a smaller KV cache (--kv-cache-memory) or a shorter context",
            requested=size, purpose=purpose)

    def _new_block(self, size: int, host_visible: bool, purpose: str, dedicated: bool) -> Block:
        vk = self.vk
        if size > self.caps.max_allocation:
            self._refuse(size, purpose)
        self._check_heap(size, purpose)
        buffer = vk.vkCreateBuffer(self.device, vk.VkBufferCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size, usage=self._usage,
            sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        req = vk.vkGetBufferMemoryRequirements(self.device, buffer)
        type_index = self._memory_type(req.memoryTypeBits, host_visible)
        try:
            memory = vk.vkAllocateMemory(self.device, vk.VkMemoryAllocateInfo(
                sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=req.size,
                memoryTypeIndex=type_index), None)
        except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as exc:
            vk.vkDestroyBuffer(self.device, buffer, None)
            raise OutOfDeviceMemory(f"the device refused {format_bytes(size)} for {purpose} "
                                    f"({type(exc).__name__}); {format_bytes(self.reserved)} in use",
                                    requested=size, purpose=purpose) from exc
        vk.vkBindBufferMemory(self.device, buffer, memory, 0)
        mapped = None
        # Map only what the host path uses; with VKRT_FORCE_STAGING a unified device then
        # exercises the staging copies that discrete GPUs need.
        is_host = host_visible
        if is_host:
            raw = vk.vkMapMemory(self.device, memory, 0, size, 0)
            mapped = np.frombuffer(raw, dtype=np.uint8, count=size)
        self.reserved += req.size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Block(memory, buffer, size, is_host, mapped, [(0, size)], dedicated, req.size)

    # -- sub-allocation ---------------------------------------------------------------
    def _pool(self, purpose: str) -> tuple[list[Block], bool, int]:
        """Weights and KV pool separately from short-lived memory, per memory kind."""
        host_visible = self.unified or purpose in HOST_PURPOSES
        kind = purpose if purpose in ("weights", "kv") else "transient"
        block_size = self.block_size if kind != "transient" else min(TRANSIENT_BLOCK, self.block_size)
        return self._pools.setdefault((host_visible, kind), []), host_visible, block_size

    def reserve(self, purpose: str, nbytes: int) -> None:
        """Make one block of exactly `nbytes` for `purpose` (a model's weights, a KV cache), so
        the tensors that follow pack into it with no partly used block left over."""
        if nbytes <= 0:
            return
        size = _align(nbytes, self.alignment)
        if size > self.caps.max_allocation:
            # More than one allocation may hold: the tensors take blocks as they come (one too
            # large for any block fails then, as its own size), but the heap must hold them all.
            self._check_heap(size, purpose)
            return
        pool, host_visible, _ = self._pool(purpose)
        pool.insert(0, self._new_block(size, host_visible, purpose, dedicated=False))

    def alloc(self, size: int, purpose: str) -> Allocation:
        size = _align(max(size, 4), self.alignment)
        pool, host_visible, block_size = self._pool(purpose)
        found = self._first_fit(pool, size, purpose)
        if found is not None:
            return found
        if size > block_size // 2:
            block = self._new_block(size, host_visible, purpose, dedicated=True)
            block.free = []
            self.in_use[purpose] += size
            return Allocation(block, 0, size, purpose)
        pool.append(self._new_block(block_size, host_visible, purpose, dedicated=False))
        found = self._first_fit(pool, size, purpose)
        assert found is not None
        return found

    def _first_fit(self, pool: list[Block], size: int, purpose: str) -> Allocation | None:
        for block in pool:
            for i, (offset, free_size) in enumerate(block.free):
                if free_size >= size:
                    if free_size == size:
                        del block.free[i]
                    else:
                        block.free[i] = (offset + size, free_size - size)
                    self.in_use[purpose] += size
                    return Allocation(block, offset, size, purpose)
        return None

    def free(self, a: Allocation) -> None:
        if a.freed:
            return
        self.destroy_views(a)
        self.release_range(a)

    def destroy_views(self, a: Allocation) -> None:
        for view in a.views.values():
            self.vk.vkDestroyBufferView(self.device, view, None)
        a.views.clear()

    def release_range(self, a: Allocation) -> None:
        """Return the bytes to the free list (the block of a dedicated allocation is destroyed)."""
        if a.freed:
            return
        a.freed = True
        self.in_use[a.purpose] -= a.size
        block = a.block
        if block.dedicated:
            self._destroy(block)
            return
        block.free.append((a.offset, a.size))
        block.free.sort()
        merged: list[tuple[int, int]] = []
        for offset, size in block.free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        block.free = merged
        if merged == [(0, block.size)] and a.purpose in ("weights", "kv"):
            # A model or KV cache went away: give its memory back rather than keep an empty
            # block that the next model's exact-size reservation would sit beside.
            for pool in self._pools.values():
                if block in pool:
                    pool.remove(block)
            self._destroy(block)

    def _destroy(self, block: Block) -> None:
        vk = self.vk
        if block.mapped is not None:
            vk.vkUnmapMemory(self.device, block.memory)
        vk.vkDestroyBuffer(self.device, block.buffer, None)
        vk.vkFreeMemory(self.device, block.memory, None)
        self.reserved -= block.reserved

    def stats(self) -> dict[str, int]:
        return {**{f"{k}_bytes": v for k, v in self.in_use.items()},
                "reserved_bytes": self.reserved, "peak_reserved_bytes": self.peak_reserved}

    def footprint(self, size: int) -> int:
        """Bytes an allocation of `size` takes from its block (as `alloc` rounds it)."""
        return _align(max(size, 4), self.alignment)

    def close(self) -> None:
        for pool in self._pools.values():
            for block in pool:
                self._destroy(block)
            pool.clear()
