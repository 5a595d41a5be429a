"""Descriptor sets, made once per (pipeline layout, bound allocations) and reused.

Activation and weight tensors persist across steps, so the same sets serve every step
without vkUpdateDescriptorSets in the hot path. Sets die with the allocations they name.
"""

from __future__ import annotations

from typing import Any

from vkrt.backend.vulkan.memory import Allocation

TEXEL_FORMATS = {
    "f32": "VK_FORMAT_R32_SFLOAT",
    "f32x4": "VK_FORMAT_R32G32B32A32_SFLOAT",
    "u32": "VK_FORMAT_R32_UINT",
    "u32x2": "VK_FORMAT_R32G32_UINT",
    "u32x4": "VK_FORMAT_R32G32B32A32_UINT",
    "i32": "VK_FORMAT_R32_SINT",
}
TEXEL_BYTES = {"f32": 4, "f32x4": 16, "u32": 4, "u32x2": 8, "u32x4": 16, "i32": 4}
POOL_SETS = 2048


class DescriptorCache:
    def __init__(self, vk: Any, device: Any) -> None:
        self.vk, self.device = vk, device
        self._pools: list[Any] = []
        self._free_in_pool = 0
        self._sets: dict[tuple, tuple[Any, Any, int]] = {}  # key -> (set, set_ptr cdata, pool index)
        self._by_alloc: dict[int, list[tuple]] = {}
        self.created = 0

    def _new_pool(self) -> None:
        vk = self.vk
        sizes = [vk.VkDescriptorPoolSize(type=getattr(vk, t), descriptorCount=POOL_SETS * 8)
                 for t in ("VK_DESCRIPTOR_TYPE_STORAGE_BUFFER", "VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER",
                           "VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER", "VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER")]
        self._pools.append(vk.vkCreateDescriptorPool(self.device, vk.VkDescriptorPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
            flags=vk.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT,
            maxSets=POOL_SETS, poolSizeCount=len(sizes), pPoolSizes=sizes), None))
        self._free_in_pool = POOL_SETS

    def texel_view(self, alloc: Allocation, kind: str) -> Any:
        view = alloc.views.get(kind)
        if view is None:
            vk = self.vk
            size = alloc.size // TEXEL_BYTES[kind] * TEXEL_BYTES[kind]
            view = vk.vkCreateBufferView(self.device, vk.VkBufferViewCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_BUFFER_VIEW_CREATE_INFO, buffer=alloc.block.buffer,
                format=getattr(vk, TEXEL_FORMATS[kind]), offset=alloc.offset, range=size), None)
            alloc.views[kind] = view
        return view

    def get(self, pipeline: Any, bound: list[tuple[Allocation, str]]) -> Any:
        """A `VkDescriptorSet[1]` cdata for `pipeline` with `bound` (allocation, view kind) per binding."""
        key = (id(pipeline.set_layout), tuple((a.id, kind) for a, kind in bound))
        hit = self._sets.get(key)
        if hit is not None:
            return hit[1]
        vk = self.vk
        if self._free_in_pool == 0 or not self._pools:
            self._new_pool()
        pool_index = len(self._pools) - 1
        dset = vk.vkAllocateDescriptorSets(self.device, vk.VkDescriptorSetAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, descriptorPool=self._pools[pool_index],
            descriptorSetCount=1, pSetLayouts=[pipeline.set_layout]))[0]
        self._free_in_pool -= 1
        writes = []
        for meta, (alloc, kind) in zip(pipeline.bindings, bound, strict=True):
            dtype = meta["type"]
            common = {"sType": vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, "dstSet": dset,
                      "dstBinding": meta["binding"], "descriptorCount": 1}
            if dtype in ("uniform_texel_buffer", "storage_texel_buffer"):
                writes.append(vk.VkWriteDescriptorSet(
                    descriptorType=getattr(vk, "VK_DESCRIPTOR_TYPE_" + dtype.upper()),
                    pTexelBufferView=[self.texel_view(alloc, kind)], **common))
            else:
                info = vk.VkDescriptorBufferInfo(buffer=alloc.block.buffer, offset=alloc.offset, range=alloc.size)
                writes.append(vk.VkWriteDescriptorSet(
                    descriptorType=getattr(vk, "VK_DESCRIPTOR_TYPE_" + dtype.upper()),
                    pBufferInfo=[info], **common))
        vk.vkUpdateDescriptorSets(self.device, len(writes), writes, 0, None)
        set_ptr = vk.ffi.new("VkDescriptorSet[1]", [dset])
        self._sets[key] = (dset, set_ptr, pool_index)
        for alloc, _ in bound:
            self._by_alloc.setdefault(alloc.id, []).append(key)
        self.created += 1
        return set_ptr

    def forget(self, alloc: Allocation) -> None:
        """Free the sets that name `alloc` (called when its memory is released)."""
        for key in self._by_alloc.pop(alloc.id, ()):
            entry = self._sets.pop(key, None)
            if entry is not None:
                self.vk.vkFreeDescriptorSets(self.device, self._pools[entry[2]], 1, [entry[0]])

    def close(self) -> None:
        for pool in self._pools:
            self.vk.vkDestroyDescriptorPool(self.device, pool, None)
        self._pools.clear()
        self._sets.clear()
