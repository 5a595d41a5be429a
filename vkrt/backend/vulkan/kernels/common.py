"""Helpers shared by kernel families: what a family needs of the backend, grid sizes, module
names, the workgroup spec constant."""

from __future__ import annotations

import struct
from typing import Protocol, cast

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.core.tensor import Tensor


class KernelBackend(Protocol):
    """What kernel families use of the Vulkan backend (VulkanBackend implements it)."""

    caps: DeviceCaps

    def register_kernel(self, kernel: Kernel) -> None: ...

    def empty(self, shape: tuple[int, ...], dtype: str, purpose: str = "activations") -> Tensor: ...

    def run_shader(self, module: str, bindings: list[tuple[Tensor, str, bool]], groups: tuple[int, int, int],
                   push: tuple[str, tuple] | None = None, spec: dict[int, int] | None = None) -> None: ...

    def copy_regions(self, src: Tensor, dst: Tensor, regions: list[tuple[int, int, int]]) -> None: ...


def backend_of(t: Tensor) -> KernelBackend:
    """The Vulkan backend a tensor lives on, as kernel code sees it (in `supports` checks)."""
    return cast(KernelBackend, t.backend)

MAX_GROUPS_X = 65535
WORKGROUP = 64  # default elementwise workgroup; spec constant 0 of every shader


def float_bits(value: float) -> int:
    """A float specialisation constant as the int32 its bits spell (pipelines take int32 data)."""
    return int(struct.unpack("<i", struct.pack("<f", value))[0])


def grid_1d(n: int, workgroup: int = WORKGROUP) -> tuple[int, int, int]:
    """Groups covering n invocations; shaders fold y back in as gid.y * numGroups.x * size."""
    groups = max(1, -(-n // workgroup))
    x = min(groups, MAX_GROUPS_X)
    return (x, -(-groups // x), 1)


def module(backend: KernelBackend, family: str, *variant: str) -> str:
    """Module name of a shader variant on this device's access path."""
    return ".".join((family, *variant, backend.caps.access_path))


def local_size(workgroup: int = WORKGROUP) -> dict[int, int]:
    return {0: workgroup}
