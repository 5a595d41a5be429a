"""Model-file mutation test: a few hundred corrupted copies of small model files, from a fixed
seed, each loaded, built and run for one step on the reference backend.

Every case must end as a one-line ModelFormatError / UnsupportedModelError, or load. Loading
is the documented outcome only where nothing checkable changed: tensor payload bytes (vkrt
does not checksum weights), strings such as names and token texts, and numbers that stay
in range. Cases marked `must_fail` (truncations, zero or mistyped counts, paths outside the
model directory, non-regular files, ...) must not load. A watchdog bounds every case.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from loader_fixtures import hf_config
from model_files import BOS, EOS, SMALL, V, byte_level_tokens, write_gguf, write_hf

from tests.conftest import FIXTURES
from vkrt.backend import get_backend
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.models import ForwardBatch, StepTensors, build_model
from vkrt.tokenizer import Tokenizer

SEED = 13
REQUIRED_GGUF = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv")  # a missing kv-head count means head_count: wrong shapes
CASE_WATCHDOG_S = 60.0  # a hang, not a slow machine: a case takes tens of milliseconds


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Path], Path]  # writes the mutant into an empty directory, returns what to load
    must_fail: bool = False
    tokenizer: bool = True  # the input has a tokenizer to build


def run_model(path: Path, tokenizer: bool) -> None:
    """What `vkrt generate` does with a model file, short: load, build, one step, tokenize."""
    backend = get_backend("reference")
    loaded = load_model(path)
    model = build_model(loaded, backend)
    kv = model.allocate_kv_cache(2, 16)
    one = np.zeros(1, np.int32)
    batch = ForwardBatch(token_ids=one + 1, positions=one, seq_index=one, slots=one,
                         block_tables=np.array([[0, 1]], np.int32), logits_index=one)
    logits = backend.read(model.forward(StepTensors.upload(backend, batch), kv))
    assert logits.shape == (1, loaded.config.vocab_size)
    if tokenizer:
        tok = Tokenizer.from_model(loaded)
        tok.encode("hello the world")
        if tok.chat_template:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])


def outcome(case: Case, workdir: Path) -> str | None:
    """None if the case loaded; the error message if it failed cleanly. Anything else fails."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            run_model(case.make(workdir), case.tokenizer)
        except BaseException as exc:  # examined in the test thread
            box["error"] = exc
            box["trace"] = traceback.format_exc()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(CASE_WATCHDOG_S)
    assert not worker.is_alive(), f"{case.name}: still running after {CASE_WATCHDOG_S} s (a hang)"
    error = box.get("error")
    if error is None:
        return None
    assert isinstance(error, (ModelFormatError, UnsupportedModelError)), f"{case.name}: {box['trace']}"
    message = str(error)
    assert message and "\n" not in message and "Traceback" not in message, f"{case.name}: {message!r}"
    return message


# ---- GGUF mutants ---------------------------------------------------------------------


