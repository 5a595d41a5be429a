"""A fast GGUF parser: metadata decoded once, tensor data memory-mapped.

`gguf.GGUFReader` builds a numpy view per array element, which took ~2-3 s for the
~98k-string tokenizer arrays of a real vocabulary on every load. This reader decodes
string arrays in one pass and numeric arrays with `np.frombuffer`, and exposes the small
part of GGUFReader's interface the loader and tokenizer use (`fields`, `tensors`, `data`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS: dict[int, tuple[str, Any]] = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}


@dataclass
class GGUFField:
    """One key/value: `types` as GGUFReader gives them ([ARRAY, element type] for arrays)."""

    name: str
    types: list[GGUFValueType]
    value: Any


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data: np.ndarray  # f32/f16: typed and shaped like numpy (slowest first); else flat uint8


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        try:
            self._parse(path)
        except (struct.error, IndexError) as exc:
            raise ValueError(f"the file ends inside its header ({exc}): truncated") from exc

    def _parse(self, path: str | Path) -> None:
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self.data)  # type: ignore[arg-type]
        self._pos = 0
        magic = bytes(self._buf[:4])
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            name = self._string()
            kind = GGUFValueType(self._scalar("<I"))
            types, value = self._value(kind)
            self.fields[name] = GGUFField(name, types, value)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            infos.append((name, dims, GGMLQuantizationType(self._scalar("<I")), self._scalar("<Q")))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # -- primitives -------------------------------------------------------------------
    def _scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self._buf[self._pos:end]).decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _value(self, kind: GGUFValueType) -> tuple[list[GGUFValueType], Any]:
        if kind == GGUFValueType.STRING:
            return [kind], self._string()
        if kind == GGUFValueType.ARRAY:
            elem = GGUFValueType(self._scalar("<I"))
            count = self._scalar("<Q")
            if elem == GGUFValueType.STRING:
                return [kind, elem], [self._string() for _ in range(count)]
            if elem == GGUFValueType.ARRAY:
                return [kind, elem], [self._value(GGUFValueType(self._scalar("<I")))[1] for _ in range(count)]
            fmt, np_type = _SCALARS[elem]
            size = struct.calcsize(fmt) * count
            if self._pos + size > len(self._buf):
                raise ValueError("array runs past the end of the file")
            values = np.frombuffer(self._buf, dtype=np.dtype(np_type).newbyteorder("<"), count=count,
                                   offset=self._pos).tolist()
            self._pos += size
            return [kind, elem], values
        fmt, _ = _SCALARS[kind]
        value = self._scalar(fmt)
        if kind == GGUFValueType.FLOAT32:
            # Shortest decimal that round-trips the stored float32: 1e-05, not 9.99e-06.
            value = float(str(np.float32(value)))
        return [kind], value

    def _tensor(self, start: int, name: str, dims: list[int], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        n_elements = int(np.prod(dims)) if dims else 1
        block_elems, block_bytes = GGML_QUANT_SIZES[kind]
        if n_elements % block_elems:
            raise ValueError(f"tensor {name!r}: {n_elements} values are not whole {kind.name} blocks")
        n_bytes = n_elements // block_elems * block_bytes
        begin = start + offset
        if begin + n_bytes > len(self.data):
            raise ValueError(f"tensor {name!r} extends past the end of the file (truncated)")
        raw = self.data[begin:begin + n_bytes]
        numpy_shape = tuple(reversed(dims))
        data: np.ndarray
        if kind == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(numpy_shape)
        elif kind == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(numpy_shape)
        else:
            data = raw
        return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), n_elements, n_bytes, data)
