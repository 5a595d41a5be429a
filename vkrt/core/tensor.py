"""`Tensor`: an array that lives on one backend, in one storage format.

The floor every layer stands on: a tensor knows its backend only through `TensorBackend`,
the few methods ops and tensors call on it, so nothing here (or in vkrt.ops) imports a
backend; vkrt.backend implements the protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vkrt.core.formats import BLOCK_FORMATS, FLOAT_FORMATS, FORMATS

if TYPE_CHECKING:
    from vkrt.core.op import OpDef

# Activation dtypes and how numpy holds them (bf16 as its raw uint16 bits).
NUMPY_DTYPES: dict[str, Any] = {
    "f32": np.float32,
    "f16": np.float16,
    "bf16": np.uint16,
    "i32": np.int32,
    "u32": np.uint32,
}

# Bytes per block and values per block of the block formats (vkrt/core/formats.py).
BLOCK_LAYOUT: dict[str, tuple[int, int]] = {
    name: (FORMATS[name].block_bytes, FORMATS[name].block_values) for name in BLOCK_FORMATS
}
FLOAT_WEIGHT_DTYPES = FLOAT_FORMATS
# The quantised KV-cache storage (`--kv-cache-dtype q8_0`; vkrt/core/kv_format.py is its spec):
# a cache [blocks, block_size, kv_dim] of GGUF q8_0 blocks (32 values: an f16 scale, 32 int8),
# paired, each pair stored as KV_Q8_0_PAIR_WORDS u32 words: its 64 quants, then its two
# scales. numpy holds it as those words, [blocks, block_size, kv_dim / 64 * 17] uint32.
KV_Q8_0 = "kv_q8_0"
KV_Q8_0_PAIR_VALUES = 64
KV_Q8_0_PAIR_WORDS = 17
ALL_DTYPES = tuple(NUMPY_DTYPES) + BLOCK_FORMATS + (KV_Q8_0,)


def is_block_format(dtype: str) -> bool:
    return dtype in BLOCK_LAYOUT


def host_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The shape of the numpy array holding a tensor of this logical shape (non-block dtypes)."""
    if dtype != KV_Q8_0:
        return tuple(shape)
    if not shape or shape[-1] % KV_Q8_0_PAIR_VALUES:
        raise ValueError(f"{KV_Q8_0} rows must be a multiple of {KV_Q8_0_PAIR_VALUES} values, got {shape}")
    return (*shape[:-1], shape[-1] // KV_Q8_0_PAIR_VALUES * KV_Q8_0_PAIR_WORDS)


def logical_shape(array_shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """host_shape's inverse: the logical shape of a tensor held as an array of this shape."""
    if dtype != KV_Q8_0:
        return tuple(array_shape)
    if not array_shape or array_shape[-1] % KV_Q8_0_PAIR_WORDS:
        raise ValueError(f"{KV_Q8_0} arrays hold rows of {KV_Q8_0_PAIR_WORDS}-word pairs, got {array_shape}")
    return (*array_shape[:-1], array_shape[-1] // KV_Q8_0_PAIR_WORDS * KV_Q8_0_PAIR_VALUES)


def host_numpy_dtype(dtype: str) -> Any:
    """The numpy element type of a non-block dtype's host array."""
    return np.uint32 if dtype == KV_Q8_0 else NUMPY_DTYPES[dtype]


def storage_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes a tensor of this logical shape occupies in its storage format."""
    count = int(np.prod(shape)) if shape else 1
    if dtype == KV_Q8_0:
        return int(np.prod(host_shape(shape, dtype))) * 4
    if dtype in BLOCK_LAYOUT:
        block_bytes, block_values = BLOCK_LAYOUT[dtype]
        if shape[-1] % block_values:
            raise ValueError(f"{dtype} rows must be a multiple of {block_values} values, got {shape}")
        return count // block_values * block_bytes
    return count * np.dtype(NUMPY_DTYPES[dtype]).itemsize


def resolve_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` with its -1 filled in, checked to hold t's elements (OpError otherwise)."""
    from vkrt.core.op import OpError

    dims = tuple(int(d) for d in shape)
    if t.dtype not in NUMPY_DTYPES:
        raise OpError(f"reshape: {t.dtype}{list(t.shape)} is a block format; its rows cannot be reshaped")
    known = int(np.prod([d for d in dims if d != -1])) if dims else 1
    if dims.count(-1) == 1 and known > 0 and t.numel % known == 0:
        dims = tuple(t.numel // known if d == -1 else d for d in dims)
    if any(d < 0 for d in dims) or (int(np.prod(dims)) if dims else 1) != t.numel:
        raise OpError(f"reshape: cannot view {t.dtype}{list(t.shape)} as {list(shape)}")
    return dims


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype, without storage: what op signatures check and infer."""

    shape: tuple[int, ...]
    dtype: str


class PendingOp(Protocol):
    """An op dispatched but not run yet (vkrt.ops.fusion.Pending)."""

    def realize(self, tensor: Tensor) -> None: ...


class TensorBackend(Protocol):
    """What tensors and ops need of the backend a tensor lives on (vkrt.backend.Backend)."""

    name: str

    def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Tensor: ...

    def view(self, t: Tensor, shape: tuple[int, ...]) -> Tensor: ...

    def read(self, t: Tensor) -> np.ndarray: ...

    def select(self, op: str, inputs: tuple[Tensor, ...], params: dict[str, Any]) -> Any: ...

    def execute(self, op: OpDef, inputs: tuple[Tensor, ...], params: dict[str, Any],
                out_specs: tuple[TensorSpec, ...], kernel: Any = None) -> tuple[Tensor, ...]: ...

    def on_sync(self, hook: Callable[[], None]) -> None: ...


class Tensor:
    """A handle to backend storage. `shape` is logical; block formats pack rows of blocks.

    A tensor may be *pending*: the result of an op the fusion layer (vkrt.ops.fusion) has not
    run yet, because a consumer may still fold it into a fused kernel. Touching `handle` runs
    it, so backends never see a pending tensor. `base` keeps alive the tensor whose storage
    this one uses (the realised result of a pending op, or the tensor a view was made of).
    """

    __slots__ = ("shape", "dtype", "backend", "_handle", "pending", "base", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: str, backend: TensorBackend, handle: Any,
                 base: Tensor | None = None) -> None:
        if dtype not in ALL_DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.backend = backend
        self._handle = handle
        self.pending: PendingOp | None = None  # set by the fusion layer until the op runs
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

    def reshape(self, shape: tuple[int, ...]) -> Tensor:
        """A view of the same storage in a new contiguous shape (one dim may be -1); no copy."""
        return self.backend.view(self, resolve_shape(self, shape))

    def numpy(self) -> np.ndarray:
        """Copy the contents to the host (blocks the device if work on it is pending)."""
        return self.backend.read(self)

    def __repr__(self) -> str:
        return f"Tensor({self.shape}, {self.dtype}, {self.backend.name})"
