"""Per-layer config normalisation of every family, and the one-line errors for what vkrt
does not run: an unsupported family, an unknown rope type, a missing per-layer tensor."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.errors import ModelFormatError, UnsupportedModelError, VkrtError
from vkrt.loader import load_model
from vkrt.loader.config import LayerConfig
from vkrt.models import build_model


def _copy(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _one_line(exc: pytest.ExceptionInfo[VkrtError], *needles: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


# -- per-layer config -----------------------------------------------------------------------


def test_gemma3_layers_from_rope_parameters_per_layer_type() -> None:
    c = load_model(FIXTURES / "tiny_gemma3").config
    local = LayerConfig(8, 10000.0, None)
    glob = LayerConfig(0, 1e6, {"rope_type": "linear", "factor": 4.0})
    assert c.layers == (local,) * 5 + (glob,)
    assert (c.qk_norm, c.sandwich_norms, c.norm_offset, c.hidden_act) == (True, True, 1.0, "gelu_tanh")
    assert c.embedding_scale == math.sqrt(32) and c.query_scale == 16 ** -0.5


def test_gemma3_legacy_rope_spelling_gives_the_same_layers(tmp_path: Path) -> None:
    """transformers < 5: rope_theta (global), rope_local_base_freq, rope_scaling (global only),
    no layer_types (every 6th layer global)."""
    d = _copy("tiny_gemma3", tmp_path)
    _edit_config(d, rope_parameters=None, layer_types=None, rope_theta=1e6, rope_local_base_freq=10000.0,
                 rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert load_model(d).config.layers == load_model(FIXTURES / "tiny_gemma3").config.layers


def test_gemma3_gguf_layers_follow_llama_cpp() -> None:
    """GGUF: every 6th layer global, local base 10000, norms already 1 + w, q scaled 1/sqrt(head_dim)."""
    c = load_model(FIXTURES / "tiny_gemma3_gguf" / "model.gguf").config
    assert [layer.window for layer in c.layers] == [8, 8, 8, 8, 8, 0]
    assert [layer.rope_theta for layer in c.layers] == [10000.0] * 5 + [1e6]
    assert c.norm_offset == 0.0 and c.query_scale == 16 ** -0.5 and c.embedding_scale == math.sqrt(32)


def test_gemma2_traits() -> None:
    c = load_model(FIXTURES / "tiny_gemma2").config
    assert [layer.window for layer in c.layers] == [8, 0]
    assert (c.attn_softcap, c.final_softcap) == (5.0, 4.0)
    assert c.query_scale == 24 ** -0.5
    g = load_model(FIXTURES / "tiny_gemma2_gguf" / "model.gguf").config
    assert [layer.window for layer in g.layers] == [8, 0]
    assert (g.attn_softcap, g.final_softcap, g.query_scale, g.norm_offset) == (5.0, 4.0, 16 ** -0.5, 0.0)
    assert (g.sandwich_norms, g.hidden_act, g.embedding_scale) == (True, "gelu_tanh", 8.0)


def test_mistral_window_on_every_layer_without_a_context_cap() -> None:
    c = load_model(FIXTURES / "tiny_mistral").config
    assert [layer.window for layer in c.layers] == [8, 8]
    assert c.max_position_embeddings == 256


def test_qwen_traits() -> None:
    q2, q3 = load_model(FIXTURES / "tiny_qwen2").config, load_model(FIXTURES / "tiny_qwen3").config
    assert (q2.qkv_bias, q2.qk_norm, q3.qkv_bias, q3.qk_norm) == (True, False, False, True)
    g2 = load_model(FIXTURES / "tiny_qwen2_gguf" / "model.gguf").config
    assert (g2.qkv_bias, g2.layers, g2.tie_word_embeddings) == (True, q2.layers, True)
    g = load_model(FIXTURES / "tiny_qwen3_gguf" / "model.gguf").config
    assert (g.qk_norm, g.layers, g.head_dim) == (True, q3.layers, 16)


def test_phi3_longrope_attention_factor() -> None:
    c = load_model(FIXTURES / "tiny_phi3").config
    scaling = c.layer(0).rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    # transformers: sqrt(1 + ln(factor) / ln(original context)) with factor 4, context 64.
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


def test_legacy_su_rope_type_is_longrope(tmp_path: Path) -> None:
    d = _copy("tiny_phi3", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    params = dict(cfg["rope_parameters"], type="su")
    del params["rope_type"]
    _edit_config(d, rope_parameters=None, rope_scaling=params, rope_theta=10000.0)
    assert load_model(d).config.layers == load_model(FIXTURES / "tiny_phi3").config.layers


def test_partial_rotary_and_interleaved_pairs() -> None:
    """Phi-3's partial_rotary_factor 0.5 rotates 8 of 16 dims per head (top level and in
    rope_parameters alike); ERNIE 4.5 rotates interleaved pairs; the other families neither."""
    partial = load_model(FIXTURES / "tiny_phi3_partial").config
    assert (partial.rotary_dim, partial.rope_interleaved) == (8, False)
    ernie = load_model(FIXTURES / "tiny_ernie4_5").config
    assert (ernie.rotary_dim, ernie.rope_interleaved, ernie.tie_word_embeddings) == (0, True, True)
    assert (load_model(FIXTURES / "tiny_phi3").config.rotary_dim, load_model(FIXTURES / "tiny_llama").config.rope_interleaved) == (0, False)


@pytest.mark.parametrize(("factor", "error"), [(0.3125, "rotates 5 of 16 dims"), (1.5, "must be a number in (0, 1]")])
def test_partial_rotary_that_cannot_rope_is_refused(tmp_path: Path, factor: float, error: str) -> None:
    d = _copy("tiny_phi3_partial", tmp_path)
    _edit_config(d, partial_rotary_factor=factor)
    with pytest.raises(VkrtError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "partial_rotary_factor", error)


def test_hybrid_layer_kinds_and_their_fields() -> None:
    """Each hybrid's layers get their mixers; Granite 4's config spells the scan's limit as
    {"__float__": "Infinity"} (transformers 5) and unrotated positions as "nope"."""
    lfm2 = load_model(FIXTURES / "tiny_lfm2").config
    assert [layer.mixer for layer in lfm2.layers] == ["short_conv", "attention", "short_conv", "short_conv"]
    assert (lfm2.conv_kernel, lfm2.intermediate_size) == (3, 96)
    qwen = load_model(FIXTURES / "tiny_qwen3_5").config
    assert [layer.mixer for layer in qwen.layers] == ["gated_delta_net"] * 2 + ["attention", "gated_delta_net"]
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.rotary_dim, qwen.attn_output_gate) == (2, 4, 4, True)
    assert load_model(FIXTURES / "tiny_qwen3_5_gguf" / "model.gguf").config.layers == qwen.layers
    granite = load_model(FIXTURES / "tiny_granite4").config
    assert [layer.mixer for layer in granite.layers] == ["mamba2"] * 2 + ["attention", "mamba2"]
    assert not any(layer.rope for layer in granite.layers) and granite.mamba_dt_max == math.inf
    assert (granite.mamba_num_heads, granite.mamba_head_dim, granite.intermediate_size, granite.conv_bias) == (4, 32, 96, True)
    granite_gguf = load_model(FIXTURES / "tiny_granite4_gguf" / "model.gguf").config  # llama.cpp's granitehybrid
    assert granite_gguf.layers == granite.layers and granite_gguf.linear_decay_stored
    assert (granite_gguf.mamba_head_dim, granite_gguf.intermediate_size, granite_gguf.embedding_scale,
            granite_gguf.residual_scale) == (32, 96, 3.0, granite.residual_scale)


def test_nemotron_h_blocks_of_one_sublayer(tmp_path: Path) -> None:
    """Nemotron-H's config in its own words: the real checkpoints' hybrid_override_pattern (M, *, -)
    gives the same blocks as transformers' layers_block_type; Mamba2's inner width is heads x
    head_dim (192 here, not 2 x hidden); a block is a mixer or the ungated relu^2 MLP, never both."""
    saved = load_model(FIXTURES / "tiny_nemotron_h").config
    assert [(layer.mixer, layer.mlp) for layer in saved.layers] == [
        ("mamba2", False), ("none", True), ("attention", False), ("none", True), ("mamba2", False), ("none", True)]
    assert not any(layer.rope for layer in saved.layers)
    assert (saved.hidden_act, saved.mamba_num_heads * saved.mamba_head_dim, saved.conv_bias) == ("relu2", 192, True)
    assert load_model(FIXTURES / "tiny_nemotron_h_gguf" / "model.gguf").config.layers == saved.layers  # llama.cpp's
    d = _copy("tiny_nemotron_h", tmp_path)
    _edit_config(d, layers_block_type=None, hybrid_override_pattern="M-*-M-", num_hidden_layers=6)
    assert load_model(d).config.layers == saved.layers
    _edit_config(d, hybrid_override_pattern="M-*-ME")
    with pytest.raises(ModelFormatError) as exc:  # an MoE block ('E') needs its router and experts
        load_model(d)
    _one_line(exc, "tiny_nemotron_h", "'layers.5.router' is missing")
    _edit_config(d, hybrid_override_pattern="M-*-MX")
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "hybrid_override_pattern", "'M-*-MX'")
    _edit_config(d, hybrid_override_pattern="M-*-M-", use_bias=True)
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "use_bias", "not supported")


def test_nemotron_h_experts_in_groups(tmp_path: Path) -> None:
    """Nemotron 3's MoE blocks: ungated relu^2 experts with a shared one, sigmoid routing with the
    score-correction bias within the best groups (n_group / topk_group, and llama.cpp's
    expert_group_count / expert_group_used_count), its 1e-20 renormalising eps; the same blocks
    from the GGUF; bad groups and a latent expert projection refused."""
    saved = load_model(FIXTURES / "tiny_nemotron_h_moe").config
    assert [(layer.mixer, layer.moe) for layer in saved.layers] == [
        ("mamba2", False), ("none", True), ("attention", False), ("none", True), ("mamba2", False), ("none", True)]
    assert (saved.num_experts, saved.num_experts_per_tok, saved.moe_intermediate_size,
            saved.shared_expert_intermediate_size, saved.shared_expert_gated) == (8, 2, 32, 48, False)
    assert (saved.moe_router, saved.expert_bias, saved.moe_groups, saved.moe_top_groups, saved.router_norm_eps,
            saved.routed_scaling_factor, saved.norm_topk_prob) == ("sigmoid", True, 2, 1, 1e-20, 2.5, True)
    gguf = load_model(FIXTURES / "tiny_nemotron_h_moe_gguf" / "model.gguf").config
    assert gguf.layers == saved.layers
    assert (gguf.num_experts, gguf.moe_groups, gguf.moe_top_groups, gguf.routed_scaling_factor, gguf.expert_bias,
            gguf.shared_expert_intermediate_size) == (8, 2, 1, 2.5, True, 48)
    d = _copy("tiny_nemotron_h_moe", tmp_path)
    for fields, error, words in (({"n_group": 3}, ModelFormatError, ("n_group", "equal groups")),
                                 ({"topk_group": 3}, ModelFormatError, ("topk_group",)),
                                 ({"moe_latent_size": 16}, UnsupportedModelError, ("moe_latent_size", "latent"))):
        _edit_config(d, **{"n_group": 2, "topk_group": 1, "moe_latent_size": None, **fields})
        with pytest.raises(error) as exc:
            load_model(d)
        _one_line(exc, "config.json", *words)


def test_falcon_h1_attention_and_mamba2_in_every_layer(tmp_path: Path) -> None:
    """Falcon-H1: every layer attends (a KV group of all of them) and holds a Mamba2 state; its muP
    multipliers are read for folding into the weights (a GGUF has them folded: none there); the
    Mamba2 norm's three forms; biases refused."""
    from vkrt.backend.reference import ReferenceBackend
    from vkrt.loader.config import Multipliers
    from vkrt.models.base import kv_groups, state_shapes
    from vkrt.models.decoder import DecoderModel
    from vkrt.models.weights import AttentionMamba2

    saved = load_model(FIXTURES / "tiny_falcon_h1").config
    assert [(layer.mixer, layer.attends, layer.recurrent) for layer in saved.layers] == [
        ("attention_mamba2", True, "mamba2")] * 3
    assert [g.layers for g in kv_groups(saved)] == [(0, 1, 2)] and sorted(state_shapes(saved)) == [0, 1, 2]
    assert (saved.mamba_num_heads, saved.mamba_head_dim, saved.mamba_n_groups, saved.mamba_norm) == (4, 24, 2, "after_gate")
    assert saved.multipliers == Multipliers(1.2, 0.7, 0.9, 1.1, 0.95, (1.1, 0.9, 1.2, 0.8, 1.05), 0.8, 1.3)
    assert (saved.embedding_scale, saved.logit_scale) == (3.0, 0.5)
    gguf = load_model(FIXTURES / "tiny_falcon_h1_gguf" / "model.gguf").config
    assert gguf.layers == saved.layers and gguf.mamba_norm == "after_gate" and gguf.conv_bias
    assert (gguf.multipliers, gguf.embedding_scale, gguf.logit_scale) == (Multipliers(), 1.0, 1.0)
    assert load_model(FIXTURES / "tiny_falcon_h1_nonorm").config.mamba_norm == "none"
    # the folded weights: k's rows are attention_in x key times the stored ones
    model = DecoderModel(load_model(FIXTURES / "tiny_falcon_h1"), ReferenceBackend())
    mixer = model.weights.layers[0].mixer
    assert isinstance(mixer, AttentionMamba2)
    from safetensors.numpy import load_file

    stored = load_file(FIXTURES / "tiny_falcon_h1" / "model.safetensors")
    qkv = model.backend.read(mixer.attention.qkv.parts[0])
    k = qkv[64:96]
    np.testing.assert_allclose(k, stored["model.layers.0.self_attn.k_proj.weight"] * np.float32(1.2 * 0.7), rtol=1e-6)
    d = _copy("tiny_falcon_h1", tmp_path)
    _edit_config(d, mamba_norm_before_gate=True)
    assert load_model(d).config.mamba_norm == "before_gate"
    for key in ("attention_bias", "projectors_bias"):
        _edit_config(d, **{"attention_bias": None, "projectors_bias": None, key: True})
        with pytest.raises(UnsupportedModelError) as exc:
            load_model(d)
        _one_line(exc, "config.json", key, "not supported")
    _edit_config(d, projectors_bias=None, ssm_multipliers=[1.0, 2.0])
    with pytest.raises(ModelFormatError) as bad:
        load_model(d)
    _one_line(bad, "ssm_multipliers", "5 finite numbers")


