"""A fast GGUF parser: metadata decoded once, tensor data memory-mapped.

`gguf.GGUFReader` builds a numpy view per array element, which took ~2-3 s for the
~98k-string tokenizer arrays of a real vocabulary on every load. This reader decodes
string arrays in one pass and numeric arrays with `np.frombuffer`, and exposes the small
part of GGUFReader's interface the loader and tokenizer use (`fields`, `tensors`, `data`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from vkrt.errors import ModelFormatError
from vkrt.loader import validate

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
        self._source = str(path)
        try:
            self._parse(path)
        except (struct.error, IndexError) as exc:
            raise self._unreadable(f"the file ends inside its header ({exc}): truncated") from exc
        except (ValueError, KeyError, RecursionError, OverflowError) as exc:
            raise self._unreadable(f"{type(exc).__name__}: {exc}") from exc

    def _unreadable(self, why: str) -> ModelFormatError:
        return ModelFormatError(f"{self._source}: not a readable GGUF file ({why}); the file is "
                                "truncated or corrupt, download or convert it again")

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
            n_dims = self._scalar("<I")
            if n_dims > validate.GGML_MAX_DIMS:
                raise ValueError(f"tensor {name[:60]!r} has {n_dims} dimensions (at most {validate.GGML_MAX_DIMS})")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            infos.append(validate.TensorInfo(name, dims, self._scalar("<I"), self._scalar("<Q")))
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            alignment = validate.gguf_alignment(self._source, self.fields["general.alignment"].value)
        start = -(-self._pos // alignment) * alignment
        sizes = validate.gguf_tensor_layout(self._source, infos, start, len(self.data), alignment)
        self.tensors = [self._tensor(start + info.offset, info, n_bytes) for info, n_bytes in zip(infos, sizes, strict=True)]

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
            # Each element takes at least 8 (a string's length) or 12 bytes (a nested array's
            # header): a corrupt count fails here instead of looping to the end of the file.
            if elem in (GGUFValueType.STRING, GGUFValueType.ARRAY) and count * 8 > len(self._buf) - self._pos:
                raise ValueError(f"array of {count} elements runs past the end of the file")
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

    def _tensor(self, begin: int, info: validate.TensorInfo, n_bytes: int) -> GGUFTensor:
        kind = GGMLQuantizationType(info.type_id)
        raw = self.data[begin:begin + n_bytes]
        numpy_shape = tuple(reversed(info.dims))
        data: np.ndarray
        if kind == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(numpy_shape)
        elif kind == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(numpy_shape)
        else:
            data = raw
        return GGUFTensor(info.name, kind, np.array(info.dims, dtype=np.uint64), math.prod(info.dims), n_bytes, data)
