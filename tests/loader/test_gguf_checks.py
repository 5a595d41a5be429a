"""Files that parse but are wrong: mistyped metadata, repacked tensors, a lying alignment,
a BPE vocabulary without merges, NaN weights (--check-tensors)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from model_files import Q, V, token_types, write_gguf

from vkrt.errors import ModelFormatError
from vkrt.loader import load_model
from vkrt.loader.config import WeightData
from vkrt.loader.gguf_checks import tensor_values
from vkrt.tokenizer import Tokenizer


@pytest.mark.parametrize(("key", "value", "vtype", "stored"), [
    ("llama.rope.freq_base", 10000, V.UINT32, "UINT32"),
    ("tokenizer.ggml.add_bos_token", 1, V.UINT32, "UINT32"),
    ("tokenizer.ggml.token_type", [float(t) for t in token_types()], V.ARRAY, "an array of FLOAT32"),
])
def test_a_known_key_with_the_wrong_gguf_type_is_refused(tmp_path: Path, key: str, value: object, vtype: V,
                                                         stored: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", metadata={key: (value, vtype)})
    with pytest.raises(ModelFormatError, match=f"metadata {key} is stored as {stored}, but it must be"):
        load_model(path)


def test_the_unchanged_file_loads_with_check_tensors(tmp_path: Path) -> None:
    assert load_model(write_gguf(tmp_path / "m.gguf"), check_tensors=True).weights


def test_trailing_bytes_after_the_last_tensor_are_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes() + bytes(64))
    with pytest.raises(ModelFormatError, match="64 bytes follow the last tensor"):
        load_model(path)


def _type_field(path: Path, tensor: str) -> int:
    """Where tensor `tensor`'s type id sits in its tensor-info record."""
    info = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    return info.field.offset + sum(part.nbytes for part in info.field.parts[:4])  # name len, name, n_dims, dims


@pytest.mark.parametrize(("projection", "tensor", "stored", "claimed"), [
    ("gate_proj", "blk.0.ffn_gate.weight", Q.Q4_1, Q.Q4_0),
    ("gate_proj", "blk.1.ffn_gate.weight", Q.Q4_1, Q.Q4_0),
    ("attn_norm", "blk.0.attn_norm.weight", Q.F32, Q.F16),
    ("down_proj", "blk.1.ffn_down.weight", Q.F32, Q.F16),  # the last tensor: a tail, not a gap
])
def test_a_tensor_retyped_to_a_smaller_type_is_refused_by_name(tmp_path: Path, projection: str, tensor: str,
                                                               stored: Q, claimed: Q) -> None:
    path = write_gguf(tmp_path / "m.gguf", qtypes={projection: stored})
    data = bytearray(path.read_bytes())
    at = _type_field(path, tensor)
    assert struct.unpack_from("<I", data, at)[0] == stored
    struct.pack_into("<I", data, at, claimed)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError) as caught:
        load_model(path)
    message = str(caught.value)
    assert f"'{tensor}'" in message and "a tensor's type or shape, or general.alignment, is wrong" in message
    assert "\n" not in message


def _header_end(path: Path) -> int:
    """Where the last tensor-info record ends: the data starts there, rounded up to the alignment."""
    last = gguf.GGUFReader(path).tensors[-1].field
    return last.offset + sum(part.nbytes for part in last.parts)


@pytest.mark.parametrize("claimed", [8, 16, 64])
def test_a_lying_alignment_is_refused(tmp_path: Path, claimed: int) -> None:
    # The header must end off every boundary in play, or the lie moves no byte (and is harmless):
    # pad the name so the header ends 4 bytes past a multiple of 32.
    name = "small-llama"
    name += "x" * ((4 - _header_end(write_gguf(tmp_path / "probe.gguf"))) % 32)
    path = write_gguf(tmp_path / "m.gguf", metadata={"general.name": (name, V.STRING)})
    assert _header_end(path) % 32 == 4
    data = bytearray(path.read_bytes())
    key = b"general.alignment"
    at = data.index(key) + len(key) + 4  # the value follows its uint32 type tag
    assert struct.unpack_from("<I", data, at)[0] == 32
    struct.pack_into("<I", data, at, claimed)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=f"alignment,? {claimed}") as caught:
        load_model(path)
    assert "\n" not in str(caught.value)


def test_a_bpe_vocabulary_without_merges_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", metadata={"tokenizer.ggml.merges": None})
    with pytest.raises(ModelFormatError, match=r"the BPE \(gpt2\) tokenizer has no tokenizer.ggml.merges"):
        Tokenizer.from_model(path)


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


def _with_nan(path: Path, tensor: str) -> Path:
    """`path` with the first value of its F32 tensor `tensor` set to NaN."""
    at = next(t.data_offset for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    data = bytearray(path.read_bytes())
    data[at:at + 4] = np.array([np.nan], np.float32).tobytes()
    path.write_bytes(bytes(data))
    return path


def test_check_tensors_is_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _with_nan(write_gguf(tmp_path / "m.gguf"), "output_norm.weight")
    monkeypatch.delenv("VKRT_CHECK_TENSORS", raising=False)
    assert load_model(path).weights
    monkeypatch.setenv("VKRT_CHECK_TENSORS", "1")
    with pytest.raises(ModelFormatError, match="tensor output_norm.weight has 1 NaN or Inf values"):
        load_model(path)


@pytest.mark.parametrize("command", [["generate", "hi", "-n", "1"], ["chat", "hi", "-n", "1"],
                                     ["bench", "-p", "4", "-g", "1"], ["serve", "--port", "0"]])
def test_the_check_tensors_flag_refuses_a_nan_weight_in_one_line(tmp_path: Path, command: list[str]) -> None:
    path = _with_nan(write_gguf(tmp_path / "m.gguf"), "output_norm.weight")
    proc = subprocess.run([sys.executable, "-m", "vkrt.cli", *command, "--model", str(path), "--device", "reference",
                           "--check-tensors"], capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vkrt: error:")]
    assert proc.returncode == 1, proc.stderr
    assert errors == [f"vkrt: error: {path}: tensor output_norm.weight has 1 NaN or Inf values; the file is "
                      "corrupt, download or convert it again"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_the_flag_the_nan_logits_end_generate_in_one_line(tmp_path: Path) -> None:
    path = _with_nan(write_gguf(tmp_path / "m.gguf"), "output_norm.weight")
    env = {k: v for k, v in os.environ.items() if k != "VKRT_CHECK_TENSORS"}
    proc = subprocess.run([sys.executable, "-m", "vkrt.cli", "generate", "hi", "-n", "4", "--model", str(path),
                           "--device", "reference"], capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vkrt: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "logits after" in errors[0] and "hold NaN or Inf" in errors[0] and "--check-tensors" in errors[0]
    assert "Traceback" not in proc.stderr
