"""Compute pipelines from the committed SPIR-V, specialised per device, with a persisted cache."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkrt import config
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.errors import VkrtError

log = logging.getLogger("vkrt")

SPIRV_DIR = Path(__file__).resolve().parent.parent.parent / "spirv"
DESCRIPTOR_TYPES = {
    "storage_buffer": "VK_DESCRIPTOR_TYPE_STORAGE_BUFFER",
    "uniform_buffer": "VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER",
    "uniform_texel_buffer": "VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER",
    "storage_texel_buffer": "VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER",
}


class LayoutMismatch(VkrtError):
    """A kernel's host-side binding layout disagrees with the shader's manifest."""


def load_manifest() -> dict[str, Any]:
    path = SPIRV_DIR / "manifest.json"
    if not path.exists():
        raise VkrtError(f"{path} is missing; the package is incomplete (run `python -m spirv_gen`)")
    return json.loads(path.read_text())


@dataclass(eq=False)
class Pipeline:
    module: str
    pipeline: Any
    layout: Any
    set_layout: Any
    bindings: list[dict[str, Any]]
    push_constant_size: int


class PipelineCache:
    """Shader modules, layouts and pipelines, created on first use and kept."""

    def __init__(self, vk: Any, device: Any, caps: DeviceCaps) -> None:
        self.vk, self.device, self.caps = vk, device, caps
        self.manifest = load_manifest()
        self.modules_meta: dict[str, Any] = self.manifest["modules"]
        self._shader_modules: dict[str, Any] = {}
        self._set_layouts: dict[str, Any] = {}
        self._pipelines: dict[tuple, Pipeline] = {}
        key = hashlib.sha256(json.dumps([caps.name, caps.vendor_id, caps.device_id, caps.driver_version,
                                         caps.pipeline_cache_uuid,
                                         sorted(m["spirv_sha256"] for m in self.modules_meta.values())]
                                        ).encode()).hexdigest()[:24]
        self.cache_path = config.cache_dir() / "pipelines" / f"{key}.bin"
        initial = b""
        try:
            initial = self.cache_path.read_bytes()
        except OSError:
            pass
        self._vk_cache = self._create_vk_cache(initial)
        self.created = 0
        self.epoch = 0  # bumped by release_pipelines: graphs recorded before it are stale

    def _create_vk_cache(self, data: bytes) -> Any:
        vk, ffi = self.vk, self.vk.ffi
        buf = ffi.new("char[]", data) if data else ffi.NULL
        info = ffi.new("VkPipelineCacheCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
                                                      "initialDataSize": len(data), "pInitialData": buf})
        out = ffi.new("VkPipelineCache*")
        if vk.lib.vkCreatePipelineCache(self.device, info, ffi.NULL, out) != 0:
            info.initialDataSize = 0
            info.pInitialData = ffi.NULL
            vk.lib.vkCreatePipelineCache(self.device, info, ffi.NULL, out)
        return out[0]

    def meta(self, module: str) -> dict[str, Any]:
        try:
            return self.modules_meta[module]
        except KeyError:
            raise VkrtError(f"no SPIR-V module {module!r} in the manifest") from None

    def check_layout(self, module: str, expected: list[tuple[str, bool]]) -> None:
        """Refuse a kernel whose (descriptor type, written) per binding disagrees with the shader."""
        actual = [(b["type"], b["written"]) for b in self.meta(module)["bindings"]]
        if actual != expected:
            raise LayoutMismatch(f"kernel layout for {module} is {expected} but the shader's manifest "
                                 f"says {actual}; regenerate SPIR-V or fix the kernel")

    def _set_layout(self, module: str) -> Any:
        if module not in self._set_layouts:
            vk = self.vk
            entries = [vk.VkDescriptorSetLayoutBinding(binding=b["binding"],
                                                       descriptorType=getattr(vk, DESCRIPTOR_TYPES[b["type"]]),
                                                       descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                       for b in self.meta(module)["bindings"]]
            self._set_layouts[module] = vk.vkCreateDescriptorSetLayout(self.device, vk.VkDescriptorSetLayoutCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=len(entries),
                pBindings=entries), None)
        return self._set_layouts[module]

    def _shader_module(self, module: str) -> Any:
        if module not in self._shader_modules:
            vk = self.vk
            code = (SPIRV_DIR / f"{module}.spv").read_bytes()
            self._shader_modules[module] = vk.vkCreateShaderModule(self.device, vk.VkShaderModuleCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code), pCode=code), None)
        return self._shader_modules[module]

    def get(self, module: str, spec: dict[int, int] | None = None) -> Pipeline:
        """The pipeline for `module` with specialisation constants `spec` (id -> uint/int value)."""
        spec = spec or {}
        key = (module, tuple(sorted(spec.items())))
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            return pipeline
        vk, ffi = self.vk, self.vk.ffi
        meta = self.meta(module)
        declared = {int(k) for k in meta["spec_constants"]}
        unknown = set(spec) - declared
        if unknown:
            raise VkrtError(f"{module} has no specialisation constants {sorted(unknown)} (has {sorted(declared)})")
        set_layout = self._set_layout(module)
        ranges = []
        if meta["push_constant_size"]:
            ranges = [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0,
                                             size=meta["push_constant_size"])]
        layout = vk.vkCreatePipelineLayout(self.device, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=[set_layout],
            pushConstantRangeCount=len(ranges), pPushConstantRanges=ranges or None), None)
        items = sorted(spec.items())
        data = ffi.new("int32_t[]", [v for _, v in items] or [0])
        entries = [vk.VkSpecializationMapEntry(constantID=cid, offset=4 * i, size=4) for i, (cid, _) in enumerate(items)]
        spec_info = vk.VkSpecializationInfo(mapEntryCount=len(entries), pMapEntries=entries or None,
                                            dataSize=4 * len(items), pData=data) if items else None
        stage = vk.VkPipelineShaderStageCreateInfo(sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                                                   stage=vk.VK_SHADER_STAGE_COMPUTE_BIT,
                                                   module=self._shader_module(module), pName="main",
                                                   pSpecializationInfo=spec_info)
        info = vk.VkComputePipelineCreateInfo(sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
                                              stage=stage, layout=layout)
        handle = vk.vkCreateComputePipelines(self.device, self._vk_cache, 1, [info], None)[0]
        self.created += 1
        pipeline = Pipeline(module, handle, layout, set_layout, meta["bindings"], meta["push_constant_size"])
        self._pipelines[key] = pipeline
        return pipeline

    def save(self) -> None:
        """Persist the driver's pipeline cache so the next process skips the JIT."""
        vk, ffi = self.vk, self.vk.ffi
        size = ffi.new("size_t*")
        if vk.lib.vkGetPipelineCacheData(self.device, self._vk_cache, size, ffi.NULL) != 0 or not size[0]:
            return
        buf = ffi.new("char[]", size[0])
        if vk.lib.vkGetPipelineCacheData(self.device, self._vk_cache, size, buf) != 0:
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_path.with_suffix(".part")
            tmp.write_bytes(ffi.buffer(buf, size[0])[:])
            tmp.replace(self.cache_path)
        except OSError as exc:
            log.info("could not save the pipeline cache to %s: %s", self.cache_path, exc)

    def release_pipelines(self) -> int:
        """Destroy every pipeline (on llvmpipe each holds its JIT-compiled code, ~3 MB) while
        keeping shader modules and descriptor-set layouts; later dispatches create them again.
        The caller makes sure the device is idle and no recorded command buffer is replayed
        afterwards (the epoch tells). Returns how many were released."""
        vk = self.vk
        for p in self._pipelines.values():
            vk.vkDestroyPipeline(self.device, p.pipeline, None)
            vk.vkDestroyPipelineLayout(self.device, p.layout, None)
        released = len(self._pipelines)
        self._pipelines.clear()
        self.epoch += 1
        return released

    def close(self) -> None:
        vk = self.vk
        self.save()
        for p in self._pipelines.values():
            vk.vkDestroyPipeline(self.device, p.pipeline, None)
            vk.vkDestroyPipelineLayout(self.device, p.layout, None)
        for layout in self._set_layouts.values():
            vk.vkDestroyDescriptorSetLayout(self.device, layout, None)
        for module in self._shader_modules.values():
            vk.vkDestroyShaderModule(self.device, module, None)
        vk.vkDestroyPipelineCache(self.device, self._vk_cache, None)
        self._pipelines.clear()
