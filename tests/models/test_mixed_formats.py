"""Projections stored in different formats (as in Q4_K_M GGUFs: Q8_0 v beside Q5_0 q/k, a
Q6_K up beside a Q4_K gate) stay in their own formats, as separate matmuls whose outputs are
concatenated, and must mean what the stacked model means.

Each case writes two GGUFs of a tiny fixture's weights: one with v and up stored as f16
(three q/k/v matmuls and two gate/up matmuls, concatenated) and one with those same
f16-rounded values stored as f32 (every layer stacked). Both hold exactly the same numbers,
so their logits must agree to f32 rounding, their greedy ids exactly. tiny_qwen2_gguf adds
q/k/v biases, which join each separate projection before the concat.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.loader import load_model
from vkrt.models.decoder import DecoderModel
from vkrt.models.weights import Mlp

APART = ("attn_v.weight", "ffn_up.weight")
# Same numbers through other kernels (f16 vs f32 matvec, one concat): measured ~1e-6.
LOGIT_ATOL = 1e-4


def _write(src: Path, dst: Path, apart_dtype: type) -> None:
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, int(value))
    for t in reader.tensors:
        data = np.array(t.data).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if t.name.endswith(APART):
            data = data.astype(np.float32).astype(np.float16).astype(apart_dtype)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("fixture", ["tiny_qwen2_gguf", "tiny_qwen3_gguf", "tiny_gemma3_gguf"])
@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_projections_apart_mean_what_stacked_ones_mean(fixture: str, device: str, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    backend: Backend = request.getfixturevalue("ref" if device == "reference" else "vk_default")
    src = FIXTURES / fixture / "model.gguf"
    _write(src, tmp_path / "apart.gguf", np.float16)
    _write(src, tmp_path / "stacked.gguf", np.float32)
    apart = DecoderModel(load_model(tmp_path / "apart.gguf"), backend)
    stacked = DecoderModel(load_model(tmp_path / "stacked.gguf"), backend)
    assert all(len(layer.mixer.qkv.parts) == 3 and isinstance(layer.mlp, Mlp) and len(layer.mlp.gate_up.parts) == 2
               for layer in apart.weights.layers)
    assert all(len(layer.mixer.qkv.parts) == 1 and isinstance(layer.mlp, Mlp) and len(layer.mlp.gate_up.parts) == 1
               for layer in stacked.weights.layers)
    prompt = [3, 17, 42, 7, 99, 5, 61, 23, 11, 2, 80, 31]
    got = Greedy(apart, max_len=64).step(prompt, 0, all_logits=True)
    want = Greedy(stacked, max_len=64).step(prompt, 0, all_logits=True)
    assert float(np.abs(got - want).max()) <= LOGIT_ATOL
    assert Greedy(apart, max_len=64).generate(prompt, 12) == Greedy(stacked, max_len=64).generate(prompt, 12)
