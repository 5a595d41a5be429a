"""The fault hook for device-loss and out-of-memory tests: Vulkan result codes injected where
the backend meets them, so the typed errors, the engine's handling and the server's answers
are exercised on a real device without waiting for a driver to fail."""

from __future__ import annotations

from typing import Any

import pytest

from vkrt.backend.base import Backend
from vkrt.backend.vulkan.activation_pool import ActivationPool
from vkrt.backend.vulkan.batch import VK_ERROR_DEVICE_LOST, VK_ERROR_OUT_OF_DEVICE_MEMORY

__all__ = ["VK_ERROR_DEVICE_LOST", "VK_ERROR_OUT_OF_DEVICE_MEMORY", "FailingLib", "inject", "refuse_allocation"]


class FailingLib:
    """`vulkan.lib` whose `call` (vkQueueSubmit or vkWaitForFences) answers `result` on its
    `nth` call from now, once (`every`: on that call and all later ones)."""

    def __init__(self, lib: Any, call: str, result: int, nth: int, every: bool = False) -> None:
        self._lib, self._call, self._result, self._nth, self._every = lib, call, result, nth, every
        self.calls = 0
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        if name != self._call:
            return getattr(self._lib, name)
        return self._intercept

    def _intercept(self, *args: Any) -> int:
        self.calls += 1
        real = getattr(self._lib, self._call)
        if self.calls < self._nth or (self.calls > self._nth and not self._every):
            return int(real(*args))
        self.failed += 1
        if self._call == "vkWaitForFences":
            # The work was submitted: let it finish and reset the fence, so the shared test
            # backend is clean for later tests, then report the fault as a driver would.
            real(*args)
            self._lib.vkResetFences(args[0], args[1], args[2])
        return self._result


def inject(monkeypatch: pytest.MonkeyPatch, backend: Backend, call: str, result: int, nth: int,
           every: bool = False) -> FailingLib:
    """Make the Vulkan `backend`'s `call` fail with `result` on its `nth` call from now."""
    batch = backend.batch  # type: ignore[attr-defined]
    hook = FailingLib(batch.lib, call, result, nth, every)
    monkeypatch.setattr(batch, "lib", hook)
    return hook



def refuse_allocation(monkeypatch: pytest.MonkeyPatch, backend: Backend, nth: int) -> list[int]:
    """Make the Vulkan `backend`'s `nth` activation allocation from now fail as a full device's
    does (the memory manager's own refusal), in the middle of recording a step. Returns the
    sizes asked for so far."""
    memory = backend.memory  # type: ignore[attr-defined]
    alloc, asked = memory.alloc, []
    # Pooled tensors never ask the allocator: with the pool off, every activation does.
    monkeypatch.setattr(backend, "activations", ActivationPool(0))

    def refusing(size: int, purpose: str) -> Any:
        if purpose == "activations":
            asked.append(size)
            if len(asked) == nth:
                memory._refuse(size, purpose)
        return alloc(size, purpose)

    monkeypatch.setattr(memory, "alloc", refusing)
    return asked
