"""Small but complete model files for the validation and mutation tests.

A GGUF (mixed f32/Q8_0/Q4_0 weights, a byte-level BPE vocabulary with merges and control
tokens, a chat template) and a sharded HF directory (config.json, two safetensors shards
and their index, tokenizer.json, tokenizer_config.json, chat_template.jinja), both a
few hundred KB, so hundreds of mutated copies load in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from loader_fixtures import (
    TinyLlama,
    converter_permute,
    gguf_name,
    hf_config,
    hf_weights,
    write_hf_dir,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

MERGES = ["h e", "l l", "Ġ t", "Ġt he", "he ll"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 256 + len(MERGES), 256 + len(MERGES) + 2
SMALL = TinyLlama(vocab=256 + len(MERGES) + len(SPECIALS), hidden=64, intermediate=128, layers=2,
                  heads=4, kv_heads=2, head_dim=16)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GGUF_TYPES = {"q_proj": Q.Q8_0, "k_proj": Q.Q8_0, "v_proj": Q.Q8_0, "gate_proj": Q.Q4_0, "up_proj": Q.Q4_0}


def byte_level_tokens() -> list[str]:
    """GPT-2's 256 byte characters in byte order, the merged pieces, then the control tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + SPECIALS


def token_types() -> list[int]:
    return [1] * (256 + len(MERGES)) + [3] * len(SPECIALS)


def default_metadata(arch: str = "llama", cfg: TinyLlama = SMALL) -> dict[str, tuple[Any, V]]:
    """Every key/value the small GGUF carries: key -> (value, GGUF type)."""
    return {
        "general.name": ("small-llama", V.STRING),
        "general.alignment": (32, V.UINT32),
        f"{arch}.context_length": (256, V.UINT32),
        f"{arch}.embedding_length": (cfg.hidden, V.UINT32),
        f"{arch}.block_count": (cfg.layers, V.UINT32),
        f"{arch}.feed_forward_length": (cfg.intermediate, V.UINT32),
        f"{arch}.attention.head_count": (cfg.heads, V.UINT32),
        f"{arch}.attention.head_count_kv": (cfg.kv_heads, V.UINT32),
        f"{arch}.rope.dimension_count": (cfg.head_dim, V.UINT32),
        f"{arch}.rope.freq_base": (10000.0, V.FLOAT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("smollm", V.STRING),
        "tokenizer.ggml.tokens": (byte_level_tokens(), V.ARRAY),
        "tokenizer.ggml.token_type": (token_types(), V.ARRAY),
        "tokenizer.ggml.merges": (list(MERGES), V.ARRAY),
        "tokenizer.ggml.bos_token_id": (BOS, V.UINT32),
        "tokenizer.ggml.eos_token_id": (EOS, V.UINT32),
        "tokenizer.chat_template": (CHAT_TEMPLATE, V.STRING),
    }


_ARRAY_TYPES = {"tokenizer.ggml.tokens": V.STRING, "tokenizer.ggml.merges": V.STRING,
                "tokenizer.ggml.token_type": V.INT32}


def _array_type(key: str, value: list[Any]) -> V:
    """The element type an array is written with: FLOAT32 for floats (a mistyped array),
    else the key's usual type."""
    if value and isinstance(value[0], float):
        return V.FLOAT32
    return _ARRAY_TYPES.get(key, V.STRING if value and isinstance(value[0], str) else V.INT32)


def write_gguf(
    path: Path,
    *,
    metadata: dict[str, tuple[Any, V] | None] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop_tensors: tuple[str, ...] = (),
    cfg: TinyLlama = SMALL,
    seed: int = 0,
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """The small GGUF, with `metadata` entries replacing (or, when None, removing) defaults and
    `qtypes` (by projection name, e.g. "gate_proj") replacing GGUF_TYPES entries."""
    kv: dict[str, tuple[Any, V] | None] = {**default_metadata(cfg=cfg), **(metadata or {})}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, entry in kv.items():
        if entry is None or key in ("general.architecture", "general.alignment"):
            continue
        value, vtype = entry
        sub = _array_type(key, value) if vtype == V.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    if kv.get("general.alignment") is not None:
        w.add_custom_alignment(kv["general.alignment"][0])  # type: ignore[index]
    for name, data in hf_weights(cfg, seed=seed, tied=True).items():
        if name in drop_tensors:
            continue
        if name.endswith(("q_proj", "k_proj")):
            data = converter_permute(data, cfg.heads if name.endswith("q_proj") else cfg.kv_heads)
        qtype = {**GGUF_TYPES, **(qtypes or {})}.get(name.rsplit(".", 1)[-1], Q.F32)
        if qtype == Q.F32:
            w.add_tensor(gguf_name(name), data)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tokenizer_files(model_dir: Path) -> None:
    """tokenizer.json (the same byte-level BPE), tokenizer_config.json and chat_template.jinja."""
    tokens = byte_level_tokens()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in MERGES])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "chat_template": CHAT_TEMPLATE}))
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_hf(model_dir: Path, config: dict[str, Any] | None = None, shards: int = 2, seed: int = 0) -> Path:
    """The small sharded HF directory (untied lm_head) with its tokenizer files."""
    write_hf_dir(model_dir, hf_weights(SMALL, seed=seed, tied=False),
                 config or hf_config(SMALL, bos_token_id=BOS, eos_token_id=EOS), shards=shards)
    write_tokenizer_files(model_dir)
    return model_dir
