"""vkrt's fast GGUF parser reads exactly what the gguf package's reader reads."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from vkrt.errors import ModelFormatError
from vkrt.loader.gguf_file import GGUFFile


def _reference_value(field: gguf.ReaderField):
    kind = field.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    value = field.parts[field.data[0]].tolist()[0]
    return float(str(np.float32(value))) if kind == gguf.GGUFValueType.FLOAT32 else value


def _assert_same(path: Path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        assert ours.fields[key].types == list(theirs.fields[key].types), key
        assert ours.fields[key].value == _reference_value(theirs.fields[key]), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name


def test_matches_gguf_reader_on_the_default_model(smollm2_path: Path) -> None:
    _assert_same(smollm2_path)


def test_matches_gguf_reader_on_every_value_type(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("k.u8", 7)
    writer.add_int16("k.i16", -3)
    writer.add_uint32("k.u32", 1 << 31)
    writer.add_int64("k.i64", -(1 << 40))
    writer.add_float32("k.f32", 1e-5)
    writer.add_float64("k.f64", 0.1)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo ✓")
    writer.add_array("k.ints", [1, 2, 3])
    writer.add_array("k.floats", [0.5, -2.25])
    writer.add_array("k.strs", ["a", "", "日本"])
    writer.add_tensor("w32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("w16", np.arange(8, dtype=np.float16).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same(path)


def test_truncated_file_is_an_error(tmp_path: Path, smollm2_path: Path) -> None:
    for cut in (3, 1000, 3 << 20):
        path = tmp_path / f"cut{cut}.gguf"
        with smollm2_path.open("rb") as src:
            path.write_bytes(src.read(cut))
        with pytest.raises(ModelFormatError, match="truncated|magic|past the end"):
            GGUFFile(path)