def test_qwen3_5_multimodal_checkpoint_loads_its_language_model(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Qwen3_5ForConditionalGeneration as users download it: text_config is the model, tensors under
    model.language_model.; the vision tower is skipped with one line, an MTP head kept apart."""
    from safetensors.numpy import save_file

    text = load_model(FIXTURES / "tiny_qwen3_5")
    d = _copy("tiny_qwen3_5_vl", tmp_path)
    save_file({"mtp.fc.weight": np.zeros((4, 4), np.float32)}, str(d / "mtp.safetensors"))
    with caplog.at_level("INFO", logger="vkrt.loader.hf_loader"):
        vl = load_model(d)
    assert vl.config.layers == text.config.layers and sorted(vl.weights) == sorted(text.weights)
    assert vl.config.attn_output_gate and vl.config.linear_num_value_heads == text.config.linear_num_value_heads
    for what in ("skipped the vision tower (21 tensors)", "multi-token-prediction head (1 tensor) is kept"):
        assert what in caplog.text
    assert sorted(vl.mtp_weights) == ["mtp.fc"]
    _edit_config(d, text_config=None)
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "text_config")


def test_ministral3_multimodal_checkpoint_loads_its_language_model(caplog: pytest.LogCaptureFixture) -> None:
    """Mistral3ForConditionalGeneration as Ministral 3 ships: text_config is the model, saved under
    language_model.model. (the names before transformers 5); the vision tower and the projector are
    skipped with one line each."""
    text = load_model(FIXTURES / "tiny_ministral3")
    with caplog.at_level("INFO", logger="vkrt.loader.hf_loader"):
        vl = load_model(FIXTURES / "tiny_ministral3_vl")
    assert vl.config.layers == text.config.layers and sorted(vl.weights) == sorted(text.weights)
    assert (vl.config.query_temperature_beta, vl.config.tie_word_embeddings) == (0.1, True)
    for what in ("skipped the vision tower (11 tensors)", "skipped the multimodal projector (4 tensors)"):
        assert what in caplog.text


def test_lfm2_moe_routing_fields(tmp_path: Path) -> None:
    """LFM2-MoE: sigmoid routing with the expert bias and routed_scaling_factor; the first
    num_dense_layers MLPs dense; without use_expert_bias the bias is not read."""
    c = load_model(FIXTURES / "tiny_lfm2_moe").config
    assert (c.moe_router, c.expert_bias, c.routed_scaling_factor, c.norm_topk_prob) == ("sigmoid", True, 1.0, True)
    gguf_config = load_model(FIXTURES / "tiny_lfm2_moe_gguf" / "model.gguf").config
    assert (gguf_config.layers, gguf_config.expert_bias, gguf_config.norm_topk_prob) == (c.layers, True, True)
    assert [layer.moe for layer in c.layers] == [False, True, True, True]
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size) == (6, 2, 32, 96)
    d = _copy("tiny_lfm2_moe", tmp_path)
    _edit_config(d, num_dense_layers=-1)
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "num_dense_layers")


def test_olmo_hybrid_fields(tmp_path: Path) -> None:
    """OLMo-hybrid: OLMo 2's post-norm attention layers, beta x 2, the gated norm's own eps, and
    NoPE when config.json has no rope_parameters."""
    c = load_model(FIXTURES / "tiny_olmo_hybrid").config
    assert [(layer.mixer, layer.post_norms) for layer in c.layers] == [
        ("gated_delta_net", False), ("gated_delta_net", False), ("attention", True), ("gated_delta_net", False)]
    assert (c.linear_beta_scale, c.linear_norm_eps, c.qk_norm_per_head) == (2.0, 1e-5, False)
    assert all(layer.rope for layer in c.layers)
    d = _copy("tiny_olmo_hybrid", tmp_path)
    _edit_config(d, rope_parameters=None, linear_allow_neg_eigval=False)
    c = load_model(d).config
    assert not any(layer.rope for layer in c.layers) and c.linear_beta_scale == 1.0


def test_olmo2_and_olmo3_post_norm_layers(tmp_path: Path) -> None:
    """OLMo 2 / 3: every layer normed after attention and after the MLP only, QK-norm over all of q
    and k; OLMo 3's sliding layers from layer_types, else three of every four; llama.cpp writes both
    as olmo2, OLMo 3's pattern in the metadata."""
    olmo2 = load_model(FIXTURES / "tiny_olmo2").config
    assert [(layer.post_norms, layer.window) for layer in olmo2.layers] == [(True, 0)] * 2
    assert (olmo2.qk_norm, olmo2.qk_norm_per_head) == (True, False)
    assert load_model(FIXTURES / "tiny_olmo2_gguf" / "model.gguf").config.layers == olmo2.layers
    olmo3 = load_model(FIXTURES / "tiny_olmo3").config
    assert [(layer.post_norms, layer.window) for layer in olmo3.layers] == [(True, 8)] * 3 + [(True, 0)]
    scalings = [layer.rope_scaling for layer in olmo3.layers]  # YaRN on the full layer only
    assert scalings[:3] == [None] * 3 and scalings[3] is not None and scalings[3]["rope_type"] == "yarn"
    # (the GGUF has one rope scaling, as llama.cpp applies it: to the full layers only)
    assert load_model(FIXTURES / "tiny_olmo3_gguf" / "model.gguf").config.layers == olmo3.layers
    d = _copy("tiny_olmo3", tmp_path)
    _edit_config(d, layer_types=None)
    assert load_model(d).config.layers == olmo3.layers
    # config.json's legacy spelling: one rope_scaling, which transformers gives the full layers only
    _edit_config(d, rope_parameters=None, rope_theta=5e5, rope_scaling=scalings[3])
    assert load_model(d).config.layers == olmo3.layers


def test_exaone4_global_layers_without_rope(tmp_path: Path) -> None:
    """EXAONE 4: post-norm layers with per-head QK-norm; with a sliding window the full layers do not
    rotate (the GGUF alike, its llama3 scaling as rope_freqs); without one every layer rotates; its
    pattern as a period or a string of L (local) and G (global) when layer_types is absent."""
    c = load_model(FIXTURES / "tiny_exaone4").config
    assert [(layer.window, layer.rope, layer.post_norms) for layer in c.layers] == [(8, True, True)] * 3 + [(0, False, True)]
    assert (c.qk_norm, c.qk_norm_per_head) == (True, True)
    g = load_model(FIXTURES / "tiny_exaone4_gguf" / "model.gguf")
    assert [(layer.window, layer.rope) for layer in g.config.layers] == [(8, True)] * 3 + [(0, False)]
    assert "rope_freqs" in g.weights
    d = _copy("tiny_exaone4", tmp_path)
    _edit_config(d, layer_types=None, sliding_window_pattern="LGLG")
    assert [(layer.window, layer.rope) for layer in load_model(d).config.layers] == [(8, True), (0, False)] * 2
    _edit_config(d, sliding_window=None)
    assert [(layer.window, layer.rope) for layer in load_model(d).config.layers] == [(0, True)] * 4


def test_seed_oss_biases(tmp_path: Path) -> None:
    """Seed-OSS: q/k/v biases from both formats (head_dim 32 beside hidden 64); a bias on o_proj or
    the MLP, which vkrt does not run, is refused in one line."""
    c = load_model(FIXTURES / "tiny_seed_oss").config
    assert (c.qkv_bias, c.head_dim, c.num_heads * c.head_dim, c.hidden_size) == (True, 32, 128, 64)
    g = load_model(FIXTURES / "tiny_seed_oss_gguf" / "model.gguf")
    assert g.config.layers == c.layers and all(f"layers.1.{b}_bias" in g.weights for b in "qkv")
    d = _copy("tiny_seed_oss", tmp_path)
    for flag in ("attention_out_bias", "mlp_bias"):
        _edit_config(d, **{"attention_out_bias": None, "mlp_bias": None, flag: True})
        with pytest.raises(UnsupportedModelError) as exc:
            load_model(d)
        _one_line(exc, "config.json", flag, "does not run")


def test_ministral3_yarn_and_query_temperature(tmp_path: Path) -> None:
    """Ministral 3: YaRN with transformers' attention factor (mscale / mscale_all_dim), the query
    temperature read from rope_parameters (and from llama.cpp's attention.temperature_scale and
    yarn_log_multiplier), tied embeddings; a temperature without its length is refused."""
    c = load_model(FIXTURES / "tiny_ministral3").config
    scaling = c.layer(0).rope_scaling
    assert scaling is not None and scaling["rope_type"] == "yarn" and "llama_4_scaling_beta" not in scaling
    assert scaling["attention_factor"] == pytest.approx((0.1 * math.log(16) + 1) / (0.05 * math.log(16) + 1))
    assert (c.query_temperature_beta, c.query_temperature_length, c.tie_word_embeddings) == (0.1, 16, True)
    g = load_model(FIXTURES / "tiny_ministral3_gguf" / "model.gguf").config
    assert g.layer(0).rope_scaling is not None
    assert g.layer(0).rope_scaling["attention_factor"] == pytest.approx(scaling["attention_factor"])
    assert (g.query_temperature_beta, g.query_temperature_length) == pytest.approx((0.1, 16))
    d = _copy("tiny_ministral3", tmp_path)
    params = json.loads((d / "config.json").read_text())["rope_parameters"]
    _edit_config(d, rope_parameters={k: v for k, v in params.items() if k != "llama_4_scaling_beta"})
    assert load_model(d).config.query_temperature_beta == 0.0
    _edit_config(d, rope_parameters={k: v for k, v in params.items() if k != "original_max_position_embeddings"})
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "original_max_position_embeddings")


