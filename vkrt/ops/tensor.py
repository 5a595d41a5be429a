"""`Tensor`: an array that lives on one backend, in one storage format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from vkrt.backend.base import Backend

# Activation dtypes and how numpy holds them (bf16 as its raw uint16 bits).
NUMPY_DTYPES: dict[str, Any] = {
    "f32": np.float32,
    "f16": np.float16,
    "bf16": np.uint16,
    "i32": np.int32,
    "u32": np.uint32,
}

# Bytes per block and values per block of the GGUF block formats.
BLOCK_LAYOUT: dict[str, tuple[int, int]] = {
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "q4_k": (144, 256),
    "q6_k": (210, 256),
}
FLOAT_WEIGHT_DTYPES = ("f32", "f16", "bf16")
ALL_DTYPES = tuple(NUMPY_DTYPES) + tuple(BLOCK_LAYOUT)


def is_block_format(dtype: str) -> bool:
    return dtype in BLOCK_LAYOUT


def storage_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes a tensor of this logical shape occupies in its storage format."""
    count = int(np.prod(shape)) if shape else 1
    if dtype in BLOCK_LAYOUT:
        block_bytes, block_values = BLOCK_LAYOUT[dtype]
        if shape[-1] % block_values:
            raise ValueError(f"{dtype} rows must be a multiple of {block_values} values, got {shape}")
        return count // block_values * block_bytes
    return count * np.dtype(NUMPY_DTYPES[dtype]).itemsize


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype, without storage: what op signatures check and infer."""

    shape: tuple[int, ...]
    dtype: str


class Tensor:
    """A handle to backend storage. `shape` is logical; block formats pack rows of blocks.

    A tensor may be *pending*: the result of an op the fusion layer (vkrt.ops.fusion) has not
    run yet, because a consumer may still fold it into a fused kernel. Touching `handle` runs
    it, so backends never see a pending tensor. `base` keeps alive the tensor whose storage
    this one uses (the realised result of a pending op, or the tensor a view was made of).
    """

    __slots__ = ("shape", "dtype", "backend", "_handle", "pending", "base", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: str, backend: Backend, handle: Any,
                 base: Tensor | None = None) -> None:
        if dtype not in ALL_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.backend = backend
        self._handle = handle
        self.pending: Any = None  # a vkrt.ops.fusion.Pending until realised
        self.base = base

    @property
    def handle(self) -> Any:
        if self.pending is not None:
            self.pending.realize(self)
        return self._handle

    @handle.setter
    def handle(self, value: Any) -> None:
        self._handle = value

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype)

    @property
    def nbytes(self) -> int:
        return storage_nbytes(self.shape, self.dtype)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def numpy(self) -> np.ndarray:
        """Copy the contents to the host (blocks the device if work on it is pending)."""
        return self.backend.read(self)

    def __repr__(self) -> str:
        return f"Tensor({self.shape}, {self.dtype}, {self.backend.name})"
