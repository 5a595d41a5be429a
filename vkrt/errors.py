"""Typed errors. Each message says what failed, where, and what to do about it."""

from __future__ import annotations


class VkrtError(Exception):
    """Base class of every error vkrt raises on purpose."""


class ModelFormatError(VkrtError):
    """A model file or directory is missing, truncated or malformed."""


class NoTokenizerError(ModelFormatError):
    """A model ships no tokenizer at all (weights only): only token-id prompts can work."""


class UnsupportedModelError(VkrtError):
    """The model is well formed but uses an architecture or tensor type vkrt lacks."""


class OutOfDeviceMemory(VkrtError):
    """An allocation does not fit on the device."""

    def __init__(self, message: str, *, requested: int = 0, purpose: str = "") -> None:
        super().__init__(message)
        self.requested = requested
        self.purpose = purpose


class DeviceLostError(VkrtError):
    """The device stopped executing work (VK_ERROR_DEVICE_LOST: a driver reset, a hang, a GPU
    fallen off the bus). Nothing on it can be trusted or run again: restart the process."""


class RequestError(VkrtError):
    """A generation request is invalid (bad parameter, prompt too long, ...).

    `param` names the offending parameter; `code` is a machine-readable reason where one
    is worth telling apart (the server sends it as the OpenAI error `code`); `details` are
    numbers a client may act on (the server adds them to the error object).
    """

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, details: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code
        self.details = details or {}


class DeviceUnavailable(VkrtError):
    """No usable Vulkan loader or device; callers fall back to the reference backend."""


class NotReplayable(VkrtError):
    """A step being recorded for replay needed the host mid-step (an op without a native
    kernel drains); the caller runs such steps eagerly instead."""