def test_smollm3_nope_layers() -> None:
    c = load_model(FIXTURES / "tiny_smollm3").config
    assert [layer.rope for layer in c.layers] == [True, True, True, False]


def test_granite_multipliers() -> None:
    c = load_model(FIXTURES / "tiny_granite").config
    assert (c.embedding_scale, c.query_scale, c.residual_scale) == (3.0, 0.2, 0.6)
    assert c.logit_scale == 1 / 2.5


def test_bad_no_rope_layers(tmp_path: Path) -> None:
    d = _copy("tiny_smollm3", tmp_path)
    _edit_config(d, no_rope_layers=[1, 1, 2, 0])
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "no_rope_layers")


# -- bad input ------------------------------------------------------------------------------


def test_unsupported_hf_family(tmp_path: Path) -> None:
    d = _copy("tiny_qwen2", tmp_path)
    _edit_config(d, architectures=["FalconForCausalLM"])
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "FalconForCausalLM", "not supported")


def test_unknown_rope_type(tmp_path: Path) -> None:
    d = _copy("tiny_qwen2", tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "spiral", "rope_theta": 1e6, "factor": 2.0})
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "rope_parameters.rope_type", "'spiral'")


def test_unknown_rope_type_of_one_layer_type(tmp_path: Path) -> None:
    d = _copy("tiny_gemma3", tmp_path)
    _edit_config(d, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                     "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 8}})
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "rope_parameters.full_attention.rope_type", "'dynamic'")


