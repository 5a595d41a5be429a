"""The Vulkan backend (the only package that imports `vulkan`)."""

from vkrt.backend.vulkan.backend import VulkanBackend

__all__ = ["VulkanBackend"]
