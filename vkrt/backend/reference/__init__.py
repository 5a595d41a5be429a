"""The reference backend: tensors are numpy arrays, every op runs its numpy spec."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import vkrt.ops  # noqa: F401 (declares every op, so OPS is complete)
from vkrt.backend.base import Backend, Kernel, as_storage_array, infer_dtype
from vkrt.core.host_weight import HostWeight
from vkrt.core.op import OPS, OpError
from vkrt.core.quant import dequantize
from vkrt.core.tensor import (
    Tensor,
    TensorSpec,
    host_numpy_dtype,
    host_shape,
    is_block_format,
    logical_shape,
    storage_nbytes,
)


class _Weight:
    """A weight's storage bytes plus its float64 values, made once (host memory only).

    float64 keeps each output row's sum essentially independent of how many rows BLAS
    processes together, so reference runs stay batch invariant after rounding to f32.
    """

    __slots__ = ("raw", "values")

    def __init__(self, raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
        self.raw = raw
        self.values = dequantize(raw, dtype).reshape(shape).astype(np.float64)


def _run_reference(backend: ReferenceBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                   out_specs: tuple[TensorSpec, ...], *, op: str) -> tuple[Tensor, ...]:
    opdef = OPS[op]
    arrays = [backend.reference_array(t) for t in inputs]
    result = opdef.reference(*arrays, **params)
    if not out_specs:
        return ()  # purely in place: the reference mutated the stored arrays
    results = result if isinstance(result, tuple) else (result,)
    return tuple(Tensor(spec.shape, spec.dtype, backend, as_storage_array(np.asarray(r), spec.dtype))
                 for r, spec in zip(results, out_specs, strict=True))


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self) -> None:
        super().__init__()
        for op in OPS:
            self.register_kernel(Kernel(op, "numpy", functools.partial(_run_reference, op=op)))

    def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Tensor:
        dtype = dtype or infer_dtype(np.asarray(array))
        data = as_storage_array(np.asarray(array), dtype)
        if is_block_format(dtype):
            raise TypeError("block-format tensors are uploaded with upload_weight")
        return Tensor(logical_shape(data.shape, dtype), dtype, self, data.copy())

    def upload_host_weight(self, weight: HostWeight) -> Tensor:
        dtype, shape = weight.dtype, weight.shape
        raw = as_storage_array(weight.array(), dtype)  # this backend's weights are host arrays
        if raw.nbytes != storage_nbytes(shape, dtype):
            raise ValueError(f"{dtype}{list(shape)} needs {storage_nbytes(shape, dtype)} bytes, got {raw.nbytes}")
        raw = raw.reshape(shape[0], -1) if is_block_format(dtype) else raw.reshape(shape)
        return Tensor(shape, dtype, self, _Weight(raw.copy(), dtype, shape))

    def empty(self, shape: tuple[int, ...], dtype: str, purpose: str = "activations") -> Tensor:
        return Tensor(shape, dtype, self, np.zeros(host_shape(shape, dtype), host_numpy_dtype(dtype)))

    def view(self, t: Tensor, shape: tuple[int, ...]) -> Tensor:
        if isinstance(t.handle, _Weight):
            raise OpError(f"reshape: {t} is a weight; weights are not viewed in other shapes")
        data = t.handle.view()
        data.shape = shape  # raises rather than copy if the storage were not contiguous
        return Tensor(shape, t.dtype, self, data, base=t)

    def write(self, t: Tensor, array: np.ndarray) -> None:
        t.handle[...] = as_storage_array(np.asarray(array), t.dtype).reshape(t.handle.shape)

    def read(self, t: Tensor) -> np.ndarray:
        if isinstance(t.handle, _Weight):
            return t.handle.raw.copy()
        return t.handle.copy()

    def reference_array(self, t: Tensor) -> np.ndarray:
        # In-place ops mutate the stored array itself, so hand it over without a copy.
        if isinstance(t.handle, _Weight):
            return t.handle.values
        return t.handle