def test_yarn_needs_its_original_context(tmp_path: Path) -> None:
    d = _copy("tiny_gpt_oss", tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0})
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "rope_parameters", "yarn needs original_max_position_embeddings")


def test_unknown_layer_type(tmp_path: Path) -> None:
    d = _copy("tiny_gemma2", tmp_path)
    _edit_config(d, layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(d)
    _one_line(exc, "config.json", "layer_types", "chunked_attention")


def test_missing_per_layer_tensor_hf(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    d = _copy("tiny_qwen3", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, str(d), "layers.1.k_norm", "missing")


def _rewrite_gguf(src: Path, dst: Path, drop: str = "", arch: str = "", rope_type: str = "",
                  rope_factor: float = 0.0, values: dict[str, object] | None = None,
                  tensors: dict[str, np.ndarray] | None = None) -> None:
    """Copy a GGUF through the gguf package's reader and writer, changing one thing: `drop` a
    tensor or metadata key, rename the architecture, add rope scaling, set keys (`values`: floats
    as FLOAT32, ints as UINT32) or add `tensors`."""
    reader = gguf.GGUFReader(str(src))
    old_arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop, *(values or {})):
            continue
        value = field.contents()
        if isinstance(value, bool):
            writer.add_bool(key.replace(old_arch, arch or old_arch, 1), value)
        elif isinstance(value, str):
            writer.add_string(key.replace(old_arch, arch or old_arch, 1), value)
        elif isinstance(value, float):
            writer.add_float32(key.replace(old_arch, arch or old_arch, 1), value)
        else:
            writer.add_uint32(key.replace(old_arch, arch or old_arch, 1), int(value))
    for key, number in (values or {}).items():
        if isinstance(number, float):
            writer.add_float32(key, number)
        else:
            assert isinstance(number, int)
            writer.add_uint32(key, number)
    if rope_type:
        writer.add_string(f"{arch or old_arch}.rope.scaling.type", rope_type)
    if rope_factor:
        writer.add_float32(f"{arch or old_arch}.rope.scaling.factor", rope_factor)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, np.array(t.data).reshape(tuple(int(d) for d in reversed(t.shape.tolist()))))
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_per_layer_tensor_gguf(tmp_path: Path) -> None:
    src = FIXTURES / "tiny_gemma3_gguf" / "model.gguf"
    copy = tmp_path / "whole.gguf"
    _rewrite_gguf(src, copy)
    assert load_model(copy).config == load_model(src).config  # the rewrite itself changes nothing
    path = tmp_path / "no_q_norm.gguf"
    _rewrite_gguf(src, path, drop="blk.3.attn_q_norm.weight")
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "no_q_norm.gguf", "layers.3.q_norm", "missing")


