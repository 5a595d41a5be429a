"""Builders for tiny synthetic llama checkpoints (GGUF and HF safetensors) used by loader tests."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np


@dataclass(frozen=True)
class TinyLlama:
    """Hyper-parameters of the synthetic checkpoints (in_features multiples of 256 for K-quants)."""

    vocab: int = 32
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64


TINY = TinyLlama()


def hf_weights(cfg: TinyLlama = TINY, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights in HF layout, keyed by canonical name."""
    rng = np.random.default_rng(seed)
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (cfg.vocab, cfg.hidden), "final_norm": (cfg.hidden,)}
    if not tied:
        shapes["lm_head"] = (cfg.vocab, cfg.hidden)
    for i in range(cfg.layers):
        shapes |= {
            f"layers.{i}.attn_norm": (cfg.hidden,),
            f"layers.{i}.q_proj": (q_rows, cfg.hidden),
            f"layers.{i}.k_proj": (kv_rows, cfg.hidden),
            f"layers.{i}.v_proj": (kv_rows, cfg.hidden),
            f"layers.{i}.o_proj": (cfg.hidden, q_rows),
            f"layers.{i}.ffn_norm": (cfg.hidden,),
            f"layers.{i}.gate_proj": (cfg.intermediate, cfg.hidden),
            f"layers.{i}.up_proj": (cfg.intermediate, cfg.hidden),
            f"layers.{i}.down_proj": (cfg.hidden, cfg.intermediate),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama q/k rows (HF -> GGUF order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "embed_tokens": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}


def gguf_name(canonical: str) -> str:
    if canonical.startswith("layers."):
        _, i, short = canonical.split(".")
        return f"blk.{i}.{_GGUF_NAMES[short]}"
    return _GGUF_NAMES[canonical]


def _storage(data: np.ndarray, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """The array GGUFWriter should store for `data` as `qtype`."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return (data.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(data.shape[0], -1)
    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:  # K-quants: gguf-py only decodes them; any bytes will do
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(seed)
        return rng.integers(0, 256, (data.shape[0], data.shape[1] // block * size), dtype=np.uint8)


def write_llama_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    cfg: TinyLlama = TINY,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    *,
    arch: str = "llama",
    permute: bool = True,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a llama GGUF the way llama.cpp's converter would; return the stored arrays by canonical name."""
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(512)
    w.add_embedding_length(cfg.hidden)
    w.add_block_count(cfg.layers)
    w.add_feed_forward_length(cfg.intermediate)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if metadata is not None:
        metadata(w)
    stored: dict[str, np.ndarray] = {}
    for n, (name, data) in enumerate(weights.items()):
        if permute and name.endswith(("q_proj", "k_proj")):
            data = converter_permute(data, cfg.heads if name.endswith("q_proj") else cfg.kv_heads)
        qtype = types.get(name, gguf.GGMLQuantizationType.F32)
        stored[name] = _storage(data, qtype, seed=n)
        raw = None if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else qtype
        w.add_tensor(gguf_name(name), stored[name], raw_dtype=raw)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


_HF_NAMES = {
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


def hf_name(canonical: str) -> str:
    if canonical.startswith("layers."):
        _, i, short = canonical.split(".")
        return f"model.layers.{i}.{_HF_NAMES[short]}"
    return _HF_NAMES[canonical]


def hf_config(cfg: TinyLlama = TINY, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Minimal safetensors writer (name -> (dtype tag, array)); lets tests store BF16 bits."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, (dtype, array) in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def write_hf_dir(
    model_dir: Path,
    weights: dict[str, np.ndarray],
    config: dict[str, Any],
    dtype: str = "F32",
    shards: int = 1,
) -> None:
    """A HF model directory; with shards > 1 it gets model.safetensors.index.json."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    encode = {
        "F32": lambda a: a,
        "F16": lambda a: a.astype(np.float16),
        "BF16": lambda a: (a.view(np.uint32) >> 16).astype(np.uint16),
    }[dtype]
    items = [(hf_name(name), (dtype, encode(array))) for name, array in weights.items()]
    if shards == 1:
        write_safetensors(model_dir / "model.safetensors", dict(items))
        return
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(items[s::shards])
        write_safetensors(model_dir / file, part)
        weight_map |= {name: file for name in part}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