def _patch(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def _bytes_case(name: str, data: bytes, must_fail: bool = False) -> Case:
    def make(d: Path) -> Path:
        (d / "m.gguf").write_bytes(data)
        return d / "m.gguf"
    return Case(name, make, must_fail)


def _tensor_fields(path: Path) -> list[dict[str, int]]:
    """Byte positions of each tensor-info record's fields (found with the gguf package's reader)."""
    out = []
    for t in gguf.GGUFReader(path).tensors:
        pos = t.field.offset
        name_len = int(t.field.parts[0][0])
        n_dims = int(t.field.parts[2][0])
        dims_at = pos + 8 + name_len + 4
        out.append({"name": pos + 8, "name_len": name_len, "n_dims": dims_at - 4, "dims": dims_at,
                    "dim0": int(t.field.parts[3][0]), "type": dims_at + 8 * n_dims,
                    "offset": dims_at + 8 * n_dims + 4, "data_offset": int(t.field.parts[5][0])})
    return out


def gguf_cases(tmp: Path, rng: random.Random) -> list[Case]:
    base_path = write_gguf(tmp / "base.gguf")
    base = base_path.read_bytes()
    reader = gguf.GGUFReader(base_path)
    data_start = min(t.data_offset for t in reader.tensors)
    last_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    cases = [_bytes_case("gguf unchanged", base)]

    for cut in sorted(rng.sample(range(data_start), 25)) + sorted(rng.sample(range(data_start, last_end), 15)):
        cases.append(_bytes_case(f"gguf cut at {cut}", base[:cut], must_fail=True))
    for at in rng.sample(range(data_start), 70) + rng.sample(range(data_start, len(base)), 20):
        flipped = bytearray(base)
        flipped[at] ^= rng.randrange(1, 256)
        cases.append(_bytes_case(f"gguf byte {at} flipped", bytes(flipped)))

    # Header counts and version.
    for value, must in ((0, True), (1, True), (4, True), (2**32 - 1, True)):
        cases.append(_bytes_case(f"gguf version {value}", _patch(base, 4, "<I", value), must))
    n_tensors, n_kv = len(reader.tensors), struct.unpack_from("<Q", base, 16)[0]
    for value in (0, n_tensors - 1, n_tensors + 1, 2**63):
        cases.append(_bytes_case(f"gguf n_tensors {value}", _patch(base, 8, "<Q", value), must_fail=True))
    for value in (0, n_kv - 1, n_kv + 1, 2**63):
        cases.append(_bytes_case(f"gguf n_kv {value}", _patch(base, 16, "<Q", value), must_fail=value == 2**63))
    align = reader.fields["general.alignment"]
    align_at = align.offset + 8 + len("general.alignment") + 4
    for value in (0, 3, 48, 2**31, 2**32 - 1):
        cases.append(_bytes_case(f"gguf alignment {value}", _patch(base, align_at, "<I", value), must_fail=True))

    # Tensor-info records.
    fields = _tensor_fields(base_path)
    mutations: list[tuple[str, str, Callable[[dict[str, int]], int], bool]] = [
        ("n_dims", "<I", lambda f: 0, True), ("n_dims", "<I", lambda f: 5, True),
        ("n_dims", "<I", lambda f: 2**32 - 1, True),
        ("dims", "<Q", lambda f: 0, True), ("dims", "<Q", lambda f: f["dim0"] * 2, True),
        ("dims", "<Q", lambda f: 2**63, True), ("dims", "<Q", lambda f: 32, True),
        # a retyped tensor changes size: a gap, an overlap or a tail (F16 is no base tensor's type)
        ("type", "<I", lambda f: 999, True), ("type", "<I", lambda f: int(gguf.GGMLQuantizationType.F16), True),
        ("type", "<I", lambda f: int(gguf.GGMLQuantizationType.Q4_K), True),
        ("type", "<I", lambda f: int(gguf.GGMLQuantizationType.IQ2_XXS), True),
        ("offset", "<Q", lambda f: f["data_offset"] + 1, True), ("offset", "<Q", lambda f: 1 << 40, True),
        ("offset", "<Q", lambda f: f["data_offset"] + 32, True), ("offset", "<Q", lambda f: 0, False),
    ]
    for field in rng.sample(fields, 8):
        for what, fmt, value, must in rng.sample(mutations, 7):
            v = value(field)
            cases.append(_bytes_case(f"gguf tensor at {field['name']} {what}={v}",
                                     _patch(base, field[what], fmt, v), must))
    for field in rng.sample(fields, 6):  # renames keep the length: 'blk.0' -> 'blk.7', a duplicate, ...
        name = base[field["name"]:field["name"] + field["name_len"]]
        others = [base[f["name"]:f["name"] + f["name_len"]] for f in fields if f["name_len"] == field["name_len"]]
        for new in {name.replace(b"blk.0", b"blk.7").replace(b"blk.1", b"blk.9"), rng.choice(others),
                    name[:-1] + b"X"} - {name}:
            data = bytearray(base)
            data[field["name"]:field["name"] + len(new)] = new
            cases.append(_bytes_case(f"gguf tensor {name!r} renamed {new!r}", bytes(data), must_fail=True))

    # Key/value mutations, written with the gguf package's writer.
    tokens = byte_level_tokens()
    kv_mutations: list[tuple[str, Any, V, bool]] = []
    for suffix in ("context_length", "embedding_length", "block_count", "feed_forward_length",
                   "attention.head_count", "attention.head_count_kv", "rope.dimension_count"):
        key = f"llama.{suffix}"
        kv_mutations += [(key, 0, V.UINT32, True), (key, 2**32 - 1, V.UINT32, suffix != "context_length"),
                         (key, 10**12, V.UINT64, suffix != "context_length"), (key, -1, V.INT32, True),
                         (key, "64", V.STRING, True), (key, 2.5, V.FLOAT32, True), (key, True, V.BOOL, True),
                         (key, 3, V.UINT32, suffix != "context_length"),
                         (key, None, V.UINT32, suffix in REQUIRED_GGUF)]
    for suffix in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        key = f"llama.{suffix}"
        kv_mutations += [(key, float(v), V.FLOAT32, True) for v in ("nan", "inf", "-inf", "0", "-1")]
        kv_mutations += [(key, 1e30, V.FLOAT32, suffix.endswith("epsilon")), (key, "x", V.STRING, True),
                         (key, 1, V.UINT32, True)]
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        kv_mutations += [(key, SMALL.vocab, V.UINT32, True), (key, 2**32 - 1, V.UINT32, True),
                         (key, -1, V.INT32, True), (key, 0, V.UINT32, False), (key, "1", V.STRING, True)]
    kv_mutations += [
        ("tokenizer.ggml.model", "llama", V.STRING, False), ("tokenizer.ggml.model", "bert", V.STRING, True),
        ("tokenizer.ggml.model", 5, V.UINT32, True), ("tokenizer.ggml.pre", "nonsense", V.STRING, True),
        ("tokenizer.ggml.pre", "qwen2", V.STRING, False),
        ("tokenizer.ggml.tokens", ["a"], V.ARRAY, True), ("tokenizer.ggml.tokens", tokens[:100], V.ARRAY, True),
        ("tokenizer.ggml.tokens", ["a"] * len(tokens), V.ARRAY, True),
        ("tokenizer.ggml.tokens", tokens + ["extra"], V.ARRAY, True),
        ("tokenizer.ggml.tokens", 5, V.UINT32, True),
        ("tokenizer.ggml.merges", ["x y"], V.ARRAY, False), ("tokenizer.ggml.merges", ["h"], V.ARRAY, False),
        ("tokenizer.ggml.merges", ["h e f"], V.ARRAY, False), ("tokenizer.ggml.merges", 5, V.UINT32, True),
        ("tokenizer.ggml.merges", None, V.ARRAY, True),
        ("tokenizer.ggml.token_type", [3] * len(tokens), V.ARRAY, False),
        ("tokenizer.ggml.token_type", [1] * 10, V.ARRAY, True),
        ("tokenizer.ggml.token_type", [1.0] * len(tokens), V.ARRAY, True),  # written as FLOAT32
        ("tokenizer.chat_template", "{% for %}", V.STRING, True), ("tokenizer.chat_template", "{{ x", V.STRING, True),
        ("tokenizer.chat_template", 7, V.UINT32, True), ("tokenizer.chat_template", ["a"], V.ARRAY, True),
        ("tokenizer.ggml.pre", ["a"], V.ARRAY, True),
        ("llama.rope.scaling.type", "linear", V.STRING, True),
        ("llama.rope.scaling.type", "bogus", V.STRING, True),
        ("llama.rope.scaling.factor", float("nan"), V.FLOAT32, True),
        ("llama.attention.key_length", 0, V.UINT32, True), ("llama.attention.key_length", 17, V.UINT32, True),
        ("general.name", "\x00\n\u2028", V.STRING, False),
    ]
    for key, value, vtype, must in kv_mutations:
        def make(d: Path, key: str = key, value: Any = value, vtype: V = vtype) -> Path:
            return write_gguf(d / "m.gguf", metadata={key: None if value is None else (value, vtype)})
        cases.append(Case(f"gguf {key}={value!r:.40} ({vtype.name})", make, must))

    # Tensors the architecture does not consume, or that are missing.
    ones = np.ones(SMALL.hidden, np.float32)
    for extra in ({"blk.2.attn_norm.weight": ones}, {"blk.0.attn_q.bias": ones}, {"rope_freqs.weight": ones},
                  {"blk.01.attn_norm.weight": ones}):
        cases.append(Case(f"gguf extra {list(extra)[0]}",
                          lambda d, extra=extra: write_gguf(d / "m.gguf", extra_tensors=extra), must_fail=True))
    for drop in ("final_norm", "layers.1.down_proj", "embed_tokens"):
        cases.append(Case(f"gguf without {drop}",
                          lambda d, drop=drop: write_gguf(d / "m.gguf", drop_tensors=(drop,)), must_fail=True))
    return cases


# ---- HF directory mutants -------------------------------------------------------------


def _dir_case(name: str, base: Path, edit: Callable[[Path], None], must_fail: bool = False,
              tokenizer: bool = True) -> Case:
    def make(d: Path) -> Path:
        target = d / "model"
        shutil.copytree(base, target)
        edit(target)
        return target
    return Case(name, make, must_fail, tokenizer)


def _edit_config(key: str, value: Any) -> Callable[[Path], None]:
    def edit(m: Path) -> None:
        cfg = json.loads((m / "config.json").read_text())
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
        (m / "config.json").write_text(json.dumps(cfg))
    return edit


_DELETE = object()
SHARD = "model-00001-of-00002.safetensors"


def _header(m: Path, shard: str = SHARD) -> tuple[dict[str, Any], bytes]:
    raw = (m / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _edit_header(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def edit(m: Path) -> None:
        header, blob = _header(m)
        new = change(header)
        encoded = json.dumps(header if new is None else new).encode()
        (m / SHARD).write_bytes(struct.pack("<Q", len(encoded)) + encoded + blob)
    return edit


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return header[next(k for k in header if k != "__metadata__")]


def _set(entry_key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        _first_tensor(header)[entry_key] = value
    return change


def _edit_bytes(file: str, change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(m: Path) -> None:
        (m / file).write_bytes(change((m / file).read_bytes()))
    return edit


def _edit_index(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def edit(m: Path) -> None:
        index_path = m / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        new = change(index)
        index_path.write_text(json.dumps(index if new is None else new))
    return edit


def _map_first(value: Any) -> Callable[[dict[str, Any]], None]:
    def change(index: dict[str, Any]) -> None:
        index["weight_map"][next(iter(index["weight_map"]))] = value
    return change


def _fifo(file: str) -> Callable[[Path], None]:
    def edit(m: Path) -> None:
        (m / file).unlink()
        os.mkfifo(m / file)
    return edit


def _fifo_model(d: Path) -> Path:
    os.mkfifo(d / "m.gguf")
    return d / "m.gguf"


_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "max_position_embeddings")
_REQUIRED_HF = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "architectures")  # a missing kv-head count means num_heads: wrong shapes


def _hf_must_fail(key: str, value: Any) -> bool:
    """Whether config.json with `key` set to `value` cannot describe the small model's weights."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if value is _DELETE:
        return key in _REQUIRED_HF
    if value is None:  # null: 'not set' where config.json has no default for it, else meaningless
        return key in (*_REQUIRED_HF, "rms_norm_eps", "max_position_embeddings")
    if key in _COUNTS:  # only the context may differ from the weights' sizes
        return not (key == "max_position_embeddings" and is_int and value >= 1)
    if key == "rms_norm_eps":
        return not (isinstance(value, float) and 0 < value < 1)
    if key == "rope_theta":
        return not ((is_int or isinstance(value, float)) and 0 < value < float("inf"))
    if key == "tie_word_embeddings":
        return not isinstance(value, bool)
    if key in ("bos_token_id", "eos_token_id"):
        return not ((is_int and 0 <= value < SMALL.vocab) or (key == "eos_token_id" and value == []))
    if key == "rope_scaling":
        return value != {}
    if key == "sliding_window":
        return not (is_int and value >= 0)
    return True  # architectures, hidden_act: none of the values names a supported one


def hf_cases(tmp: Path, rng: random.Random) -> list[Case]:
    base = write_hf(tmp / "base_hf")
    cases = [_dir_case("hf unchanged", base, lambda m: None)]
    values: list[Any] = [0, -1, 2**32 - 1, 1e12, "64", 2.5, True, [], {}, float("nan"), None, _DELETE, 3]
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "architectures", "rope_scaling",
            "sliding_window", "hidden_act"]
    for key in keys:
        for value in rng.sample(values, 5):
            cases.append(_dir_case(f"hf config {key}={value if value is not _DELETE else '(deleted)'!r:.30}",
                                   base, _edit_config(key, value), _hf_must_fail(key, value)))
    for scaling in ({"rope_type": "linear"}, {"rope_type": "linear", "factor": "2"}, {"rope_type": 5},
                    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                     "low_freq_factor": 1.0, "high_freq_factor": 1.0}, {"rope_type": "dynamic", "factor": -1}):
        cases.append(_dir_case(f"hf rope_scaling {scaling}", base, _edit_config("rope_scaling", scaling), True))
    cases += [
        _dir_case("hf config.json cut", base, _edit_bytes("config.json", lambda b: b[: len(b) // 2]), True),
        _dir_case("hf config.json array", base, _edit_bytes("config.json", lambda b: b"[" + b + b"]"), True),
        _dir_case("hf config.json not utf-8", base, _edit_bytes("config.json", lambda b: b"\xff" + b), True),
        _dir_case("hf config.json empty", base, _edit_bytes("config.json", lambda b: b""), True),
        _dir_case("hf config.json deleted", base, lambda m: (m / "config.json").unlink(), True),
    ]

    # safetensors header edits (the first shard).
    header_edits: list[tuple[str, Callable[[dict[str, Any]], Any], bool]] = [
        ("top-level array", lambda h: [1, 2], True), ("entry a number", lambda h: h.update({"x": 5}), True),
        ("dtype F64", _set("dtype", "F64"), True), ("dtype 5", _set("dtype", 5), True),
        ("dtype I8", _set("dtype", "I8"), True), ("dtype F16", _set("dtype", "F16"), True),
        ("shape []", _set("shape", []), True), ("shape [-1, 64]", _set("shape", [-1, 64]), True),
        ("shape [64.0]", _set("shape", [64.0]), True), ("shape ['64']", _set("shape", ["64"]), True),
        ("shape huge", _set("shape", [2**40, 2**40]), True), ("offsets [0]", _set("data_offsets", [0]), True),
        ("offsets reversed", lambda h: _first_tensor(h).update(data_offsets=_first_tensor(h)["data_offsets"][::-1]), True),
        ("offsets past the end", _set("data_offsets", [0, 2**40]), True),
        ("offsets shifted", lambda h: _first_tensor(h).update(
            data_offsets=[x + 4 for x in _first_tensor(h)["data_offsets"]]), True),
        ("no dtype", lambda h: _first_tensor(h).pop("dtype"), True),
        ("metadata a number", lambda h: h.update({"__metadata__": 5}), False),
        ("a tensor dropped", lambda h: h.pop(next(k for k in h if k != "__metadata__")), True),
        ("a tensor renamed", lambda h: h.update({"model.layers.7.mlp.up_proj.weight": h.pop(
            next(k for k in h if k.startswith("model.layers.")))}), True),
    ]
    for label, change, must in header_edits:
        cases.append(_dir_case(f"hf header {label}", base, _edit_header(change), must))
    for label, change in (("length 0", lambda b: struct.pack("<Q", 0) + b[8:]),
                          ("length 2^63", lambda b: struct.pack("<Q", 2**63) + b[8:]),
                          ("length +1", lambda b: struct.pack("<Q", struct.unpack("<Q", b[:8])[0] + 1) + b[8:]),
                          ("not utf-8", lambda b: b[:8] + b"\xff" + b[9:]),
                          ("deep nesting", lambda b: struct.pack("<Q", 200_001) + b"[" * 100_000 + b"1" + b"]" * 100_000)):
        cases.append(_dir_case(f"hf header {label}", base, _edit_bytes(SHARD, change), must_fail=True))
    size = (base / SHARD).stat().st_size
    for cut in sorted(rng.sample(range(size), 12)):
        cases.append(_dir_case(f"hf shard cut at {cut}", base, _edit_bytes(SHARD, lambda b, c=cut: b[:c]), True))
    for at in rng.sample(range(size), 20):
        def flip(b: bytes, at: int = at, x: int = rng.randrange(1, 256)) -> bytes:
            out = bytearray(b)
            out[at] ^= x
            return bytes(out)
        cases.append(_dir_case(f"hf shard byte {at} flipped", base, _edit_bytes(SHARD, flip)))

    # index.json names.
    for label, change in (("/etc/passwd", _map_first("/etc/passwd")), ("../../etc/hostname", _map_first("../../etc/hostname")),
                          ("empty name", _map_first("")), ("a number", _map_first(5)), ("null", _map_first(None)),
                          ("sub/../../x", _map_first("sub/../../x")), ("C:\\x", _map_first("C:\\x")),
                          ("missing shard", _map_first("model-00009-of-00009.safetensors")),
                          ("weight_map a list", lambda i: i.update(weight_map=[1])),
                          ("top-level array", lambda i: [i])):
        cases.append(_dir_case(f"hf index {label}", base, _edit_index(change), must_fail=True))

    # Tokenizer files.
    cases += [
        _dir_case("hf tokenizer.json cut", base, _edit_bytes("tokenizer.json", lambda b: b[:100]), True),
        _dir_case("hf chat_template.jinja not utf-8", base, _edit_bytes("chat_template.jinja", lambda b: b + b"\xff"), True),
        _dir_case("hf chat_template.jinja bad syntax", base, _edit_bytes("chat_template.jinja", lambda b: b"{% for %}"), True),
        _dir_case("hf tokenizer_config.json cut", base, _edit_bytes("tokenizer_config.json", lambda b: b[:5]), True),
    ]
    # Non-regular files.
    if hasattr(os, "mkfifo"):
        cases.append(_dir_case("hf shard is a FIFO", base, _fifo(SHARD), must_fail=True))
        cases.append(Case("gguf model is a FIFO", _fifo_model, must_fail=True))
    cases.append(_dir_case("hf shard is a directory", base, lambda m: ((m / SHARD).unlink(), (m / SHARD).mkdir()), True))

    # The committed tiny fixture (no tokenizer).
    tiny = FIXTURES / "tiny_llama"
    tiny_size = (tiny / "model.safetensors").stat().st_size
    for cut in sorted(rng.sample(range(tiny_size), 5)):
        cases.append(_dir_case(f"tiny_llama cut at {cut}", tiny,
                               _edit_bytes("model.safetensors", lambda b, c=cut: b[:c]), True, tokenizer=False))
    for at in rng.sample(range(2000), 8):  # mostly the header
        def flip_tiny(b: bytes, at: int = at, x: int = rng.randrange(1, 256)) -> bytes:
            out = bytearray(b)
            out[at] ^= x
            return bytes(out)
        cases.append(_dir_case(f"tiny_llama byte {at} flipped", tiny, _edit_bytes("model.safetensors", flip_tiny),
                               tokenizer=False))
    cases.append(_dir_case("tiny_llama unchanged", tiny, lambda m: None, tokenizer=False))
    return cases


def test_mutated_model_files_fail_cleanly_or_load(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    cases = gguf_cases(tmp_path, rng) + hf_cases(tmp_path, rng)
    assert len(cases) >= 300
    loaded, failed, loaded_but_must_fail = [], [], []
    for n, case in enumerate(cases):
        workdir = tmp_path / f"case{n}"
        workdir.mkdir()
        message = outcome(case, workdir)
        (failed if message is not None else loaded).append(case.name)
        if message is None and case.must_fail:
            loaded_but_must_fail.append(case.name)
        shutil.rmtree(workdir)
    assert not loaded_but_must_fail, f"corrupt files that loaded: {loaded_but_must_fail}"
    for name in ("gguf unchanged", "hf unchanged", "tiny_llama unchanged"):
        assert name in loaded
    assert len(failed) > len(cases) // 2  # the mutations mostly break something checkable


def test_the_mutation_inputs_are_complete(tmp_path: Path) -> None:
    """The bases exercise the tokenizer (merges, control tokens) and the chat template."""
    tok = Tokenizer.from_model(write_gguf(tmp_path / "m.gguf"))
    assert tok.encode("hello", add_special_tokens=False) == [260, 111]
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (BOS, EOS)
    cfg = hf_config(SMALL)
    assert cfg["vocab_size"] == len(byte_level_tokens())


@pytest.mark.parametrize("kind", ["truncated gguf", "gguf with zero heads", "hf shard outside the directory"])
def test_cli_generate_on_a_corrupt_model_is_one_line(tmp_path: Path, kind: str) -> None:
    import subprocess
    import sys

    if kind == "truncated gguf":
        model = tmp_path / "m.gguf"
        model.write_bytes(write_gguf(tmp_path / "full.gguf").read_bytes()[:5000])
    elif kind == "gguf with zero heads":
        model = write_gguf(tmp_path / "m.gguf", metadata={"llama.attention.head_count": (0, V.UINT32)})
    else:
        model = write_hf(tmp_path / "m")
        _edit_index(_map_first("../../etc/passwd"))(model)
    proc = subprocess.run(
        [sys.executable, "-m", "vkrt.cli", "generate", "hi", "--model", str(model), "--device", "reference",
         "-n", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vkrt: error: ") and str(model) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
