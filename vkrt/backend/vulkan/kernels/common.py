"""Helpers shared by kernel families: grid sizes, module names, the workgroup spec constant."""

from __future__ import annotations

import struct
from typing import Any

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


def module(backend: Any, family: str, *variant: str) -> str:
    """Module name of a shader variant on this device's access path."""
    return ".".join((family, *variant, backend.caps.access_path))


def local_size(workgroup: int = WORKGROUP) -> dict[int, int]:
    return {0: workgroup}