def test_glm4_moe_mtp_layers_are_kept_apart(tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry multi-token-prediction layers after the main ones (config.json's
    num_nextn_predict_layers; a GGUF's nextn_predict_layers, counted in block_count, as llama.cpp's
    converter writes them): the model is the main layers, the MTP layer is kept apart as the
    head's; uncounted, they are an error."""
    from safetensors.numpy import load_file, save_file

    saved = load_model(FIXTURES / "tiny_glm4_moe")
    d = _copy("tiny_glm4_moe", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # (one of the MTP layer's own)
    save_file(tensors | mtp, str(d / "model.safetensors"))
    _edit_config(d, num_nextn_predict_layers=1)
    loaded = load_model(d)
    assert loaded.config == saved.config and loaded.weights.keys() == saved.weights.keys()
    assert "mtp.fc" in loaded.mtp_weights
    assert {n.split(".")[1] for n in loaded.mtp_weights if n.startswith("layers.")} == {"0"}
    _edit_config(d, num_nextn_predict_layers=0)
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(d)
    _one_line(exc, "model.layers.3.eh_proj.weight", "not part of the glm4_moe architecture")

    src = FIXTURES / "tiny_glm4_moe_gguf" / "model.gguf"
    reader = gguf.GGUFReader(str(src))
    extra = {t.name.replace("blk.2.", "blk.3."): np.array(t.data).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
             for t in reader.tensors if t.name.startswith("blk.2.")}
    extra["blk.3.nextn.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    path = tmp_path / "mtp.gguf"
    _rewrite_gguf(src, path, values={"glm4moe.block_count": 4, "glm4moe.nextn_predict_layers": 1}, tensors=extra)
    converted = load_model(path)
    assert converted.config == load_model(src).config and converted.weights.keys() == load_model(src).weights.keys()
    assert "mtp.fc" in converted.mtp_weights
    path = tmp_path / "uncounted.gguf"
    _rewrite_gguf(src, path, values={"glm4moe.block_count": 4}, tensors=extra)
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(path)
    _one_line(exc, "uncounted.gguf", "blk.3.nextn.eh_proj.weight")
    path = tmp_path / "all_mtp.gguf"
    _rewrite_gguf(src, path, values={"glm4moe.nextn_predict_layers": 3})
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "all_mtp.gguf", "glm4moe.nextn_predict_layers is 3")


def test_glm4_moe_without_qk_norm(tmp_path: Path, ref: Backend) -> None:
    """GLM-4.5-Air's kind: use_qk_norm false and no q/k norm tensors (in a GGUF: no attn_q_norm /
    attn_k_norm, llama.cpp's optional tensors); loads and runs without the norms. A Qwen3 GGUF
    without them is still refused (test_missing_per_layer_tensor_gguf's kind)."""
    from safetensors.numpy import load_file, save_file

    d = _copy("tiny_glm4_moe", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))},
              str(d / "model.safetensors"))
    with pytest.raises(ModelFormatError) as exc:  # the config still says the norms are there
        load_model(d)
    _one_line(exc, "layers.0.q_norm", "missing")
    _edit_config(d, use_qk_norm=False)
    plain = load_model(d)
    assert not plain.config.qk_norm
    src = FIXTURES / "tiny_glm4_moe_gguf" / "model.gguf"
    reader = gguf.GGUFReader(str(src))
    path = tmp_path / "no_qk_norm.gguf"
    shutil.copy(src, tmp_path / "step0.gguf")
    for i, name in enumerate(t.name for t in reader.tensors if t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))):
        _rewrite_gguf(tmp_path / f"step{i}.gguf", tmp_path / f"step{i + 1}.gguf", drop=name)
        path = tmp_path / f"step{i + 1}.gguf"
    converted = load_model(path)
    assert not converted.config.qk_norm and not any(k.endswith(("q_norm", "k_norm")) for k in converted.weights)
    ids = [1, 42, 17, 200, 3]
    logits = [Greedy(build_model(m, ref), max_len=16).step(ids, 0, all_logits=True) for m in (plain, converted)]
    assert np.isfinite(logits[0]).all() and float(np.abs(logits[0] - logits[1]).max()) < 1e-5
    _edit_config(d, use_qk_norm="no")
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "use_qk_norm", "true or false")


