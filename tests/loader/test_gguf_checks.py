"""Files that parse but are wrong: mistyped metadata, repacked tensors, NaN scales."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_files import V, write_gguf

from vkrt.errors import ModelFormatError
from vkrt.loader import load_model
from vkrt.loader.config import WeightData
from vkrt.loader.gguf_checks import tensor_values


@pytest.mark.parametrize(("key", "value", "vtype"), [
    ("llama.rope.freq_base", 10000, V.UINT32),
    ("tokenizer.ggml.add_bos_token", 1, V.UINT32),
])
def test_a_known_key_with_the_wrong_gguf_type_is_refused(tmp_path: Path, key: str, value: object, vtype: V) -> None:
    path = write_gguf(tmp_path / "m.gguf", metadata={key: (value, vtype)})
    with pytest.raises(ModelFormatError, match=f"metadata {key} is stored as"):
        load_model(path)


def test_the_unchanged_file_loads_with_check_tensors(tmp_path: Path) -> None:
    assert load_model(write_gguf(tmp_path / "m.gguf"), check_tensors=True).weights


def test_trailing_bytes_after_the_last_tensor_are_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes() + bytes(64))
    with pytest.raises(ModelFormatError, match="bytes follow the last tensor"):
        load_model(path)


def test_nan_in_a_float_weight_and_in_a_block_scale_are_named() -> None:
    values = np.ones(4, np.float32)
    values[2] = np.nan
    with pytest.raises(ModelFormatError, match="tensor output_norm.weight has 1 NaN or Inf values"):
        tensor_values("m.gguf", {"final_norm": WeightData("final_norm", "f32", (4,), values)},
                      {"final_norm": "output_norm.weight"})
    blocks = np.zeros((2, 18), np.uint8)  # two Q4_0 blocks
    blocks[1, :2] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ModelFormatError, match=r"1 NaN or Inf Q4_0 block scales \(d\)"):
        tensor_values("m.gguf", {"w": WeightData("w", "q4_0", (1, 64), blocks)})
    blocks[1, :2] = 0
    tensor_values("m.gguf", {"w": WeightData("w", "q4_0", (1, 64), blocks)})
