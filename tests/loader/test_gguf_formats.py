"""The GGUF loader reads every format of the registry (vkrt/core/formats.py) as its storage
bytes, one row of blocks per output row, and names the file and tensor for a type it lacks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.core.test_formats import random_blocks
from vkrt.core.formats import BLOCK_FORMATS, FORMATS
from vkrt.core.quant import dequantize
from vkrt.errors import UnsupportedModelError
from vkrt.loader import gguf_loader


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, int, tuple[int, int]]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, qtype, _) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_block_format_loads_as_its_bytes(tmp_path: Path, rng: np.random.Generator) -> None:
    rows = 3
    written = {}
    for name in BLOCK_FORMATS:
        fmt = FORMATS[name]
        raw = random_blocks(rng, name, rows, 2)
        written[name] = (raw, fmt.gguf_type, (rows, 2 * fmt.block_values))
    path = tmp_path / "formats.gguf"
    _write(path, written)
    reader = gguf_loader.open_gguf(path)
    for tensor in reader.tensors:
        raw, _, shape = written[tensor.name]
        weight = gguf_loader._weight(path, tensor.name, tensor)
        assert (weight.fmt, weight.shape) == (tensor.name, shape)
        assert np.array_equal(weight.data, raw)
        assert dequantize(weight.data, weight.fmt).shape == shape


def test_unsupported_type_names_file_and_tensor(tmp_path: Path, rng: np.random.Generator) -> None:
    qtype = gguf.GGMLQuantizationType.TQ1_0  # not in the registry
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    path = tmp_path / "ternary.gguf"
    _write(path, {"w": (rng.integers(0, 256, (2, nbytes), dtype=np.uint8), qtype, (2, values))})
    tensor = gguf_loader.open_gguf(path).tensors[0]
    with pytest.raises(UnsupportedModelError, match=r"ternary\.gguf: tensor 'w' has type TQ1_0"):
        gguf_loader._weight(path, "w", tensor)
