"""Regression tests for the model-file defects: each corrupt file is one clear error, never a
hang, a traceback, a read outside the model directory, or a silent load."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from loader_fixtures import hf_config, write_safetensors
from model_files import BOS, SMALL, V, write_gguf, write_hf

from vkrt.backend import get_backend
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.tokenizer import Tokenizer

WATCHDOG_S = 60.0  # a hang, not a slow machine: every case here takes milliseconds


def finishes(fn: Callable[[], Any]) -> Any:
    """fn() run with a watchdog: a call that hangs fails the test instead of the run."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed back to the test thread
            result["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(WATCHDOG_S)
    assert not worker.is_alive(), f"{fn} did not finish within {WATCHDOG_S} s"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def load_error(path: Path) -> str:
    """The one-line message loading `path` fails with (ModelFormatError or UnsupportedModelError)."""
    with pytest.raises((ModelFormatError, UnsupportedModelError)) as info:
        finishes(lambda: load_model(path))
    message = str(info.value)
    assert message and "\n" not in message
    return message


def gguf_with(tmp_path: Path, key: str, value: Any, vtype: V = V.UINT32, **kwargs: Any) -> Path:
    return write_gguf(tmp_path / "m.gguf", metadata={key: (value, vtype)}, **kwargs)


def hf_with(tmp_path: Path, **overrides: Any) -> Path:
    return write_hf(tmp_path / "m", hf_config(SMALL, **{"bos_token_id": BOS, "eos_token_id": BOS + 2, **overrides}))


# ---- defect 3: a block_count of 2^32-1 hung the loader ----------------------------------


def test_huge_block_count_is_an_error_not_a_hang(tmp_path: Path) -> None:
    path = gguf_with(tmp_path, "llama.block_count", 2**32 - 1)
    assert "says 4294967295 layers, but there are no tensors for layer 2" in load_error(path)


def test_huge_hf_layer_count_is_an_error_not_a_hang(tmp_path: Path) -> None:
    assert "no tensors for layer 2" in load_error(hf_with(tmp_path, num_hidden_layers=2**32 - 1))


# ---- defect 6: tracebacks instead of one line --------------------------------------------


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.attention.head_count_kv", "llama.block_count"])
def test_zero_counts_are_errors(tmp_path: Path, key: str) -> None:
    assert f"metadata {key} is 0, but it must be a positive integer" in load_error(gguf_with(tmp_path, key, 0))


@pytest.mark.parametrize("key", ["num_attention_heads", "num_key_value_heads", "num_hidden_layers", "hidden_size"])
def test_zero_hf_counts_are_errors(tmp_path: Path, key: str) -> None:
    assert f"{key} is 0, but it must be a positive integer" in load_error(hf_with(tmp_path, **{key: 0}))


def test_corrupt_gguf_vocabulary_is_an_error(tmp_path: Path) -> None:
    # A flipped byte in a token that a merge builds on: the merge names no token.
    from model_files import byte_level_tokens

    tokens = byte_level_tokens()
    tokens[ord("h")] = "H"  # 'h' was a byte token; now "h e" merges a piece the vocabulary lacks
    path = gguf_with(tmp_path, "tokenizer.ggml.tokens", tokens, V.ARRAY)
    loaded = load_model(path)  # the weights are fine
    with pytest.raises(ModelFormatError, match=r"m\.gguf: the tokenizer in the GGUF metadata is inconsistent"):
        finishes(lambda: Tokenizer.from_model(loaded))


@pytest.mark.parametrize("context", [2**32 - 1, 10**12])
def test_huge_context_sizes_the_rope_table_from_the_kv_cache(tmp_path: Path, context: int) -> None:
    path = gguf_with(tmp_path, "llama.context_length", context, V.UINT64)
    loaded = finishes(lambda: load_model(path))
    assert loaded.config.max_position_embeddings == 2**31 - 1  # capped at 32-bit positions
    from vkrt.backend.reference import ReferenceBackend

    class Recording(ReferenceBackend):
        uploads: list[tuple[int, ...]] = []

        def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Any:
            self.uploads.append(np.shape(array))
            return super().upload(array, dtype, purpose)

    backend = Recording()
    build_model(loaded, backend).allocate_kv_cache(4, 16)
    # The RoPE table: 4 blocks of 16 positions, not 2^31 (no other upload has 64 rows of head_dim).
    assert (64, SMALL.head_dim) in backend.uploads
    assert max(shape[0] for shape in backend.uploads if shape) <= SMALL.vocab


def test_safetensors_header_that_is_an_array(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    header = b"[1, 2, 3]"
    (model_dir / "model-00001-of-00002.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert "the safetensors header is not a JSON object" in load_error(model_dir)


def test_chat_template_file_not_utf8(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    (model_dir / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ModelFormatError, match=r"chat_template\.jinja: cannot be read as UTF-8"):
        Tokenizer.from_hf_dir(model_dir)


# ---- defect 7: corrupt files that loaded -------------------------------------------------


def _tensor_info_offsets(path: Path) -> dict[str, int]:
    """Where each tensor's data offset field sits in the file (by the gguf package's reader)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {t.name: t.field.offset + sum(p.nbytes for p in t.field.parts[:-1]) for t in reader.tensors}


def _patch_u64(path: Path, at: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + 8] = struct.pack("<Q", value)
    path.write_bytes(bytes(data))


def test_unaligned_tensor_offset(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    at = _tensor_info_offsets(path)["output_norm.weight"]
    old = struct.unpack_from("<Q", path.read_bytes(), at)[0]
    _patch_u64(path, at, old + 4)
    assert f"tensor 'output_norm.weight' starts at offset {old + 4}, not a multiple of the alignment 32" in load_error(path)


def test_tensor_outside_the_data_region(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    _patch_u64(path, _tensor_info_offsets(path)["output_norm.weight"], 1 << 40)
    assert "tensor 'output_norm.weight' extends past the end of the file" in load_error(path)


def test_overlapping_tensors(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    offsets = _tensor_info_offsets(path)
    first = struct.unpack_from("<Q", path.read_bytes(), offsets["token_embd.weight"])[0]
    _patch_u64(path, offsets["output_norm.weight"], first)
    assert "overlap" in load_error(path)


def test_tensor_size_disagreeing_with_shape(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    shard = model_dir / "model-00001-of-00002.safetensors"
    (n,) = struct.unpack("<Q", shard.read_bytes()[:8])
    header = json.loads(shard.read_bytes()[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] // 2, *header[name]["shape"][1:]]
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    blob = shard.read_bytes()[8 + n:]
    encoded = json.dumps(tensors).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + blob)
    message = load_error(model_dir)
    assert f"tensor '{name}' has" in message and "its dtype and shape need" in message


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_not_a_power_of_two(tmp_path: Path, alignment: int) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    key = b"general.alignment"
    at = data.index(key) + len(key) + 4  # the value follows its uint32 type tag
    data[at:at + 4] = struct.pack("<I", alignment)
    path.write_bytes(bytes(data))
    assert f"general.alignment is {alignment}, not a power of two" in load_error(path)


def test_unused_layer_is_an_error(tmp_path: Path) -> None:
    extra = {"blk.2.attn_norm.weight": np.ones(SMALL.hidden, np.float32)}
    path = write_gguf(tmp_path / "m.gguf", extra_tensors=extra)
    assert "has tensors for layer 2, but the config says 2 layers" in load_error(path)


@pytest.mark.parametrize(("key", "value", "vtype", "message"), [
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32, "must be a finite number"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, V.FLOAT32, "rms_norm_eps is -1e-05, but it must be a number between 0 and 1"),
    ("llama.rope.freq_base", float("inf"), V.FLOAT32, "must be a finite number"),
    ("llama.rope.freq_base", 0.0, V.FLOAT32, "rope_theta is 0.0, but it must be a positive number"),
    ("llama.attention.head_count_kv", 3, V.UINT32, "num_kv_heads is 3, but it must be a divisor of num_heads (4)"),
    ("llama.embedding_length", "64", V.STRING, "metadata llama.embedding_length is '64', but it must be a positive integer"),
    ("tokenizer.ggml.bos_token_id", 10_000, V.UINT32, "tokenizer.ggml.bos_token_id is 10000, which is not a token id"),
    ("tokenizer.ggml.eos_token_id", -1, V.INT32, "tokenizer.ggml.eos_token_id is -1, which is not a token id"),
])
def test_gguf_hyper_parameters_out_of_range(tmp_path: Path, key: str, value: Any, vtype: V, message: str) -> None:
    assert message in load_error(gguf_with(tmp_path, key, value, vtype))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size": "64"}, "hidden_size is '64', but it must be a positive integer"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers is 2.0, but it must be a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false', but it must be true or false"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, but it must be a finite number"),
    ({"eos_token_id": 5000}, "eos_token_id is 5000, which is not a token id of the vocabulary [0, 264)"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": "linear"}, "rope_scaling is 'linear', but it must be an object"),
])
def test_hf_config_types_and_ranges(tmp_path: Path, overrides: dict[str, Any], message: str) -> None:
    assert message in load_error(hf_with(tmp_path, **overrides))


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    write_safetensors(model_dir / "extra.safetensors", {"model.norm.weight": ("F32", np.ones(SMALL.hidden, np.float32))})
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["extra"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    assert "tensor 'model.norm.weight' is also in another shard" in load_error(model_dir)


def test_duplicate_tensor_in_one_header(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    shard = model_dir / "model-00001-of-00002.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].rstrip()
    first = header[1:header.index(b"}}") + 2]  # '"__metadata__": {...}'
    patched = header[:-1] + b", " + first + b"}"
    shard.write_bytes(struct.pack("<Q", len(patched)) + patched + raw[8 + n:])
    assert "the header names '__metadata__' twice" in load_error(model_dir)


# ---- defect 10: shard paths escaping the model directory -------------------------------


@pytest.mark.parametrize("shard", ["/etc/passwd", "../../etc/hostname", "../m/model-00001-of-00002.safetensors",
                                   "", ".", 7, "a\x00b"])
def test_index_paths_stay_inside_the_model_directory(tmp_path: Path, shard: Any) -> None:
    model_dir = hf_with(tmp_path)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = shard
    index_path.write_text(json.dumps(index))
    message = load_error(model_dir)
    assert "index.json: names" in message
    assert "header" not in message and "root:" not in message  # the named file was not opened


def test_a_file_that_is_not_safetensors_leaks_no_bytes(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    secret = b"SECRET=hunter2\n" * 4
    (model_dir / "model-00002-of-00002.safetensors").write_bytes(secret)
    message = load_error(model_dir)
    assert "header length field exceeds the file" in message
    assert str(struct.unpack("<Q", secret[:8])[0]) not in message and "hunter" not in message


# ---- defect 14 (loader half): a FIFO as the model ----------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_as_model_is_an_error_not_a_block(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert "not a regular file" in load_error(fifo)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_as_a_shard_is_an_error_not_a_block(tmp_path: Path) -> None:
    model_dir = hf_with(tmp_path)
    shard = model_dir / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    assert "model-00002-of-00002.safetensors: not a regular file" in load_error(model_dir)


def test_the_small_files_load(tmp_path: Path) -> None:
    """The unmutated inputs load, build and tokenize: the errors above come from the mutations."""
    backend = get_backend("reference")
    for path in (write_gguf(tmp_path / "m.gguf"), write_hf(tmp_path / "hf")):
        loaded = load_model(path)
        build_model(loaded, backend).allocate_kv_cache(2, 16)
        assert Tokenizer.from_model(loaded).encode("hello", add_special_tokens=False) == [260, 111]
