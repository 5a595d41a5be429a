"""tools/make_moe_bench.py: its Q4_K encoder decodes (by the gguf package and by vkrt) to the
values it encoded, and the pair it writes loads with the shapes the benchmark claims and an
embedded vocabulary that round-trips text (llama.cpp, the peer, loads no GGUF without one)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from tests.tools.conftest import load_tool
from vkrt.core.quant import dequantize
from vkrt.loader import load_model
from vkrt.tokenizer import Tokenizer


def _tool() -> ModuleType:
    return load_tool("make_moe_bench")


def test_q4_k_encoder_round_trips(rng: np.random.Generator) -> None:
    """Every value within half a grid step of its sub-block (plus the f16 rounding of the
    scales), and vkrt's decoder equal to the gguf package's bit for bit."""
    x = (rng.standard_normal((16, 512)) * 0.02).astype(np.float32)
    x[0, :32] = 0.0  # a constant sub-block
    x[1] = np.abs(x[1])  # no negative values: min 0
    blocks = _tool().quantize_q4_k(x)
    assert blocks.shape == (16, 2 * 144) and blocks.dtype == np.uint8
    got = gguf_dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    np.testing.assert_array_equal(dequantize(blocks, "q4_k").reshape(x.shape), got)
    sub = x.reshape(16, -1, 32)
    step = (sub.max(axis=2) - np.minimum(sub.min(axis=2), 0.0)) / 15.0
    err = np.abs(got - x).reshape(16, -1, 32).max(axis=2)
    assert np.all(err <= 0.6 * step + 1e-4), float((err - 0.6 * step).max())
    np.testing.assert_array_equal(got[0, :32], 0.0)


def test_the_pair_loads_with_its_vocabulary(tmp_path: Path, monkeypatch) -> None:
    tool = _tool()
    monkeypatch.setattr(sys, "argv", ["make_moe_bench.py", "--out", str(tmp_path), "--layers", "1"])
    tool.main()
    moe, dense = load_model(tmp_path / "moe.gguf"), load_model(tmp_path / "dense.gguf")
    assert (moe.config.num_experts, moe.config.num_experts_per_tok, moe.config.moe_intermediate_size) == (32, 4, 512)
    assert moe.config.hidden_size == dense.config.hidden_size == 1024 and dense.config.intermediate_size == 2048
    assert moe.weights["layers.0.experts.gate_proj"].fmt == dense.weights["layers.0.gate_proj"].fmt == "q4_k"
    for path in (tmp_path / "moe.gguf", tmp_path / "dense.gguf"):
        tok = Tokenizer.from_gguf(path)
        text = "Prefill and decode, step by step: 42 experts!"
        ids = tok.encode(text)
        assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges applied
        assert tok.vocab_size == 8192 and tok.eos_token_ids == (8191,)
