"""Per-architecture tables: how GGUF and HF names map onto vkrt's canonical weight names,
and which family traits (biases, QK-norm, sandwich norms, ...) each architecture has.

Adding an architecture means adding one `ArchSpec` row here (the row's fields are described in
vkrt/loader/arch_spec.py); the GGUF and HF loaders are driven entirely by these tables, and the
models read only the traits they produce.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vkrt.loader.arch_spec import (
    GGUF_GLOBAL,
    GGUF_LAYER,
    HF_GLOBAL,
    HF_LAYER,
    LAYER_WEIGHTS,
    ArchSpec,
)


def _all_sliding(i: int, cfg: dict[str, Any]) -> bool:
    return True  # Mistral, Phi-3: the window (when set) applies to every layer


def _qwen2_sliding(i: int, cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("use_sliding_window")) and i >= int(cfg.get("max_window_layers") or 0)


def _alternating(i: int, cfg: dict[str, Any]) -> bool:
    return i % 2 == 0  # Gemma 2: local, global, local, ...


def _every_fourth_full(i: int, cfg: dict[str, Any]) -> bool:
    return (i + 1) % 4 != 0  # OLMo 3: three sliding layers, then one full


def _exaone4_sliding(i: int, cfg: dict[str, Any]) -> bool:
    pattern = cfg.get("sliding_window_pattern") or 4  # a period (every n-th layer global) or "LLLG"
    if isinstance(pattern, str):
        return pattern[i % len(pattern)] == "L"
    return (i + 1) % int(pattern) != 0


def _gemma3_sliding(i: int, cfg: dict[str, Any]) -> bool:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return (i + 1) % pattern != 0  # Gemma 3: five local layers, then one global



# Sparse MLPs: the router [E, hidden], then the experts, either stacked [E, out, in] as
# llama.cpp writes them (gate and up separate) or one tensor per expert as HF saves them.
_MOE_GGUF = {"ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts.gate_proj",
             "ffn_up_exps.weight": "experts.up_proj", "ffn_down_exps.weight": "experts.down_proj"}
_MOE_HF = {"mlp.gate.weight": "router", "mlp.experts.{e}.gate_proj.weight": "experts.{e}.gate_proj",
           "mlp.experts.{e}.up_proj.weight": "experts.{e}.up_proj",
           "mlp.experts.{e}.down_proj.weight": "experts.{e}.down_proj"}
_MIXTRAL_HF = {"block_sparse_moe.gate.weight": "router",
               "block_sparse_moe.experts.{e}.w1.weight": "experts.{e}.gate_proj",
               "block_sparse_moe.experts.{e}.w3.weight": "experts.{e}.up_proj",
               "block_sparse_moe.experts.{e}.w2.weight": "experts.{e}.down_proj"}
# Qwen2-MoE's shared expert (a dense gated MLP) and its gate, a [1, hidden] linear.
_SHARED_EXPERT_GGUF = {"ffn_gate_shexp.weight": "shared_expert.gate_proj", "ffn_up_shexp.weight": "shared_expert.up_proj",
                       "ffn_down_shexp.weight": "shared_expert.down_proj",
                       "ffn_gate_inp_shexp.weight": "shared_expert_gate"}
_SHARED_EXPERT_HF = {"mlp.shared_expert.gate_proj.weight": "shared_expert.gate_proj",
                     "mlp.shared_expert.up_proj.weight": "shared_expert.up_proj",
                     "mlp.shared_expert.down_proj.weight": "shared_expert.down_proj",
                     "mlp.shared_expert_gate.weight": "shared_expert_gate"}
_QKV_BIAS_GGUF = {"attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias"}
_QKV_BIAS_HF = {"self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
                "self_attn.v_proj.bias": "v_bias"}
_QK_NORM_GGUF = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
_QK_NORM_HF = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma's four norms per layer: HF's post_attention_layernorm is the attention *output*
# norm there, not the MLP input norm it is in Llama.
_GEMMA_GGUF = {"post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm"}
_GEMMA_HF = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}


_LLAMA = ArchSpec(
    name="llama",
    gguf_archs=("llama",),
    hf_archs=("LlamaForCausalLM",),
    # Llama 3.1-style GGUFs bake the rope scaling into per-frequency factors.
    gguf_global={**GGUF_GLOBAL, "rope_freqs.weight": "rope_freqs"},
    gguf_qk_permuted=True,
)

_MISTRAL = ArchSpec(
    name="mistral",
    gguf_archs=(),  # llama.cpp writes Mistral as "llama" (no window in the metadata)
    hf_archs=("MistralForCausalLM",),
    default_sliding=_all_sliding,
)

_QWEN2 = ArchSpec(
    name="qwen2",
    gguf_archs=("qwen2",),
    hf_archs=("Qwen2ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QKV_BIAS_GGUF},
    hf_layer={**HF_LAYER, **_QKV_BIAS_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_bias", "k_bias", "v_bias"),
    qkv_bias=True,
    default_sliding=_qwen2_sliding,
)

_QWEN3 = ArchSpec(
    name="qwen3",
    gguf_archs=("qwen3",),
    hf_archs=("Qwen3ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF},
    hf_layer={**HF_LAYER, **_QK_NORM_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    default_sliding=_qwen2_sliding,
)

_GEMMA2 = ArchSpec(
    name="gemma2",
    gguf_archs=("gemma2",),
    hf_archs=("Gemma2ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_GEMMA_GGUF},
    hf_layer={**HF_LAYER, **_GEMMA_HF},
    layer_weights=(*LAYER_WEIGHTS, "post_attn_norm", "post_ffn_norm"),
    activation="gelu_tanh",
    sandwich_norms=True,
    hf_norm_offset=1.0,
    scale_embeddings=True,
    default_sliding=_alternating,
    gguf_wide_query_layers=46,
)

_GEMMA3 = ArchSpec(
    name="gemma3",
    gguf_archs=("gemma3",),
    hf_archs=("Gemma3ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_GEMMA_GGUF, **_QK_NORM_GGUF},
    hf_layer={**HF_LAYER, **_GEMMA_HF, **_QK_NORM_HF},
    layer_weights=(*LAYER_WEIGHTS, "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm"),
    activation="gelu_tanh",
    qk_norm=True,
    sandwich_norms=True,
    hf_norm_offset=1.0,
    scale_embeddings=True,
    default_sliding=_gemma3_sliding,
    local_rope_theta=10000.0,
    gguf_wide_query_layers=62,
)

# SmolLM3 is Llama with every 4th layer unrotated (NoPE); config.json lists which.
_SMOLLM3 = ArchSpec(
    name="smollm3",
    gguf_archs=("smollm3",),
    hf_archs=("SmolLM3ForCausalLM",),
    gguf_qk_permuted=True,
    gguf_nope_every=4,
    default_sliding=_qwen2_sliding,
)

# Granite is Llama with four multipliers in config.json (embedding, attention, residual, logits),
# in a GGUF the `*_scale` keys; llama.cpp needs the logit scale, the others default to none.
_GRANITE = ArchSpec(
    name="granite",
    gguf_archs=("granite",),
    hf_archs=("GraniteForCausalLM",),
    gguf_qk_permuted=True,
    gguf_required=("logit_scale",),
)

# Phi-3 checkpoints fuse q/k/v and gate/up; both stay stacked, the layout vkrt computes in.
_PHI3_FUSED = ("attn_norm", "qkv_proj", "o_proj", "ffn_norm", "gate_up_proj", "down_proj")
_PHI3 = ArchSpec(
    name="phi3",
    gguf_archs=("phi3",),
    hf_archs=("Phi3ForCausalLM",),
    gguf_global={**GGUF_GLOBAL, "rope_factors_long.weight": "rope_factors_long",
                 "rope_factors_short.weight": "rope_factors_short"},
    gguf_layer={"attn_norm.weight": "attn_norm", "attn_qkv.weight": "qkv_proj",
                "attn_output.weight": "o_proj", "ffn_norm.weight": "ffn_norm",
                "ffn_up.weight": "gate_up_proj", "ffn_down.weight": "down_proj"},
    hf_layer={"input_layernorm.weight": "attn_norm", "self_attn.qkv_proj.weight": "qkv_proj",
              "self_attn.o_proj.weight": "o_proj", "post_attention_layernorm.weight": "ffn_norm",
              "mlp.gate_up_proj.weight": "gate_up_proj", "mlp.down_proj.weight": "down_proj"},
    layer_weights=_PHI3_FUSED,
    default_sliding=_all_sliding,
)

# Qwen3-MoE: Qwen3's attention; every decoder_sparse_step-th layer not in mlp_only_layers is sparse.
_QWEN3_MOE = ArchSpec(
    name="qwen3_moe",
    gguf_archs=("qwen3moe",),
    hf_archs=("Qwen3MoeForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, **_MOE_GGUF},
    hf_layer={**HF_LAYER, **_QK_NORM_HF, **_MOE_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    default_sliding=_qwen2_sliding,
    norm_topk_prob=True,
)

# Qwen2-MoE: Qwen2's attention (q/k/v biases), Qwen3-MoE's sparse-layer rule and router, and a
# shared expert in every sparse layer.
_QWEN2_MOE = ArchSpec(
    name="qwen2_moe",
    gguf_archs=("qwen2moe",),
    hf_archs=("Qwen2MoeForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QKV_BIAS_GGUF, **_MOE_GGUF, **_SHARED_EXPERT_GGUF},
    hf_layer={**HF_LAYER, **_QKV_BIAS_HF, **_MOE_HF, **_SHARED_EXPERT_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_bias", "k_bias", "v_bias"),
    qkv_bias=True,
    default_sliding=_qwen2_sliding,
    shared_expert=True,
)

# Mixtral: Mistral's attention (window on every layer when set), every MLP sparse.
_MIXTRAL = ArchSpec(
    name="mixtral",
    gguf_archs=("llama",),  # llama.cpp writes Mixtral as "llama" with an expert count (and no window)
    hf_archs=("MixtralForCausalLM",),
    gguf_qk_permuted=True,
    gguf_with_experts=True,
    gguf_layer={**GGUF_LAYER, **_MOE_GGUF},
    hf_layer={**HF_LAYER, **_MIXTRAL_HF},
    default_sliding=_all_sliding,
    norm_topk_prob=True,  # Mixtral always renormalises (its config has no such key)
)

# OLMoE: QK-norm over all of q and all of k (not per head), every MLP sparse.
_OLMOE = ArchSpec(
    name="olmoe",
    gguf_archs=("olmoe",),
    hf_archs=("OlmoeForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, **_MOE_GGUF},
    hf_layer={**HF_LAYER, **_QK_NORM_HF, **_MOE_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    qk_norm_per_head=False,
)

# ERNIE 4.5 (dense): Llama's layout and math with RoPE on interleaved pairs.
_ERNIE4_5 = ArchSpec(
    name="ernie4_5",
    gguf_archs=("ernie4_5",),  # (llama.cpp's "normal" RoPE is this pairwise one: rows not permuted)
    hf_archs=("Ernie4_5ForCausalLM",),
    rope_interleaved=True,
)

# LFM2: gated short convolutions in most layers, attention with per-head QK-norm in a few;
# one pre-norm per layer ("operator_norm") before either mixer, the final norm after the layers.
_LFM2_LAYER = {"operator_norm.weight": "attn_norm", "ffn_norm.weight": "ffn_norm",
               "feed_forward.w1.weight": "gate_proj", "feed_forward.w3.weight": "up_proj",
               "feed_forward.w2.weight": "down_proj", "self_attn.q_proj.weight": "q_proj",
               "self_attn.k_proj.weight": "k_proj", "self_attn.v_proj.weight": "v_proj",
               "self_attn.out_proj.weight": "o_proj", "self_attn.q_layernorm.weight": "q_norm",
               "self_attn.k_layernorm.weight": "k_norm", "conv.in_proj.weight": "conv.in_proj",
               "conv.conv.weight": "conv.weight", "conv.conv.bias": "conv.bias", "conv.out_proj.weight": "conv.out_proj"}
_LFM2 = ArchSpec(
    name="lfm2",
    gguf_archs=("lfm2",),
    hf_archs=("Lfm2ForCausalLM",),
    gguf_global={**GGUF_GLOBAL, "token_embd_norm.weight": "final_norm"},
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, "shortconv.in_proj.weight": "conv.in_proj",
                "shortconv.conv.weight": "conv.weight", "shortconv.conv.bias": "conv.bias",
                "shortconv.out_proj.weight": "conv.out_proj"},
    hf_global={**HF_GLOBAL, "model.embedding_norm.weight": "final_norm"},
    hf_layer=_LFM2_LAYER,
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    mixer_types={"conv": "short_conv"},
)

# LFM2-MoE: LFM2's mixers; MLPs dense in the first num_dense_layers, then sigmoid-routed experts
# chosen with a per-expert bias (HF saves each expert's w1 / w3 / w2 apart).
_LFM2_MOE = ArchSpec(
    name="lfm2_moe",
    gguf_archs=("lfm2moe",),
    hf_archs=("Lfm2MoeForCausalLM",),
    gguf_global=_LFM2.gguf_global,
    gguf_layer={**_LFM2.gguf_layer, **_MOE_GGUF, "exp_probs_b.bias": "expert_bias"},
    hf_global=_LFM2.hf_global,
    hf_layer={**_LFM2_LAYER, "feed_forward.gate.weight": "router", "feed_forward.expert_bias": "expert_bias",
              "feed_forward.experts.{e}.w1.weight": "experts.{e}.gate_proj",
              "feed_forward.experts.{e}.w3.weight": "experts.{e}.up_proj",
              "feed_forward.experts.{e}.w2.weight": "experts.{e}.down_proj"},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    mixer_types={"conv": "short_conv"},
    moe_router="sigmoid",
    norm_topk_prob=True,  # llama.cpp always renormalises lfm2moe's weights
)

# Qwen3.5 (dense, text): gated delta nets in three of every four layers, gated attention with
# partial rotary in the fourth; (1 + w) norms everywhere but the delta net's gated output norm.
_DELTA_NET_HF = {"linear_attn.in_proj_qkv.weight": "delta.in_proj_qkv", "linear_attn.in_proj_z.weight": "delta.in_proj_z",
                 "linear_attn.in_proj_b.weight": "delta.in_proj_b", "linear_attn.in_proj_a.weight": "delta.in_proj_a",
                 "linear_attn.conv1d.weight": "delta.conv.weight", "linear_attn.A_log": "delta.A_log",
                 "linear_attn.dt_bias": "delta.dt_bias", "linear_attn.norm.weight": "delta.norm",
                 "linear_attn.out_proj.weight": "delta.out_proj"}
# llama.cpp's qwen35: z is attn_gate, b and a are ssm_beta and ssm_alpha, A = -exp(A_log) is ssm_a.
_DELTA_NET_GGUF = {"attn_qkv.weight": "delta.in_proj_qkv", "attn_gate.weight": "delta.in_proj_z",
                   "ssm_beta.weight": "delta.in_proj_b", "ssm_alpha.weight": "delta.in_proj_a",
                   "ssm_conv1d.weight": "delta.conv.weight", "ssm_a": "delta.A", "ssm_dt.bias": "delta.dt_bias",
                   "ssm_norm.weight": "delta.norm", "ssm_out.weight": "delta.out_proj",
                   "post_attention_norm.weight": "ffn_norm"}
# What Qwen3.5 / Qwen3-Next checkpoints carry beside the language model (the MTP head, "mtp.",
# is loaded apart: ArchSpec.hf_mtp_prefix).
_VISION_TOWER = {"model.visual.": "the vision tower"}
_QWEN3_5 = ArchSpec(
    name="qwen3_5",
    gguf_archs=("qwen35",),
    hf_archs=("Qwen3_5ForCausalLM",),
    hf_multimodal_archs=("Qwen3_5ForConditionalGeneration",),
    hf_skipped=_VISION_TOWER,
    hf_mtp_prefix="mtp.",
    mtp_layers="mtp_num_hidden_layers",
    mtp_form="qwen3_next",
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, **_DELTA_NET_GGUF},
    hf_layer={**HF_LAYER, **_QK_NORM_HF, **_DELTA_NET_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    hf_norm_offset=1.0,
    mixer_types={"linear_attention": "gated_delta_net"},
    attn_output_gate=True,
    gguf_v_heads_tiled=True,
)

# llama.cpp's Mamba2 names; A = -exp(A_log) is stored as ssm_a.
_MAMBA2_GGUF = {"ssm_in.weight": "mamba.in_proj", "ssm_conv1d.weight": "mamba.conv.weight",
                "ssm_conv1d.bias": "mamba.conv.bias", "ssm_a": "mamba.A", "ssm_d": "mamba.D",
                "ssm_dt.bias": "mamba.dt_bias", "ssm_norm.weight": "mamba.norm", "ssm_out.weight": "mamba.out_proj"}

_MAMBA2_HF = {"mamba.in_proj.weight": "mamba.in_proj", "mamba.conv1d.weight": "mamba.conv.weight",
              "mamba.conv1d.bias": "mamba.conv.bias", "mamba.A_log": "mamba.A_log", "mamba.D": "mamba.D",
              "mamba.dt_bias": "mamba.dt_bias", "mamba.norm.weight": "mamba.norm",
              "mamba.out_proj.weight": "mamba.out_proj"}

# Granite 4 hybrid (dense): Mamba2 in most layers, attention in a few, one shared MLP (its gate and
# up fused as input_linear), Granite's multipliers; positions unrotated ("nope") in the small models.
_GRANITE4 = ArchSpec(
    name="granite4_hybrid",
    gguf_archs=("granitehybrid",),
    hf_archs=("GraniteMoeHybridForCausalLM",),
    # The shared MLP's gate and up are stored apart; with experts it is written as a shared expert.
    gguf_layer={**GGUF_LAYER, **_MAMBA2_GGUF, **_MOE_GGUF, **_SHARED_EXPERT_GGUF},
    hf_layer={**HF_LAYER, "shared_mlp.input_linear.weight": "gate_up_proj",
              "shared_mlp.output_linear.weight": "down_proj", "block_sparse_moe.router.layer.weight": "router",
              "block_sparse_moe.input_linear.weight": "experts.gate_up_proj",
              "block_sparse_moe.output_linear.weight": "experts.down_proj", **_MAMBA2_HF},
    layer_weights=("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "ffn_norm", "gate_up_proj", "down_proj"),
    mixer_types={"linear_attention": "mamba2", "mamba": "mamba2", "attention": "attention"},
    hf_renames={"shared_intermediate_size": "shared_expert_intermediate_size"},
    norm_topk_prob=True,  # top-k logits, then a softmax over them
    shared_expert=True,
    shared_expert_gated=False,
)

# Nemotron-H: blocks of one sublayer each, Mamba2 (its conv with a bias), NoPE attention, an
# ungated relu^2 MLP or a mixture of ungated relu^2 experts with a shared one (Nemotron 3: sigmoid
# routing with a score-correction bias within the best expert groups), in the order
# hybrid_override_pattern spells (M, *, -, E).
_NEMOTRON_H_MIXER = {"mixer.in_proj.weight": "mamba.in_proj", "mixer.conv1d.weight": "mamba.conv.weight",
                     "mixer.conv1d.bias": "mamba.conv.bias", "mixer.A_log": "mamba.A_log", "mixer.D": "mamba.D",
                     "mixer.dt_bias": "mamba.dt_bias", "mixer.norm.weight": "mamba.norm",
                     "mixer.out_proj.weight": "mamba.out_proj"}
_NEMOTRON_H = ArchSpec(
    name="nemotron_h",
    gguf_archs=("nemotron_h", "nemotron_h_moe"),
    hf_archs=("NemotronHForCausalLM",),
    gguf_layer={"attn_norm.weight": "norm", "attn_q.weight": "q_proj", "attn_k.weight": "k_proj",
                "attn_v.weight": "v_proj", "attn_output.weight": "o_proj", "ffn_up.weight": "up_proj",
                "ffn_down.weight": "down_proj", **_MAMBA2_GGUF, "ffn_gate_inp.weight": "router",
                "exp_probs_b.bias": "expert_bias", "ffn_up_exps.weight": "experts.up_proj",
                "ffn_down_exps.weight": "experts.down_proj", "ffn_up_shexp.weight": "shared_expert.up_proj",
                "ffn_down_shexp.weight": "shared_expert.down_proj"},
    hf_global={"backbone.embeddings.weight": "embed_tokens", "backbone.norm_f.weight": "final_norm",
               "lm_head.weight": "lm_head"},
    hf_layer={"norm.weight": "norm", "mixer.q_proj.weight": "q_proj", "mixer.k_proj.weight": "k_proj",
              "mixer.v_proj.weight": "v_proj", "mixer.o_proj.weight": "o_proj", "mixer.up_proj.weight": "up_proj",
              "mixer.down_proj.weight": "down_proj", **_NEMOTRON_H_MIXER, "mixer.gate.weight": "router",
              "mixer.gate.e_score_correction_bias": "expert_bias",
              "mixer.experts.{e}.up_proj.weight": "experts.{e}.up_proj",
              "mixer.experts.{e}.down_proj.weight": "experts.{e}.down_proj",
              "mixer.shared_experts.up_proj.weight": "shared_expert.up_proj",
              "mixer.shared_experts.down_proj.weight": "shared_expert.down_proj"},
    layer_weights=("norm", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
    activation="relu2",
    mixer_types={"linear_attention": "mamba2", "mlp": "none", "moe": "none"},
    hf_prefix="backbone",
    hf_renames={"layers_block_type": "layer_types", "mamba_num_heads": "mamba_n_heads",
                "mamba_head_dim": "mamba_d_head", "n_groups": "mamba_n_groups", "ssm_state_size": "mamba_d_state",
                "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias", "use_bias": "mamba_proj_bias",
                "layer_norm_epsilon": "rms_norm_eps", "mlp_hidden_act": "hidden_act", "n_routed_experts": "num_experts",
                "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size"},
    hf_pattern={"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"},
    hf_defaults={"position_embedding_type": "nope", "use_expert_bias": True},
    one_sublayer=True,
    moe_router="sigmoid",
    router_norm_eps=1e-20,
    norm_topk_prob=True,
    shared_expert=True,
    shared_expert_gated=False,
)

# Falcon-H1: in every layer attention and Mamba2 side by side on the same normed input, their
# outputs summed, then a SwiGLU MLP; muP multipliers (ModelConfig.multipliers, folded into the
# weights; llama.cpp's converter folds them into a GGUF's weights itself).
_FALCON_H1 = ArchSpec(
    name="falcon_h1",
    gguf_archs=("falcon-h1",),
    hf_archs=("FalconH1ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_MAMBA2_GGUF, "ffn_norm": "ffn_norm"},  # (llama.cpp names it without ".weight")
    hf_global={**HF_GLOBAL, "model.final_layernorm.weight": "final_norm"},
    hf_layer={**HF_LAYER, "pre_ff_layernorm.weight": "ffn_norm", "feed_forward.gate_proj.weight": "gate_proj",
              "feed_forward.up_proj.weight": "up_proj", "feed_forward.down_proj.weight": "down_proj",
              **_MAMBA2_HF},
    default_mixer="attention_mamba2",
    hf_defaults={"mamba_rms_norm": False, "mamba_norm_before_gate": True},  # transformers' FalconH1Config's
    hf_multipliers=True,
)

# OLMo-hybrid: gated delta nets (q, k, v, a, b, g projected apart, q|k|v convolved apart, beta x 2
# when linear_allow_neg_eigval) in most layers, OLMo 2 attention (QK-norm over all of q and k,
# post-norms only) in the rest; saved with OLMo's norm names.
_OLMO_HYBRID = ArchSpec(
    name="olmo_hybrid",
    gguf_archs=(),  # no llama.cpp architecture for it
    hf_archs=("OlmoHybridForCausalLM",),
    hf_layer={**HF_LAYER, **_QK_NORM_HF, "attention_layer_norm.weight": "attn_norm",
              "feedforward_layer_norm.weight": "ffn_norm", "post_feedforward_layernorm.weight": "post_ffn_norm",
              "linear_attn.q_proj.weight": "delta.in_proj_q", "linear_attn.k_proj.weight": "delta.in_proj_k",
              "linear_attn.v_proj.weight": "delta.in_proj_v", "linear_attn.a_proj.weight": "delta.in_proj_a",
              "linear_attn.b_proj.weight": "delta.in_proj_b", "linear_attn.g_proj.weight": "delta.in_proj_z",
              "linear_attn.o_proj.weight": "delta.out_proj", "linear_attn.o_norm.weight": "delta.norm",
              "linear_attn.q_conv1d.weight": "delta.conv_q", "linear_attn.k_conv1d.weight": "delta.conv_k",
              "linear_attn.v_conv1d.weight": "delta.conv_v", "linear_attn.conv1d.weight": "delta.conv.weight",
              "linear_attn.A_log": "delta.A_log", "linear_attn.dt_bias": "delta.dt_bias"},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    qk_norm_per_head=False,
    mixer_types={"linear_attention": "gated_delta_net"},
    attention_post_norms=True,
    nope_without_rope_parameters=True,
    linear_norm_eps=1e-5,  # transformers' OlmoHybridRMSNormGated (FLA's default), whatever rms_norm_eps says
)

# Qwen3-Next: Qwen3.5's mixers with the delta nets' projections interleaved per key head
# (q|k|v|z and b|a; llama.cpp's converter separates q|k|v from z but keeps b|a interleaved), and a
# mixture of experts with Qwen2-MoE's sigmoid-gated shared expert in every layer.
_QWEN3_NEXT = ArchSpec(
    name="qwen3_next",
    gguf_archs=("qwen3next",),
    hf_archs=("Qwen3NextForCausalLM",),
    hf_mtp_prefix="mtp.",
    mtp_layers="mtp_num_hidden_layers",
    mtp_form="qwen3_next",
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, **_DELTA_NET_GGUF, "ssm_ba.weight": "delta.in_proj_ba",
                **_MOE_GGUF, **_SHARED_EXPERT_GGUF},
    hf_layer={**HF_LAYER, **_QK_NORM_HF, **_DELTA_NET_HF, "linear_attn.in_proj_qkvz.weight": "delta.in_proj_qkvz",
              "linear_attn.in_proj_ba.weight": "delta.in_proj_ba", **_MOE_HF, **_SHARED_EXPERT_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    hf_norm_offset=1.0,
    mixer_types={"linear_attention": "gated_delta_net"},
    attn_output_gate=True,
    norm_topk_prob=True,
    shared_expert=True,
)

# Qwen3.5 MoE: Qwen3.5's mixers, every MLP a mixture of experts (top-k always renormalised) with
# a sigmoid-gated shared expert.
_QWEN3_5_MOE = ArchSpec(
    name="qwen3_5_moe",
    gguf_archs=("qwen35moe",),
    hf_archs=("Qwen3_5MoeForCausalLM",),
    hf_multimodal_archs=("Qwen3_5MoeForConditionalGeneration",),
    hf_skipped=_VISION_TOWER,
    hf_mtp_prefix="mtp.",
    mtp_layers="mtp_num_hidden_layers",
    mtp_form="qwen3_next",
    gguf_layer={**_QWEN3_5.gguf_layer, **_MOE_GGUF, **_SHARED_EXPERT_GGUF},
    hf_layer={**_QWEN3_5.hf_layer, **_MOE_HF, **_SHARED_EXPERT_HF},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    hf_norm_offset=1.0,
    mixer_types={"linear_attention": "gated_delta_net"},
    attn_output_gate=True,
    gguf_v_heads_tiled=True,
    norm_topk_prob=True,
    shared_expert=True,
)

# GLM-4.5 MoE: q/k/v biases and per-head QK-norm, RoPE on the first half of each head; the first
# first_k_dense_replace MLPs dense, then sigmoid-routed experts chosen with a score-correction bias
# within the best expert groups (weights renormalised, times routed_scaling_factor) beside an
# ungated shared expert of n_shared_experts x the expert width.
_GLM4_MOE = ArchSpec(
    name="glm4_moe",
    gguf_archs=("glm4moe",),
    hf_archs=("Glm4MoeForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QKV_BIAS_GGUF, **_QK_NORM_GGUF, **_MOE_GGUF, "post_attention_norm.weight": "ffn_norm",
                "exp_probs_b.bias": "expert_bias", "ffn_gate_shexp.weight": "shared_expert.gate_proj",
                "ffn_up_shexp.weight": "shared_expert.up_proj", "ffn_down_shexp.weight": "shared_expert.down_proj"},
    hf_layer={**HF_LAYER, **_QKV_BIAS_HF, **_QK_NORM_HF, **_MOE_HF, "mlp.gate.e_score_correction_bias": "expert_bias",
              "mlp.shared_experts.gate_proj.weight": "shared_expert.gate_proj",
              "mlp.shared_experts.up_proj.weight": "shared_expert.up_proj",
              "mlp.shared_experts.down_proj.weight": "shared_expert.down_proj"},
    layer_weights=(*LAYER_WEIGHTS, "q_bias", "k_bias", "v_bias", "q_norm", "k_norm"),
    qkv_bias=True,
    qk_norm=True,
    qk_norm_optional=True,
    hf_renames={"n_routed_experts": "num_experts", "first_k_dense_replace": "num_dense_layers"},
    hf_defaults={"use_expert_bias": True},
    mtp_layers="num_nextn_predict_layers",
    mtp_form="deepseek_v3",
    moe_router="sigmoid",
    router_norm_eps=1e-20,
    norm_topk_prob=True,
    shared_expert=True,
    shared_expert_gated=False,
)

# gpt-oss: q/k/v/o biases, an attention sink per head, sliding layers alternating with full ones,
# every MLP experts with biases behind a biased router and the clamped SwiGLU. HF saves the experts
# as [E, in, out] with gate and up interleaved (hf_interleaved_experts); llama.cpp's converter
# splits gate and up and stores them as other stacks are.
_GPT_OSS_ATTENTION = {"self_attn.o_proj.bias": "o_bias", "self_attn.sinks": "sinks"}
_GPT_OSS = ArchSpec(
    name="gpt_oss",
    gguf_archs=("gpt-oss",),
    hf_archs=("GptOssForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QKV_BIAS_GGUF, "attn_output.bias": "o_bias", "attn_sinks.weight": "sinks",
                "post_attention_norm.weight": "ffn_norm", "ffn_gate_inp.weight": "router",
                "ffn_gate_inp.bias": "router_bias", "ffn_gate_exps.weight": "experts.gate_proj",
                "ffn_up_exps.weight": "experts.up_proj", "ffn_down_exps.weight": "experts.down_proj",
                "ffn_gate_exps.bias": "experts.gate_bias", "ffn_up_exps.bias": "experts.up_bias",
                "ffn_down_exps.bias": "experts.down_bias"},
    hf_layer={**HF_LAYER, **_QKV_BIAS_HF, **_GPT_OSS_ATTENTION, "mlp.router.weight": "router",
              "mlp.router.bias": "router_bias", "mlp.experts.gate_up_proj": "experts.gate_up_proj",
              "mlp.experts.gate_up_proj_bias": "experts.gate_up_bias", "mlp.experts.down_proj": "experts.down_proj",
              "mlp.experts.down_proj_bias": "experts.down_bias"},
    layer_weights=(*LAYER_WEIGHTS, "q_bias", "k_bias", "v_bias", "o_bias", "sinks"),
    qkv_bias=True,
    default_sliding=_alternating,
    norm_topk_prob=True,  # a softmax over the k chosen logits
    expert_biases=True,
    clamped_swiglu=True,
    hf_interleaved_experts=True,
    gguf_rope_scaling={"truncate": False},
)

# OLMo 2: no norm before attention or the MLP, one after each (saved as post_attention_layernorm and
# post_feedforward_layernorm), QK-norm over all of q and all of k.
_OLMO2 = ArchSpec(
    name="olmo2",
    gguf_archs=("olmo2",),  # llama.cpp writes OLMo 3 as olmo2 too, its sliding layers in the metadata
    hf_archs=("Olmo2ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, "post_attention_norm.weight": "ffn_norm",
                "post_ffw_norm.weight": "post_ffn_norm"},
    hf_layer={**HF_LAYER, **_QK_NORM_HF, "post_feedforward_layernorm.weight": "post_ffn_norm"},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    qk_norm_per_head=False,
    attention_post_norms=True,
    sliding_rope_unscaled=True,
)

# OLMo 3: OLMo 2 with sliding-window layers (layer_types; three of every four when it says none).
_OLMO3 = replace(_OLMO2, name="olmo3", gguf_archs=(), hf_archs=("Olmo3ForCausalLM",),
                 default_sliding=_every_fourth_full)

# EXAONE 4: OLMo 2's post-norm layers with per-head QK-norm, sliding layers beside full ones that
# (when a window is set) do not rotate positions.
_EXAONE4 = ArchSpec(
    name="exaone4",
    gguf_archs=("exaone4",),
    hf_archs=("Exaone4ForCausalLM",),
    gguf_global=_LLAMA.gguf_global,  # llama3-scaled checkpoints: per-frequency factors
    gguf_layer=_OLMO2.gguf_layer,
    hf_layer=_OLMO2.hf_layer,
    layer_weights=_OLMO2.layer_weights,
    qk_norm=True,
    attention_post_norms=True,
    default_sliding=_exaone4_sliding,
    global_nope_with_window=True,
)

# Seed-OSS: Qwen2's layout (q/k/v biases, pre-norms); llama.cpp names the MLP's norm post_attention_norm.
_SEED_OSS = ArchSpec(
    name="seed_oss",
    gguf_archs=("seed_oss",),
    hf_archs=("SeedOssForCausalLM",),
    gguf_layer={**_QWEN2.gguf_layer, "post_attention_norm.weight": "ffn_norm"},
    hf_layer=_QWEN2.hf_layer,
    layer_weights=_QWEN2.layer_weights,
    qkv_bias=True,
    hf_refused_flags=("attention_out_bias", "mlp_bias"),
)

# Ministral 3: Mistral's layout with YaRN and a query temperature by position (rope_parameters'
# llama_4_scaling_beta); llama.cpp's converter permutes its q/k rows as Llama's. Its checkpoints (and
# Mistral Small 3.1's, whose text model is plain Mistral) are Mistral3ForConditionalGeneration.
_MINISTRAL3 = ArchSpec(
    name="ministral3",
    gguf_archs=("mistral3",),
    hf_archs=("Ministral3ForCausalLM",),
    hf_multimodal_archs=("Mistral3ForConditionalGeneration",),
    hf_skipped={"vision_tower.": "the vision tower", "multi_modal_projector.": "the multimodal projector",
                "model.vision_tower.": "the vision tower", "model.multi_modal_projector.": "the multimodal projector"},
    gguf_qk_permuted=True,
    default_sliding=_all_sliding,
)

# MiniMax-M2: Mixtral's names (block_sparse_moe, w1 / w3 / w2) with OLMoE's QK-norm over all of q and
# all of k and RoPE on rotary_dim dims of each head; every MLP sparse, experts chosen by sigmoid score
# plus the score-correction bias, their scores renormalised (by their sum alone, as transformers does).
_MINIMAX_M2 = ArchSpec(
    name="minimax_m2",
    gguf_archs=("minimax-m2",),
    hf_archs=("MiniMaxM2ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_QK_NORM_GGUF, **_MOE_GGUF, "exp_probs_b.bias": "expert_bias"},
    hf_layer={**HF_LAYER, **_QK_NORM_HF, **_MIXTRAL_HF, "block_sparse_moe.e_score_correction_bias": "expert_bias"},
    layer_weights=(*LAYER_WEIGHTS, "q_norm", "k_norm"),
    qk_norm=True,
    qk_norm_per_head=False,
    hf_defaults={"use_expert_bias": True},  # transformers always adds the bias (use_routing_bias in its configs)
    moe_router="sigmoid",
    router_norm_eps=0.0,
    norm_topk_prob=True,
)

# DeepSeek-V3: multi-head latent attention (q through a LoRA q_a -> norm -> q_b, or q_proj; k and v
# from one latent per token that kv_a_proj_with_mqa makes beside a rope key every head shares, up-
# projected by kv_b_proj, which llama.cpp's converter splits per head into attn_k_b and attn_v_b);
# GLM-4.5's MLPs (the first first_k_dense_replace dense, then sigmoid-routed experts within the best
# expert groups beside an ungated shared expert). GLM-4 MoE Lite is the same model (its dense layers
# named by mlp_layer_types); llama.cpp writes both as deepseek2.
_MLA_GGUF = {"attn_q_a.weight": "q_a_proj", "attn_q_a_norm.weight": "q_a_norm", "attn_q_b.weight": "q_b_proj",
             "attn_kv_a_mqa.weight": "kv_a_proj", "attn_kv_a_norm.weight": "kv_a_norm",
             "attn_kv_b.weight": "kv_b_proj", "attn_k_b.weight": "k_b", "attn_v_b.weight": "v_b"}
_MLA_HF = {"self_attn.q_a_proj.weight": "q_a_proj", "self_attn.q_a_layernorm.weight": "q_a_norm",
           "self_attn.q_b_proj.weight": "q_b_proj", "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
           "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "kv_b_proj"}
_DEEPSEEK_V3 = replace(
    _GLM4_MOE,
    name="deepseek_v3",
    gguf_archs=("deepseek2",),
    hf_archs=("DeepseekV3ForCausalLM",),
    gguf_layer={**GGUF_LAYER, **_MLA_GGUF, **_MOE_GGUF, "exp_probs_b.bias": "expert_bias",
                "ffn_gate_shexp.weight": "shared_expert.gate_proj", "ffn_up_shexp.weight": "shared_expert.up_proj",
                "ffn_down_shexp.weight": "shared_expert.down_proj"},
    hf_layer={**HF_LAYER, **_MLA_HF, **{k: v for k, v in _GLM4_MOE.hf_layer.items() if "mlp." in k}},
    layer_weights=("attn_norm", "o_proj", "ffn_norm", "gate_proj", "up_proj", "down_proj"),
    qkv_bias=False,
    qk_norm=False,
    qk_norm_optional=False,
    rope_interleaved=True,
    default_mixer="mla",
)
_GLM4_MOE_LITE = replace(_DEEPSEEK_V3, name="glm4_moe_lite", gguf_archs=(), hf_archs=("Glm4MoeLiteForCausalLM",))
# Gemma 4 (text): Gemma 3's four norms and QK-norm with plain-w norms, values normed too, queries
# unscaled; per-layer embeddings feeding a gated residual branch at the end of every layer, times
# its layer_scalar; its full-attention layers' own head shapes and the last layers' shared K/V are
# read by vkrt/loader/layer_shapes.py. Its checkpoints are Gemma4ForConditionalGeneration.
_PER_LAYER_INPUTS_HF = {"model.embed_tokens_per_layer.weight": "per_layer.embed",
                        "model.per_layer_model_projection.weight": "per_layer.model_proj",
                        "model.per_layer_projection_norm.weight": "per_layer.model_norm"}
# The MoE variant (26B-A4B) runs the dense MLP and the experts side by side, each with its own norms;
# its router norms the residual stream without a weight, times `scale` / sqrt(hidden), and its chosen
# weights are scaled per expert.
_GEMMA4_MOE_HF = {"router.proj.weight": "router", "router.scale": "router.scale",
                  "router.per_expert_scale": "router.expert_scale", "experts.gate_up_proj": "experts.gate_up_proj",
                  "experts.down_proj": "experts.down_proj", "pre_feedforward_layernorm_2.weight": "ffn_norm_2",
                  "post_feedforward_layernorm_1.weight": "post_ffn_norm_1",
                  "post_feedforward_layernorm_2.weight": "post_ffn_norm_2"}
_PER_LAYER_INPUTS_GGUF = {"per_layer_token_embd.weight": "per_layer.embed",
                          "per_layer_model_proj.weight": "per_layer.model_proj",
                          "per_layer_proj_norm.weight": "per_layer.model_norm"}
_GEMMA4 = ArchSpec(
    name="gemma4",
    gguf_archs=("gemma4",),
    # llama.cpp's converter writes proportional RoPE as rope_freqs (1 for the pairs that rotate, 1e30
    # for the rest), read back into rope parameters (gguf_fields)
    gguf_global={**GGUF_GLOBAL, **_PER_LAYER_INPUTS_GGUF, "rope_freqs.weight": "rope_freqs"},
    gguf_layer={**GGUF_LAYER, **_GEMMA_GGUF, **_QK_NORM_GGUF, "layer_output_scale.weight": "layer_scalar",
                "inp_gate.weight": "per_layer.gate", "proj.weight": "per_layer.proj",
                "post_norm.weight": "per_layer.norm", "ffn_gate_inp.weight": "router", "ffn_gate_inp.scale": "router.scale",
                "ffn_down_exps.scale": "router.expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
                "ffn_down_exps.weight": "experts.down_proj", "pre_ffw_norm_2.weight": "ffn_norm_2",
                "post_ffw_norm_1.weight": "post_ffn_norm_1", "post_ffw_norm_2.weight": "post_ffn_norm_2"},
    gguf_per_layer_shapes=True,
    hf_archs=("Gemma4ForCausalLM",),
    hf_multimodal_archs=("Gemma4ForConditionalGeneration",),
    hf_skipped={"model.vision_tower.": "the vision tower", "model.embed_vision.": "the vision tower",
                "model.audio_tower.": "the audio tower", "model.embed_audio.": "the audio tower"},
    hf_global={**HF_GLOBAL, **_PER_LAYER_INPUTS_HF},
    hf_layer={**HF_LAYER, **_GEMMA_HF, **_QK_NORM_HF, **_GEMMA4_MOE_HF, "layer_scalar": "layer_scalar",
              "per_layer_input_gate.weight": "per_layer.gate", "per_layer_projection.weight": "per_layer.proj",
              "post_per_layer_input_norm.weight": "per_layer.norm"},
    layer_weights=(*LAYER_WEIGHTS, "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm", "layer_scalar"),
    activation="gelu_tanh",
    qk_norm=True,
    v_norm=True,
    sandwich_norms=True,
    scale_embeddings=True,
    default_sliding=_gemma3_sliding,
    hf_defaults={"query_pre_attn_scalar": 1},  # transformers scales Gemma 4's scores by 1 (the norms set their size)
    hf_renames={"top_k_experts": "num_experts_per_tok"},
    moe_flag="enable_moe_block",
    moe_beside_mlp=True,
    norm_topk_prob=True,
)

# Llama 4 (text): Llama's names under feed_forward., interleaved RoPE pairs (complex rotation), the
# rest in vkrt/loader/llama4.py; Llama4ForConditionalGeneration's language model with its towers skipped.
_LLAMA4_FFN = {"feed_forward.gate_proj.weight": "gate_proj", "feed_forward.up_proj.weight": "up_proj",
               "feed_forward.down_proj.weight": "down_proj", "feed_forward.router.weight": "router",
               "feed_forward.experts.gate_up_proj": "experts.gate_up_proj",
               "feed_forward.experts.down_proj": "experts.down_proj",
               **{f"feed_forward.shared_expert.{n}.weight": f"shared_expert.{n}"
                  for n in ("gate_proj", "up_proj", "down_proj")}}
_LLAMA4 = ArchSpec(
    name="llama4",
    gguf_archs=("llama4",),
    hf_archs=("Llama4ForCausalLM",),
    gguf_global=_LLAMA.gguf_global,  # llama3-scaled RoPE: per-frequency factors
    hf_multimodal_archs=("Llama4ForConditionalGeneration",),
    hf_skipped={"vision_model.": "the vision tower", "multi_modal_projector.": "the multimodal projector",
                "model.vision_model.": "the vision tower", "model.multi_modal_projector.": "the multimodal projector"},
    gguf_layer={**GGUF_LAYER, **_MOE_GGUF, "ffn_gate_shexp.weight": "shared_expert.gate_proj",
                "ffn_up_shexp.weight": "shared_expert.up_proj", "ffn_down_shexp.weight": "shared_expert.down_proj"},
    hf_layer={**{k: v for k, v in HF_LAYER.items() if not k.startswith("mlp.")}, **_LLAMA4_FFN},
    rope_interleaved=True,
    mixer_types={"chunked_attention": "attention"},
    moe_router="sigmoid",
    hf_stacked_experts=True,
    chunked_attention=True,
)

ARCHS: tuple[ArchSpec, ...] = (_LLAMA, _MISTRAL, _QWEN2, _QWEN3, _GEMMA2, _GEMMA3, _PHI3, _SMOLLM3, _GRANITE,
                               _QWEN3_MOE, _QWEN2_MOE, _MIXTRAL, _OLMOE, _ERNIE4_5, _LFM2, _QWEN3_5, _QWEN3_5_MOE,
                               _GRANITE4, _QWEN3_NEXT, _NEMOTRON_H, _LFM2_MOE, _OLMO_HYBRID, _FALCON_H1,
                               _GLM4_MOE, _GPT_OSS, _OLMO2, _OLMO3, _EXAONE4, _SEED_OSS, _MINISTRAL3,
                               _MINIMAX_M2, _DEEPSEEK_V3, _GLM4_MOE_LITE, _GEMMA4, _LLAMA4)


def arch_for_gguf(gguf_arch: str, experts: bool = False) -> ArchSpec | None:
    """The spec whose GGUF `general.architecture` is `gguf_arch`, or None; of two ("llama": Llama
    and Mixtral) the one for a file with experts or without (ArchSpec.gguf_with_experts)."""
    specs = [a for a in ARCHS if gguf_arch in a.gguf_archs]
    return next((a for a in specs if a.gguf_with_experts == experts), specs[0] if specs else None)


def arch_for_hf(hf_archs: list[str]) -> ArchSpec | None:
    """The spec matching any entry of config.json `architectures`, or None."""
    return next((a for a in ARCHS for name in hf_archs if name in a.hf_archs + a.hf_multimodal_archs), None)


def supported_gguf_archs() -> str:
    return ", ".join(dict.fromkeys(name for a in ARCHS for name in a.gguf_archs))


def supported_hf_archs() -> str:
    return ", ".join(name for a in ARCHS for name in a.hf_archs + a.hf_multimodal_archs)


def arch_named(name: str) -> ArchSpec:
    """The spec whose ModelConfig.architecture is `name`."""
    return next(a for a in ARCHS if a.name == name)