def test_glm4_moe_config(tmp_path: Path) -> None:
    """GLM-4.5 MoE: first_k_dense_replace dense MLPs, then sigmoid routing with the score-correction
    bias in groups, x routed_scaling_factor, and an ungated shared expert of n_shared_experts x the
    expert width; the same from llama.cpp's GGUF (expert_shared_count, leading dense layers by
    their missing routers)."""
    saved = load_model(FIXTURES / "tiny_glm4_moe").config
    assert [layer.moe for layer in saved.layers] == [False, True, True]
    assert (saved.num_experts, saved.num_experts_per_tok, saved.moe_intermediate_size, saved.intermediate_size,
            saved.shared_expert_intermediate_size, saved.shared_expert_gated) == (8, 2, 32, 128, 32, False)
    assert (saved.moe_router, saved.expert_bias, saved.moe_groups, saved.moe_top_groups, saved.router_norm_eps,
            saved.routed_scaling_factor, saved.norm_topk_prob) == ("sigmoid", True, 2, 1, 1e-20, 2.5, True)
    assert (saved.qkv_bias, saved.qk_norm, saved.qk_norm_per_head, saved.rotary_dim) == (True, True, True, 8)
    converted = load_model(FIXTURES / "tiny_glm4_moe_gguf" / "model.gguf").config
    assert dataclasses.replace(converted, name=saved.name, bos_token_id=saved.bos_token_id) == saved
    d = _copy("tiny_glm4_moe", tmp_path)
    _edit_config(d, n_shared_experts=2)  # a shared expert twice as wide as the file's
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, "shared_expert.gate_proj", "(64, 64)")


