"""`HostWeight`: a weight's storage-format bytes on the host, as the loader mapped them.

A stacked weight (q|k|v, gate|up, an expert stack) is uploaded as one tensor but stored in a
file as several: a HostWeight names those pieces in order instead of joining them, so nothing
is copied to stack them before the upload, and a backend that must be able to give the bytes
back (`Backend.read`) keeps the HostWeight (views of the file's memory map) rather than a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkrt.core.quant import bf16_to_f32, f32_to_bf16


@dataclass(frozen=True)
class RowBlock:
    """Storage-format rows [rows, ...] (block formats: uint8 rows of blocks; floats: typed
    values), usually a view of a file's memory map. `order`, when given, reads row order[j] as
    row j (llama.cpp's q/k head interleaving undone without copying the file's rows); `scale`
    (f32 [rows], float formats only) multiplies row j by scale[j] as the rows are read
    (Falcon-H1's multipliers, folded into a weight as it is uploaded)."""

    data: np.ndarray
    order: np.ndarray | None = None
    scale: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.data.shape[0] if self.order is None else self.order.shape[0])

    def rows(self) -> np.ndarray:
        """The rows in weight order (a view when there is neither `order` nor `scale`)."""
        rows = self.data if self.order is None else self.data[self.order]
        return rows if self.scale is None else scaled_rows(rows, self.scale)


def scaled_rows(rows: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Float-format rows (f32, f16, or bf16 as uint16) times one factor per row, computed in
    f32 and stored back in the rows' format."""
    factors = np.asarray(scale, np.float32).reshape(-1, *([1] * (rows.ndim - 1)))
    if rows.dtype == np.uint16:
        return f32_to_bf16(bf16_to_f32(rows) * factors)
    if rows.dtype not in (np.float32, np.float16):
        raise TypeError(f"rows of dtype {rows.dtype} cannot be scaled (block formats are never scaled)")
    return (rows.astype(np.float32) * factors).astype(rows.dtype)


@dataclass(frozen=True)
class HostWeight:
    """A weight of logical `shape` ([n], [rows, cols] or stacked experts [E, rows, cols]) in
    storage format `dtype`: `matrices` holds its one matrix (E for an expert stack), each as the
    row blocks that stack into it, in order."""

    dtype: str
    shape: tuple[int, ...]
    matrices: tuple[tuple[RowBlock, ...], ...]

    @classmethod
    def of(cls, array: np.ndarray, dtype: str, shape: tuple[int, ...]) -> HostWeight:
        """One stored array: a matrix or vector, or a stacked [E, ...] weight (split per matrix)."""
        data = np.asarray(array)
        if len(shape) == 3:
            per_expert = data.reshape(shape[0], shape[1], -1)
            return cls(dtype, tuple(shape), tuple((RowBlock(m),) for m in per_expert))
        rows = data.reshape(shape[0], -1) if len(shape) == 2 and data.ndim != 2 else data
        return cls(dtype, tuple(shape), ((RowBlock(rows),),))

    @property
    def num_matrices(self) -> int:
        return len(self.matrices)

    def matrix(self, m: int) -> np.ndarray:
        """Matrix m's rows joined (a view when it is one block without an order; else a copy)."""
        blocks = self.matrices[m]
        if len(blocks) == 1:
            return blocks[0].rows()
        return np.concatenate([b.rows() for b in blocks], axis=0)

    def array(self) -> np.ndarray:
        """Every matrix joined, rows after rows: [rows, ...] or [E * rows, ...] (a copy unless
        the weight is one plain block)."""
        if len(self.matrices) == 1:
            return self.matrix(0)
        return np.concatenate([self.matrix(m) for m in range(len(self.matrices))], axis=0)
