"""Gemma 4's config, its shared KV cache and its decode step; its fixtures' goldens run in
tests/models/test_families.py (tiny_gemma4, tiny_gemma4_moe, tiny_gemma4_vl)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.engine import LLM, SamplingParams
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.models.decoder import DecoderModel
from vkrt.models.weights import MlpAndExperts


def _edited(tmp_path: Path, name: str, **changes: object) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | changes))
    return out


def test_dense_layers_have_their_own_shapes_and_kv_sources() -> None:
    """Full layers (2, 5) have heads of 32 and proportional RoPE on a quarter of their pairs; the
    last two layers read layers 3's and 2's K/V and have double-wide MLPs (128)."""
    c = load_model(FIXTURES / "tiny_gemma4").config
    assert [c.head_dim_of(i) for i in range(6)] == [16, 16, 32, 16, 16, 32]
    assert [c.kv_layer_of(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert [c.ffn_width_of(i) for i in range(6)] == [64] * 4 + [128] * 2
    assert c.layer(2).rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (c.rotary_dim, c.query_scale, c.v_norm, c.per_layer_input_size, c.final_softcap) == (0, 1.0, True, 8, 30.0)
    assert c.norm_offset == 0.0  # Gemma 4's norms scale by w, not 1 + w


def test_shared_layers_store_no_kv(ref: Backend) -> None:
    """Layers 4 and 5 attend over layers 3's and 2's caches: no tensors of their own, no bytes in
    the per-token count the engine sizes its pools by (f16: 3 sliding layers of 1 x 16 and one full
    of 1 x 32, K and V: 320 bytes, not the 512 a cache per layer would take)."""
    model = DecoderModel(load_model(FIXTURES / "tiny_gemma4"), ref)
    kv = model.allocate_kv_cache(4, block_size=16, dtype="f16")
    assert sorted(kv.keys) == sorted(kv.values) == [0, 1, 2, 3]
    assert model.kv_bytes_per_block(1, "f16") == 320
    assert kv.nbytes == 4 * model.kv_bytes_per_block(16, "f16")
    # q|k|v stacked where the layer writes K/V (2 + 2 heads of 16, or of 32), q alone where it reads another's
    assert [[p.shape[0] for p in layer.mixer.qkv.parts] for layer in model.weights.layers] == [
        [64], [64], [128], [64], [32], [64]]


def test_moe_layers_run_mlp_beside_experts_and_full_layers_k_eq_v() -> None:
    c = load_model(FIXTURES / "tiny_gemma4_moe").config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_beside_mlp) == (4, 2, 16, True)
    assert [c.layer(i).k_eq_v for i in range(4)] == [False, True, False, True]
    assert [(c.kv_heads_of(i), c.head_dim_of(i)) for i in range(4)] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    weights = load_model(FIXTURES / "tiny_gemma4_moe").weights
    assert "layers.1.v_proj" not in weights and "layers.0.v_proj" in weights


@pytest.mark.parametrize("name", ["tiny_gemma4", "tiny_gemma4_moe"])
def test_gguf_from_llama_cpp_reads_as_its_hf_config(name: str) -> None:
    """llama.cpp's converter writes the full layers' head dim as key_length (the sliding ones' as
    key_length_swa), per-layer KV heads and FFN widths, shared_kv_layers, and proportional RoPE as
    rope_freqs (1 for the rotating pairs, 1e30 after): read back, the same layers and traits."""
    hf = load_model(FIXTURES / name).config
    gguf = load_model(FIXTURES / f"{name}_gguf" / "model.gguf")
    c = gguf.config
    assert c.layers == hf.layers and "rope_freqs" not in gguf.weights
    assert (c.head_dim, c.num_kv_heads, c.intermediate_size, c.query_scale, c.v_norm) == (
        hf.head_dim, hf.num_kv_heads, hf.intermediate_size, 1.0, True)
    assert (c.per_layer_input_size, c.per_layer_vocab_size, c.num_experts, c.moe_beside_mlp) == (
        hf.per_layer_input_size, hf.per_layer_vocab_size, hf.num_experts, hf.moe_beside_mlp)


@pytest.mark.parametrize(("name", "changes"), [
    ("tiny_gemma4", {"global_head_dim": 32}),
    ("tiny_gemma4_moe", {"global_head_dim": 32, "num_global_key_value_heads": 1}),
])
def test_global_head_dim_spelling_reads_as_per_layer_config(tmp_path: Path, name: str, changes: dict) -> None:
    """The released checkpoints' config.json spells the full layers' shape as global_head_dim (and
    num_global_key_value_heads with K = V), which transformers 5.24 saves as per_layer_config."""
    edited = load_model(_edited(tmp_path, name, per_layer_config=None, **changes)).config
    assert edited.layers == load_model(FIXTURES / name).config.layers


def test_moe_flag_off_reads_a_dense_model(tmp_path: Path) -> None:
    """The expert fields without enable_moe_block describe no experts (transformers builds none)."""
    loaded = load_model(_edited(tmp_path, "tiny_gemma4", enable_moe_block=False, num_experts=4, top_k_experts=2))
    assert loaded.config.num_experts == 0 and not any(layer.moe for layer in loaded.config.layers)


def test_multimodal_checkpoint_skips_the_vision_tower_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    text = load_model(FIXTURES / "tiny_gemma4")
    with caplog.at_level("INFO", logger="vkrt.loader.hf_loader"):
        vl = load_model(FIXTURES / "tiny_gemma4_vl")
    assert vl.config.layers == text.config.layers and sorted(vl.weights) == sorted(text.weights)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "the vision tower (16 tensors)" in skipped[0]


@pytest.mark.parametrize(("changes", "needle"), [
    ({"per_layer_config": {"9": {"head_dim": 32}}}, "per_layer_config must map layer indices below 6"),
    ({"per_layer_config": {"2": {"head_dim": 0}}}, "per_layer_config.2.head_dim must be a positive integer"),
    ({"num_kv_shared_layers": 5}, "none of the first 1 layers is one"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2}}},
     "partial_rotary_factor is 2"),
    ({"hidden_size_per_layer_input": "8"}, "hidden_size_per_layer_input must be a positive integer"),
])
def test_bad_config_is_one_line(tmp_path: Path, changes: dict, needle: str) -> None:
    with pytest.raises(ModelFormatError) as exc:
        load_model(_edited(tmp_path, "tiny_gemma4", **changes))
    assert "\n" not in str(exc.value) and needle in str(exc.value), str(exc.value)


def test_bidirectional_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(_edited(tmp_path, "tiny_gemma4", use_bidirectional_attention="all"))
    assert "\n" not in str(exc.value) and "use_bidirectional_attention is 'all'" in str(exc.value)
    vision = load_model(_edited(tmp_path / "vision", "tiny_gemma4", use_bidirectional_attention="vision"))
    assert vision.config.layers == load_model(FIXTURES / "tiny_gemma4").config.layers  # text stays causal


@pytest.mark.parametrize(("name", "dispatches"), [("tiny_gemma4", 91), ("tiny_gemma4_moe", 89)])
def test_decode_step_dispatches(name: str, dispatches: int, vk_default: Backend) -> None:
    """tiny_gemma4 (6 layers): 13 per layer that stores K/V (the normed q|k|v matmul, its q/k/v norms,
    RoPE and cache write in one, attention, o_proj, 2 normed residual adds, the MLP's 2 matmuls, the
    per-layer branch's gate, GeGLU on its slice, projection and normed add, the layer_scalar), 14
    per layer reading another's cache (q's matmul, norm and RoPE apart), 11 outside the layers (the
    two embeddings, their scales, the per-layer projection and its norm, add and scale, the head's
    gather, normed matmul and softcap). tiny_gemma4_moe (4 layers): 18 per sliding layer, 24 per
    K = V layer (q and k apart: their norms, RoPEs and the cache write as primitives), 5 outside them."""
    model = DecoderModel(load_model(FIXTURES / name), vk_default)
    if name == "tiny_gemma4_moe":
        assert all(isinstance(layer.mlp, MlpAndExperts) for layer in model.weights.layers)
    driver = Greedy(model, max_len=64)
    case = json.loads((FIXTURES / name / "golden.json").read_text())["cases"][-1]
    assert driver.generate(case["input_ids"], 4) == case["greedy_ids"][:4]
    assert {c["dispatches"] for c in driver.step_counters[1:]} == {dispatches}
    assert {c["drains"] for c in driver.step_counters} == {0}


def test_prefix_cache_hit_serves_the_sharing_layers() -> None:
    """Through the engine with prefix caching: a second request that hits the first one's blocks
    (the sharing layers read them through their source layers' caches, in those layers' groups)
    decodes the ids and logprobs a run without the cache does."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = json.loads((FIXTURES / "tiny_gemma4" / "golden.json").read_text())["cases"][-1]["input_ids"]
    cached = LLM(FIXTURES / "tiny_gemma4", device="vulkan", max_model_len=64, max_num_seqs=2, kv_dtype="f32")
    plain = LLM(FIXTURES / "tiny_gemma4", device="vulkan", max_model_len=64, max_num_seqs=2, kv_dtype="f32",
                enable_prefix_caching=False)

    def run(llm: LLM) -> tuple[list[int], list[float], int]:
        [out] = llm.generate([prompt], greedy)
        return out.token_ids, [lp.token.logprob for lp in out.outputs[0].logprobs], out.num_cached_tokens

    first, expected = run(cached), run(plain)
    again = run(cached)
    assert first[2] == 0 and again[2] > 0
    assert first[:2] == again[:2] == expected[:2]
