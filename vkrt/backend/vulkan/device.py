"""Vulkan instance, physical-device ranking and selection, capability probe, logical device."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from vkrt import config
from vkrt.errors import DeviceUnavailable, VkrtError

log = logging.getLogger("vkrt")

DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
# Selection preference: discrete > integrated > virtual > CPU (llvmpipe stays usable).
TYPE_RANK = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}
SUBGROUP_OPS = {1: "basic", 2: "vote", 4: "arithmetic", 8: "ballot", 16: "shuffle",
                32: "shuffle_relative", 64: "clustered", 128: "quad"}


def load_vulkan() -> Any:
    """The `vulkan` module, or DeviceUnavailable saying why it cannot be used."""
    if config.disable_vulkan():
        raise DeviceUnavailable("VKRT_DISABLE_VULKAN=1 is set")
    try:
        import vulkan
    except ImportError as exc:
        raise DeviceUnavailable(f"the Vulkan loader could not be loaded ({exc}); install "
                                "libvulkan1 and a driver such as mesa-vulkan-drivers") from exc
    except OSError as exc:  # cffi raises OSError when libvulkan.so is missing
        raise DeviceUnavailable(f"libvulkan is not installed ({exc}); apt-get install "
                                "libvulkan1 mesa-vulkan-drivers") from exc
    return vulkan


@dataclass
class DeviceCaps:
    """Everything vkrt needs to know about a device, probed once."""

    index: int
    name: str
    device_type: str
    vendor_id: int
    device_id: int
    driver_version: int
    api_version: str
    pipeline_cache_uuid: str
    storage_buffer_16bit: bool = False
    storage_buffer_8bit: bool = False
    shader_float16: bool = False
    shader_int8: bool = False
    shader_int16: bool = False
    shader_int64: bool = False
    subgroup_size: int = 1
    subgroup_ops: list[str] = field(default_factory=list)
    max_shared_memory: int = 0
    max_allocation: int = 0
    max_storage_range: int = 0
    max_uniform_range: int = 0
    max_texel_elements: int = 0
    max_push_constants: int = 0
    max_workgroup_invocations: int = 0
    min_storage_align: int = 16
    min_uniform_align: int = 16
    min_texel_align: int = 16
    device_local_bytes: int = 0
    unified_memory: bool = False
    timestamp_period_ns: float = 0.0
    # Valid bits of timestamps on the compute queue vkrt uses; 0 = no timestamp queries.
    timestamp_valid_bits: int = 0
    access_path: str = "ssbo"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def create_instance(vk: Any) -> Any:
    app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName="vkrt",
                               applicationVersion=1, pEngineName="vkrt", engineVersion=1,
                               apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
    info = vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
    try:
        return vk.vkCreateInstance(info, None)
    except Exception as exc:  # VkError subclasses when no ICD is present
        raise DeviceUnavailable(f"vkCreateInstance failed ({type(exc).__name__}); is a Vulkan "
                                "driver installed? (apt-get install mesa-vulkan-drivers)") from exc


def probe(vk: Any, physical: Any, index: int) -> DeviceCaps:
    """Read properties, limits, features and memory heaps of one physical device."""
    ffi, lib = vk.ffi, vk.lib
    props = vk.vkGetPhysicalDeviceProperties(physical)
    limits = props.limits
    caps = DeviceCaps(
        index=index,
        name=ffi.string(props.deviceName).decode() if not isinstance(props.deviceName, str) else props.deviceName,
        device_type=DEVICE_TYPES.get(props.deviceType, "other"),
        vendor_id=props.vendorID,
        device_id=props.deviceID,
        driver_version=props.driverVersion,
        api_version=_version(props.apiVersion),
        pipeline_cache_uuid=bytes(props.pipelineCacheUUID).hex(),
        max_shared_memory=limits.maxComputeSharedMemorySize,
        max_storage_range=limits.maxStorageBufferRange,
        max_uniform_range=limits.maxUniformBufferRange,
        max_texel_elements=limits.maxTexelBufferElements,
        max_push_constants=limits.maxPushConstantsSize,
        max_workgroup_invocations=limits.maxComputeWorkGroupInvocations,
        min_storage_align=limits.minStorageBufferOffsetAlignment,
        min_uniform_align=limits.minUniformBufferOffsetAlignment,
        min_texel_align=limits.minTexelBufferOffsetAlignment,
        timestamp_period_ns=float(limits.timestampPeriod),
    )
    # Vulkan 1.1/1.2 feature and property structs, chained by hand (raw cffi).
    f11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES})
    f12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES})
    f11.pNext = f12
    feats = ffi.new("VkPhysicalDeviceFeatures2*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": f11})
    lib.vkGetPhysicalDeviceFeatures2(physical, feats)
    caps.storage_buffer_16bit = bool(f11.storageBuffer16BitAccess)
    caps.storage_buffer_8bit = bool(f12.storageBuffer8BitAccess)
    caps.shader_float16 = bool(f12.shaderFloat16)
    caps.shader_int8 = bool(f12.shaderInt8)
    caps.shader_int16 = bool(feats.features.shaderInt16)
    caps.shader_int64 = bool(feats.features.shaderInt64)
    sub = ffi.new("VkPhysicalDeviceSubgroupProperties*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES})
    maint3 = ffi.new("VkPhysicalDeviceMaintenance3Properties*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES, "pNext": sub})
    props2 = ffi.new("VkPhysicalDeviceProperties2*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, "pNext": maint3})
    lib.vkGetPhysicalDeviceProperties2(physical, props2)
    caps.subgroup_size = int(sub.subgroupSize)
    caps.subgroup_ops = [name for bit, name in SUBGROUP_OPS.items() if sub.supportedOperations & bit]
    caps.max_allocation = int(maint3.maxMemoryAllocationSize)
    family = compute_family(vk, physical)
    if family is not None and caps.timestamp_period_ns > 0:
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(physical)
        caps.timestamp_valid_bits = int(families[family].timestampValidBits)
    mem = vk.vkGetPhysicalDeviceMemoryProperties(physical)
    local_heaps = [mem.memoryHeaps[i] for i in range(mem.memoryHeapCount)
                   if mem.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT]
    caps.device_local_bytes = int(max((h.size for h in local_heaps), default=0))
    want = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
    # Unified memory: the largest device-local heap is also host visible (llvmpipe, iGPUs, GB10).
    for i in range(mem.memoryTypeCount):
        mt = mem.memoryTypes[i]
        if (mt.propertyFlags & want) == want and mem.memoryHeaps[mt.heapIndex].size == caps.device_local_bytes:
            caps.unified_memory = True
    caps.access_path = default_access_path(caps)
    override = config.access_path_override()
    if override:
        if override not in ("texel", "ssbo"):
            raise VkrtError(f"VKRT_ACCESS must be 'texel' or 'ssbo', not {override!r}")
        caps.access_path = override
    return caps


def default_access_path(caps: DeviceCaps) -> str:
    """Kernels read weights through read-only storage texel buffers on CPU devices, where
    storage-buffer loads measured ~20x slower; GPUs take storage buffers (docs/ARCHITECTURE.md)."""
    return "texel" if caps.device_type == "cpu" else "ssbo"


def enumerate_devices(vk: Any, instance: Any) -> list[tuple[Any, DeviceCaps]]:
    physicals = vk.vkEnumeratePhysicalDevices(instance)
    if not physicals:
        raise DeviceUnavailable("the Vulkan loader found no devices (apt-get install mesa-vulkan-drivers "
                                "for the llvmpipe software device)")
    return [(p, probe(vk, p, i)) for i, p in enumerate(physicals)]


def choose(devices: list[tuple[Any, DeviceCaps]]) -> tuple[Any, DeviceCaps]:
    """Apply VKRT_DEVICE (index or name substring), else the best-ranked type, then index."""
    selector = config.device_selector()
    if selector is not None:
        if selector.isdigit():
            index = int(selector)
            if index >= len(devices):
                raise DeviceUnavailable(f"VKRT_DEVICE={selector}: only {len(devices)} device(s) present")
            return devices[index]
        matches = [d for d in devices if selector.lower() in d[1].name.lower()]
        if not matches:
            names = ", ".join(f"{c.index}: {c.name}" for _, c in devices)
            raise DeviceUnavailable(f"VKRT_DEVICE={selector!r} matches no device ({names})")
        return matches[0]
    return min(devices, key=lambda d: (TYPE_RANK[d[1].device_type], d[1].index))


def compute_family(vk: Any, physical: Any) -> int | None:
    """The queue family vkrt submits to: the first with compute."""
    families = vk.vkGetPhysicalDeviceQueueFamilyProperties(physical)
    return next((i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT), None)


def create_device(vk: Any, physical: Any, caps: DeviceCaps) -> tuple[Any, Any, int]:
    """Logical device with one compute queue; enables only the optional features present."""
    family = compute_family(vk, physical)
    if family is None:
        raise DeviceUnavailable(f"{caps.name} has no compute queue")
    queue_info = vk.VkDeviceQueueCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                            queueFamilyIndex=family, queueCount=1, pQueuePriorities=[1.0])
    ffi = vk.ffi
    f12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
        "storageBuffer8BitAccess": int(caps.storage_buffer_8bit),
        "shaderFloat16": int(caps.shader_float16), "shaderInt8": int(caps.shader_int8)})
    f11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, "pNext": f12,
        "storageBuffer16BitAccess": int(caps.storage_buffer_16bit)})
    features = vk.VkPhysicalDeviceFeatures(shaderInt16=int(caps.shader_int16), shaderInt64=int(caps.shader_int64))
    info = vk.VkDeviceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=f11,
                                 queueCreateInfoCount=1, pQueueCreateInfos=[queue_info],
                                 pEnabledFeatures=features)
    device = vk.vkCreateDevice(physical, info, None)
    queue = vk.vkGetDeviceQueue(device, family, 0)
    return device, queue, family
