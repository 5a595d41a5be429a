"""vkrt: a Vulkan-first LLM inference runtime."""

from vkrt.errors import (
    DeviceLostError,
    ModelFormatError,
    OutOfDeviceMemory,
    RequestError,
    UnsupportedModelError,
    VkrtError,
)

__version__ = "0.1.0"

__all__ = [
    "DeviceLostError",
    "ModelFormatError",
    "OutOfDeviceMemory",
    "RequestError",
    "UnsupportedModelError",
    "VkrtError",
    "__version__",
]