def test_minimax_m2_config(tmp_path: Path) -> None:
    """MiniMax-M2: every MLP sparse, sigmoid routing with the score-correction bias (one group, no
    scaling), weights divided by their sum alone; QK-norm over all heads, RoPE on rotary_dim dims,
    which released configs give without partial_rotary_factor; the same from llama.cpp's GGUF."""
    saved = load_model(FIXTURES / "tiny_minimax_m2").config
    assert [layer.moe for layer in saved.layers] == [True, True]
    assert (saved.num_experts, saved.num_experts_per_tok, saved.moe_intermediate_size,
            saved.shared_expert_intermediate_size) == (8, 2, 16, 0)
    assert (saved.moe_router, saved.expert_bias, saved.moe_groups, saved.router_norm_eps, saved.routed_scaling_factor,
            saved.norm_topk_prob) == ("sigmoid", True, 1, 0.0, 1.0, True)
    assert (saved.qkv_bias, saved.qk_norm, saved.qk_norm_per_head, saved.rotary_dim) == (False, True, False, 8)
    converted = load_model(FIXTURES / "tiny_minimax_m2_gguf" / "model.gguf").config
    assert dataclasses.replace(converted, name=saved.name, bos_token_id=saved.bos_token_id) == saved
    d = _copy("tiny_minimax_m2", tmp_path)
    _edit_config(d, rope_parameters=None, rope_theta=10000.0)  # as released: rotary_dim alone
    assert load_model(d).config == saved
    for dims, error in ((7, UnsupportedModelError), (32, ModelFormatError)):
        _edit_config(d, rotary_dim=dims)
        with pytest.raises(error) as exc:
            load_model(d)
        _one_line(exc, "rotary_dim", str(dims))


