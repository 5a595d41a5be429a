"""gpt-oss beyond the family goldens (tests/models/test_families.py): what a decode step runs,
and the config checks of its own fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.errors import ModelFormatError
from vkrt.loader import load_model
from vkrt.models.decoder import DecoderModel

# Per layer: the qkv matmul with its norm and bias, qkv_rope_kv_write, attention with sinks,
# o_proj with its bias, the residual add; the MLP's norm, the router with the norm folded in and
# its bias, route, gate|up, its expert biases, the clamped SwiGLU, down, its biases, combine,
# the residual add.
DISPATCHES_PER_LAYER = 15


@pytest.mark.parametrize("name", ["tiny_gpt_oss", "tiny_gpt_oss_gguf", "tiny_gpt_oss_mxfp4_gguf", "tiny_gpt_oss_mxfp4"])
def test_decode_step_dispatches(name: str, vk_default: Backend) -> None:
    """A decode step: the embedding, 15 per layer, the gather and the normed LM head; every op
    native (0 drains), the attention the paged kernel with its sinks; MXFP4 experts stay MXFP4
    on the device."""
    golden = json.loads((FIXTURES / name / "golden.json").read_text())
    model = DecoderModel(load_model(FIXTURES / name / golden["meta"].get("model_file", "")), vk_default)
    assert all(layer.mixer.sinks is not None for layer in model.weights.layers)
    expert_format = "mxfp4" if "mxfp4" in name else "f32"
    assert all(w.dtype == expert_format for layer in model.weights.layers for w in (*layer.mlp.gate_up, layer.mlp.down))
    case = golden["cases"][-1]
    before = dict(vk_default.selections)
    driver = Greedy(model, max_len=64)
    assert driver.generate(case["input_ids"], 4) == case["greedy_ids"][:4]
    ran = {op for (op, _), n in vk_default.selections.items() if n > before.get((op, _), 0)}
    assert {"paged_attention_sinks", "clamped_swiglu", "moe_add_bias"} <= ran
    decode = driver.step_counters[1:]
    assert {c["dispatches"] for c in decode} == {1 + DISPATCHES_PER_LAYER * model.config.num_layers + 2}
    assert {c["drains"] for c in driver.step_counters} == {0}


@pytest.mark.parametrize("value", [0, -1.0, "7"])
def test_swiglu_limit_is_checked(tmp_path: Path, value: object) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny_gpt_oss", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"swiglu_limit": value}))
    with pytest.raises(ModelFormatError, match="swiglu_limit must be a positive number"):
        load_model(model_dir)
