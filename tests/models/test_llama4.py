"""Llama 4 text: its config traits, its decode step's dispatches and its multimodal checkpoint
(the goldens themselves: tests/models/test_families.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from tests.models.test_families import FAMILY_LOGIT_ATOL, MAX_LEN
from vkrt.backend.base import Backend
from vkrt.errors import UnsupportedModelError
from vkrt.loader import load_model
from vkrt.loader.hf_loader import read_safetensors
from vkrt.models.decoder import DecoderModel


def _golden(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden.json").read_text())


def test_llama4_layer_traits() -> None:
    """RoPE layers chunked and QK-normed, the NoPE layer global with the temperature; MoE every other
    layer; dense MLPs intermediate_size_mlp wide. The GGUF has llama.cpp's chunks of 8192."""
    c = load_model(FIXTURES / "tiny_llama4").config
    assert [(layer.rope, layer.window, layer.chunked, layer.moe) for layer in c.layers] == [
        (True, 8, True, False), (True, 8, True, True), (True, 8, True, False), (False, 0, False, True)]
    assert (c.intermediate_size, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (128, 32, 32)
    assert (c.qk_l2_norm, c.moe_input_scaled, c.moe_router, c.num_experts_per_tok) == (True, True, "sigmoid", 1)
    assert (c.query_temperature_beta, c.query_temperature_length, c.query_temperature_shift) == (0.5, 4, 1)
    g = load_model(FIXTURES / "tiny_llama4_gguf" / "model.gguf").config
    assert [(layer.rope, layer.window, layer.moe) for layer in g.layers] == [
        (True, 8192, False), (True, 8192, True), (True, 8192, False), (False, 0, True)]
    assert (g.intermediate_size, g.moe_intermediate_size, g.query_temperature_length) == (128, 32, 8192)


def test_llama4_decode_step_dispatches(vk_default: Backend) -> None:
    """41 dispatches a step for these 4 layers: embedding, the gather and the normed LM head (3);
    attention 4 a layer (RoPE: normed qkv matmul, QK-norm + RoPE + KV write, attention, o_proj +
    residual; NoPE: the normed qkv matmul with RoPE and KV write, the temperature, attention,
    o_proj + residual); a dense MLP 2 (normed gate_up with SwiGLU, down + residual); a MoE MLP 9
    (norm, router matmul, sigmoid top-1, input times score, the expert's gated gate_up and its down,
    the shared expert's gate_up and its down + the expert's output, residual): 3 + 16 + 4 + 18."""
    model = DecoderModel(load_model(FIXTURES / "tiny_llama4"), vk_default)
    case = _golden("tiny_llama4")["cases"][-1]
    driver = Greedy(model, max_len=MAX_LEN)
    assert driver.generate(case["input_ids"], 4) == case["greedy_ids"][:4]
    assert {c["dispatches"] for c in driver.step_counters[1:]} == {41}
    assert {c["drains"] for c in driver.step_counters} == {0}


def test_llama4_multimodal_checkpoint_loads_its_language_model(tmp_path: Path, ref: Backend,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Llama4ForConditionalGeneration: text_config is the model, saved under language_model.; the
    vision tower and the projector are skipped with one line each and the logits are the text model's."""
    from safetensors.numpy import save_file

    src = FIXTURES / "tiny_llama4"
    d = tmp_path / "llama4_vl"
    d.mkdir()
    text = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                               "model_type": "llama4", "text_config": text,
                                               "vision_config": {"hidden_size": 8}}))
    tensors = {f"language_model.{name}": np.array(data) for name, (_, _, data)
               in read_safetensors(src / "model.safetensors").items()}
    tensors |= {"vision_model.patch_embedding.weight": np.zeros((4, 4), np.float32),
                "multi_modal_projector.linear_1.weight": np.zeros((4, 4), np.float32)}
    save_file(tensors, str(d / "model.safetensors"))
    shutil.copy(src / "golden.json", d / "golden.json")
    with caplog.at_level("INFO", logger="vkrt.loader.hf_loader"):
        model = DecoderModel(load_model(d), ref)
    for what in ("skipped the vision tower (1 tensor)", "skipped the multimodal projector (1 tensor)"):
        assert what in caplog.text
    case = _golden("tiny_llama4")["cases"][-1]
    logits = Greedy(model, max_len=MAX_LEN).step(case["input_ids"], 0, all_logits=True)
    assert float(np.abs(logits - np.array(case["all_logits"], np.float32)).max()) <= FAMILY_LOGIT_ATOL


def test_llama4_refuses_more_than_one_expert_per_token(tmp_path: Path) -> None:
    d = tmp_path / "top2"
    shutil.copytree(FIXTURES / "tiny_llama4", d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 2}))
    with pytest.raises(UnsupportedModelError, match="one expert per token"):
        load_model(d)