@pytest.mark.parametrize("name", ["tiny_smollm3", "tiny_granite", "tiny_ernie4_5", "tiny_phi3_partial", "tiny_olmoe"])
def test_converted_gguf_config_equals_the_hf_one(name: str) -> None:
    """llama.cpp's converter keeps what vkrt computes with (SmolLM3's NoPE layers, a rule llama.cpp
    knows rather than reads; Granite's multipliers; OLMoE's QK-norm over all heads; partial rotary):
    the configs differ only in the name and token ids (the tiny GGUFs carry no vocabulary)."""
    hf = load_model(FIXTURES / name).config
    converted = load_model(FIXTURES / f"{name}_gguf" / "model.gguf").config
    assert dataclasses.replace(converted, name=hf.name, bos_token_id=hf.bos_token_id,
                               eos_token_ids=hf.eos_token_ids) == hf


def test_granite_gguf_multipliers_are_checked(tmp_path: Path) -> None:
    """llama.cpp refuses a granite GGUF without its logit scale; a multiplier that is not positive
    is a one-line error naming the key."""
    src = FIXTURES / "tiny_granite_gguf" / "model.gguf"
    path = tmp_path / "no_logit_scale.gguf"
    _rewrite_gguf(src, path, drop="granite.logit_scale")
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "no_logit_scale.gguf", "'granite.logit_scale' is missing")
    path = tmp_path / "negative.gguf"
    _rewrite_gguf(src, path, values={"granite.residual_scale": -0.6})
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "negative.gguf", "granite.residual_scale", "positive")


def test_llama_gguf_experts_need_their_counts(tmp_path: Path) -> None:
    """A "llama" GGUF is Mixtral by its expert count, as llama.cpp reads it: expert tensors without
    the count, or the count without the experts used per token, are one-line errors."""
    src = FIXTURES / "tiny_mixtral_gguf" / "model.gguf"
    path = tmp_path / "no_count.gguf"
    _rewrite_gguf(src, path, drop="llama.expert_count")
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(path)
    _one_line(exc, "no_count.gguf", "tensor 'blk.0.ffn_", "not part of the llama architecture")
    path = tmp_path / "no_used.gguf"
    _rewrite_gguf(src, path, drop="llama.expert_used_count")
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "no_used.gguf", "llama.expert_used_count")


def test_unsupported_gguf_family(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    _rewrite_gguf(FIXTURES / "tiny_qwen3_gguf" / "model.gguf", path, arch="falcon")
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(path)
    _one_line(exc, "falcon.gguf", "architecture 'falcon'", "not supported")


def test_unknown_gguf_rope_type(tmp_path: Path) -> None:
    path = tmp_path / "dynamic.gguf"
    _rewrite_gguf(FIXTURES / "tiny_qwen3_gguf" / "model.gguf", path, rope_type="dynamic")
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(path)
    _one_line(exc, "dynamic.gguf", "qwen3.rope.scaling.type", "'dynamic'")


def test_cli_reports_an_unsupported_family_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vkrt.cli import main

    d = _copy("tiny_qwen2", tmp_path)
    _edit_config(d, architectures=["FalconForCausalLM"])
    assert main(["generate", "hi", "--model", str(d), "--device", "reference"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vkrt: error:") and "FalconForCausalLM" in lines[0], err
