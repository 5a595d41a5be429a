"""Tiny random-weight models of every supported family, for tools/make_fixtures.py.

Each fixture is made by the family's own transformers class (Qwen2ForCausalLM,
Qwen3ForCausalLM, MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
Phi3ForCausalLM, SmolLM3, Granite, the mixtures of experts Qwen3MoeForCausalLM,
MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM,
DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM, and the hybrids), saved as an HF directory under tests/fixtures/tiny_<family>/ with a
golden.json in the tiny llamas' schema. Qwen2, Qwen3, Gemma 2 and 3 are also written as GGUF files
with the `gguf` package's writer (llama.cpp tensor names and row order, Gemma norms
stored as 1 + w as llama.cpp's converter does), and their goldens are what transformers
computes after loading those GGUF files. The other families' GGUFs are made by llama.cpp's own
converter (CONVERTED_FAMILIES), their goldens the HF ones.

Run through make_fixtures.py (`--only families`, or `--only moe` for the mixtures of
experts alone), from the tools venv.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

# Long enough to cross every sliding window below (8) several times.
WINDOW = 8
LONG_PROMPT = [(37 * i + 11) % 256 for i in range(40)]

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Written as GGUF too. Phi-3 is not: transformers' GGUF reader drops its longrope factors.
GGUF_FAMILIES = ("Qwen2", "Qwen3", "Gemma2", "Gemma3", "Qwen3Moe")
# Converted to GGUF by llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python
# source package; VKRT_LLAMACPP names its vendor/llama.cpp directory), f32: the hybrids, gpt-oss, and the
# families whose GGUFs the `gguf` package's writer above does not make.
CONVERTED_FAMILIES = ("Lfm2", "Qwen3_5", "Qwen3Next", "Qwen3_5Moe", "Lfm2Moe", "GraniteMoeHybrid", "NemotronH",
                      "FalconH1", "Mixtral", "Olmoe", "SmolLM3", "Granite", "Ernie4_5", "Phi3", "Olmo2", "Olmo3",
                      "Exaone4", "SeedOss", "Ministral3", "Glm4Moe", "GptOss", "MiniMaxM2", "DeepseekV3",
                      "Glm4MoeLite", "Gemma4", "Llama4")


# config.json as the converter expects it where transformers 5 saves it otherwise: llama.cpp reads
# Granite 4's layer types as IBM's checkpoints spell them (mamba / attention).
CONVERT_CONFIG: dict[str, Any] = {
    "GraniteMoeHybrid": lambda cfg: cfg | {"layer_types": [{"linear_attention": "mamba", "full_attention": "attention"}
                                                           .get(t, t) for t in cfg["layer_types"]]},
    # MiniMax-M2's released configs name the router's sigmoid, which the converter writes as the gating function.
    "MiniMaxM2": lambda cfg: cfg | {"scoring_func": "sigmoid"},
    # DeepSeek-V3's and GLM-4.7-Flash's released configs name the sigmoid too (the converter writes no gating
    # function without it, and llama.cpp then routes a deepseek2 file by softmax), and GLM's its first dense layer.
    "DeepseekV3": lambda cfg: cfg | {"scoring_func": "sigmoid"},
    "Glm4MoeLite": lambda cfg: cfg | {"scoring_func": "sigmoid", "first_k_dense_replace": 1},
}
# Where a converted GGUF says otherwise than the HF config, llama.cpp runs what the GGUF says: its
# golden is transformers' forward of the HF fixture (the same weights) with the config overrides
# made here from config.json. llama.cpp writes Mixtral as "llama", with no sliding window; it derives
# longrope's attention factor from max_position_embeddings / original (1 for tiny_phi3), where
# transformers reads the rope parameters' `factor` (4).
CONVERT_AS_RUN: dict[str, Any] = {
    "tiny_mixtral": lambda cfg: {"sliding_window": None},
    "tiny_phi3": lambda cfg: {"rope_parameters": cfg["rope_parameters"] | {"attention_factor": 1.0}},
    # llama.cpp runs every llama4 file with chunks of 8192 and the temperature's floor 8192, scale 0.1.
    "tiny_llama4": lambda cfg: {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1},
}
# Families whose converter reads the vocabulary's size from tokenizer.json (Gemma 4's trims its
# embedding to it): converted from a copy holding a word-level tokenizer.json of that many tokens.
CONVERT_VOCAB = ("Gemma4",)
# Converted families' fixtures that are not converted (one GGUF of the family is enough).
NOT_CONVERTED = ("tiny_falcon_h1_nonorm",)
# What a conversion changes, by fixture, said in its golden's description.
CONVERT_NOTES = {"tiny_falcon_h1": "; the converter folds the muP multipliers into the weights, which rounds them",
                 "tiny_mixtral": " with no sliding window (CONVERT_AS_RUN), as llama.cpp runs the file",
                 "tiny_phi3": " with longrope's attention factor 1 (CONVERT_AS_RUN), as the converter wrote it",
                 "tiny_llama4": " with chunks of 8192 and the temperature's floor 8192 and scale 0.1 (CONVERT_AS_RUN), "
                                "as llama.cpp runs a llama4 file"}
# Families whose checkpoints may hold an MTP head: converted with --no-mtp (others refuse the flag).
MTP_FAMILIES = ("Qwen3_5", "Qwen3Next", "Qwen3_5Moe")
# Families whose text model has its own config class beside the multimodal one.
TEXT_CONFIGS = ("Gemma3", "Qwen3_5", "Qwen3_5Moe", "Gemma4", "Llama4")
# Families whose HF norms scale by (1 + w), their weights starting at 0 (Gemma 4's scale by w).
ONE_PLUS_W_NORMS = ("Gemma2", "Gemma3")
LLAMACPP_DEFAULT = Path(__file__).resolve().parents[1] / "build" / "llamacpp"

PHI3_SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]
PHI3_LONG = [1.0, 1.5, 2.2, 3.0, 4.0, 5.2, 6.5, 8.0]

GEMMA3_SMALL = dict(  # 6 layers so that the default pattern (every 6th layer global) appears
    BASE, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=16,
    sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
)

GEMMA4_SMALL = dict(  # the last two layers (one sliding, one full) share the K/V of layers 3 and 2
    BASE, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, global_head_dim=32, rms_norm_eps=1e-6, sliding_window=WINDOW,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention"],
    num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
)


# The MLA families' common shape (DeepSeek-V3, GLM-4 MoE Lite): a latent of 32 + a rope key of 8 per token.
MLA = dict({k: v for k, v in BASE.items() if k != "head_dim"}, num_hidden_layers=3, num_key_value_heads=4,
           tie_word_embeddings=False, eos_token_id=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, rope_interleave=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def _families() -> dict[str, tuple[str, dict[str, Any], str]]:
    """fixture name -> (transformers class, config kwargs, one-line description). A fixture's seed is
    its position here: add new ones at the end, or every fixture after it changes."""
    return {
        "tiny_qwen2": ("Qwen2", dict(BASE, tie_word_embeddings=True, rope_theta=1e6),
                       "q/k/v biases, tied embeddings, rope_theta 1e6"),
        "tiny_qwen3": ("Qwen3", dict(BASE, tie_word_embeddings=False, rope_theta=1e6, attention_bias=False),
                       "QK-norm (RMSNorm over head_dim before RoPE), untied"),
        "tiny_mistral": ("Mistral", dict(BASE, tie_word_embeddings=False, sliding_window=WINDOW),
                         f"sliding window {WINDOW} on every layer"),
        "tiny_gemma2": ("Gemma2", dict(BASE, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                       sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=4.0,
                                       layer_types=["sliding_attention", "full_attention"]),
                        "GeGLU, (1 + w) norms, sandwich norms, softcaps 5 / 4, query_pre_attn_scalar 24, "
                        f"sliding {WINDOW} / full"),
        "tiny_gemma3": ("Gemma3", dict(GEMMA3_SMALL, rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
                        "QK-norm with (1 + w), sandwich norms, 5 sliding : 1 full, local rope 1e4, "
                        "global rope 1e6 with linear factor 4"),
        "tiny_phi3": ("Phi3", dict(BASE, tie_word_embeddings=False, max_position_embeddings=64, eos_token_id=None,
                                   original_max_position_embeddings=64, rope_parameters={
                                       "rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                                       "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                                       "original_max_position_embeddings": 64}),
                      "fused qkv_proj and gate_up_proj, longrope (short factors, attention factor "
                      "from factor 4)"),
        "tiny_smollm3": ("SmolLM3", dict(BASE, num_hidden_layers=4, tie_word_embeddings=True,
                                         rope_theta=10000.0, no_rope_layers=[1, 1, 1, 0]),
                         "Llama with a NoPE layer (no_rope_layers [1, 1, 1, 0])"),
        "tiny_granite": ("Granite", dict(BASE, tie_word_embeddings=True, embedding_multiplier=3.0,
                                         attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5),
                         "Llama with embedding x3, attention scale 0.2, residual branches x0.6, logits / 2.5"),
        # Mixtures of experts (after the dense families, so their seeds stay as they were).
        "tiny_qwen3_moe": ("Qwen3Moe", dict(BASE, tie_word_embeddings=True, rope_theta=1e6, attention_bias=False,
                                            intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[0]),
                           "QK-norm; layer 0 dense (mlp_only_layers), layer 1 sparse: 8 experts of width 16, "
                           "top-2, norm_topk_prob"),
        "tiny_mixtral": ("Mixtral", dict(BASE, tie_word_embeddings=True, intermediate_size=32, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=WINDOW),
                         f"every layer sparse: 4 experts of width 32, top-2 renormalised; sliding window {WINDOW}"),
        "tiny_olmoe": ("Olmoe", dict(BASE, tie_word_embeddings=True, intermediate_size=32, num_experts=5,
                                     num_experts_per_tok=3, norm_topk_prob=False),
                       "QK-norm over all of q and of k; every layer sparse: 5 experts of width 32, top-3, "
                       "weights not renormalised"),
        "tiny_qwen2_moe": ("Qwen2Moe", dict(BASE, tie_word_embeddings=True, rope_theta=1e6, num_experts=7,
                                            num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=48, norm_topk_prob=False),
                           "q/k/v biases; every layer sparse: 7 experts of width 16, top-2, weights not "
                           "renormalised, and a shared expert of width 48 behind a sigmoid gate"),
        # RoPE variants (after the mixtures of experts, so the seeds above stay as they were).
        "tiny_phi3_partial": ("Phi3", dict(BASE, tie_word_embeddings=False, eos_token_id=None, partial_rotary_factor=0.5,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5}),
                              "partial rotary: RoPE on the first 8 of each head's 16 dims, the rest passed "
                              "through (partial_rotary_factor 0.5)"),
        "tiny_ernie4_5": ("Ernie4_5", dict(BASE, tie_word_embeddings=True, rope_parameters={
                              "rope_type": "default", "rope_theta": 5e5}),
                          "ERNIE 4.5: Llama's layout with RoPE on interleaved pairs (2i, 2i + 1), tied, "
                          "rope_theta 5e5"),
        # Hybrids: recurrent mixers beside attention (after the rest, so their seeds stay).
        "tiny_lfm2": ("Lfm2", dict(BASE, num_hidden_layers=4, tie_word_embeddings=True, norm_eps=1e-5,
                                   layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3,
                                   conv_bias=False, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                                   block_multiple_of=16, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1e6}),
                      "LFM2: short gated convolutions (kernel 3) in layers 0, 2, 3, attention with per-head "
                      "QK-norm in layer 1; FFN width auto-adjusted from 128 to 96"),
        "tiny_qwen3_5": ("Qwen3_5", dict(BASE, num_hidden_layers=4, tie_word_embeddings=False, head_dim=16,
                                         initializer_range=0.1,
                                         layer_types=["linear_attention", "linear_attention", "full_attention",
                                                      "linear_attention"],
                                         linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                                         linear_num_key_heads=2, linear_num_value_heads=4,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                          "partial_rotary_factor": 0.25}),
                         "Qwen3.5 dense: gated delta nets (2 key heads of 16, 4 value heads of 8, conv 4) in "
                         "layers 0, 1, 3, gated attention with (1 + w) QK-norm and partial rotary 0.25 in layer 2"),
        "tiny_qwen3_5_moe": ("Qwen3_5Moe", dict(BASE, num_hidden_layers=4, tie_word_embeddings=False, head_dim=16,
                                                initializer_range=0.1,
                                                layer_types=["linear_attention", "linear_attention",
                                                             "full_attention", "linear_attention"],
                                                linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                                linear_value_head_dim=8, linear_num_key_heads=2,
                                                linear_num_value_heads=4, num_experts=6, num_experts_per_tok=2,
                                                moe_intermediate_size=24, shared_expert_intermediate_size=32,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                 "partial_rotary_factor": 0.25}),
                             "Qwen3.5 MoE: tiny_qwen3_5's mixers, every MLP a mixture of 6 experts of 24 (top-2) "
                             "with a shared expert of 32 behind a sigmoid gate"),
        "tiny_qwen3_next": ("Qwen3Next", dict(BASE, num_hidden_layers=4, tie_word_embeddings=False, head_dim=16,
                                              initializer_range=0.1, layer_types=["linear_attention",
                                                                                  "full_attention",
                                                                                  "linear_attention",
                                                                                  "linear_attention"],
                                              linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                              linear_value_head_dim=8, linear_num_key_heads=2,
                                              linear_num_value_heads=4, num_experts=6, num_experts_per_tok=2,
                                              moe_intermediate_size=24, shared_expert_intermediate_size=32,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                               "partial_rotary_factor": 0.25}),
                            "Qwen3-Next: gated delta nets (q|k|v|z and b|a interleaved per key head) in layers "
                            "0, 2, 3, gated attention in layer 1; MoE (6 experts of 24, top-2, a shared expert of "
                            "32 behind a sigmoid gate) in every layer, as the real models and llama.cpp have it"),
        "tiny_granite4": ("GraniteMoeHybrid", dict(BASE, num_hidden_layers=4, tie_word_embeddings=True, eos_token_id=None,
                                                   initializer_range=0.1, num_local_experts=0,
                                                   shared_intermediate_size=96,
                                                   layer_types=["mamba", "mamba", "attention", "mamba"],
                                                   mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
                                                   mamba_d_head=32, mamba_d_conv=4, mamba_expand=2,
                                                   mamba_conv_bias=True, position_embedding_type="nope",
                                                   embedding_multiplier=3.0, attention_multiplier=0.2,
                                                   residual_multiplier=0.6, logits_scaling=2.5),
                          "Granite 4 hybrid (dense): Mamba2 (4 heads of 32, 2 groups, state 16, conv 4 with "
                          "bias) in layers 0, 1, 3, NoPE attention in layer 2, a shared MLP of 96, Granite's "
                          "four multipliers"),
        "tiny_nemotron_h": ("NemotronH", dict(vocab_size=256, hidden_size=64, max_position_embeddings=256,
                                              initializer_range=0.1, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                                              layers_block_type=["linear_attention", "mlp", "full_attention", "mlp",
                                                                 "linear_attention", "mlp"],
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              intermediate_size=96, mamba_num_heads=8, mamba_head_dim=24, n_groups=2,
                                              ssm_state_size=16, conv_kernel=4, layer_norm_epsilon=1e-5),
                            "Nemotron-H (dense): blocks of one sublayer each, Mamba2 (8 heads of 24: inner 192, not "
                            "2 x hidden; 2 groups, state 16, conv 4 with bias) in blocks 0 and 4, NoPE attention in "
                            "block 2, an ungated relu^2 MLP of 96 in blocks 1, 3, 5"),
        "tiny_lfm2_moe": ("Lfm2Moe", dict(BASE, num_hidden_layers=4, tie_word_embeddings=True, eos_token_id=None,
                                          intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                          num_experts_per_tok=2, num_dense_layers=1, norm_topk_prob=True,
                                          use_expert_bias=True, conv_L_cache=3,
                                          norm_eps=1e-5, layer_types=["conv", "full_attention", "conv", "conv"]),
                          "LFM2-MoE: LFM2's gated short convolutions (layers 0, 2, 3) and QK-normed attention (layer "
                          "1); layer 0's MLP dense (96), then 6 experts of 32, top-2 by sigmoid score + a per-expert "
                          "bias, weights renormalised (routed_scaling_factor 1, as in the real models: llama.cpp's converter "
                          "does not carry it)"),
        "tiny_olmo_hybrid": ("OlmoHybrid", dict(BASE, num_hidden_layers=4, tie_word_embeddings=False, eos_token_id=None,
                                                intermediate_size=96, initializer_range=0.1, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=16,
                                                linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                                linear_allow_neg_eigval=True,
                                                layer_types=["linear_attention", "linear_attention",
                                                             "full_attention", "linear_attention"]),
                             "OLMo-hybrid: gated delta nets (2 key heads of 16, 4 value heads of 8; q, k, v, a, b, g "
                             "projected apart and q, k, v convolved apart; beta x 2) in layers 0, 1, 3; OLMo 2 "
                             "attention (QK-norm over all of q and k, RoPE, norms after attention and MLP only) in "
                             "layer 2"),
        "tiny_granite4_moe": ("GraniteMoeHybrid", dict(BASE, num_hidden_layers=4, tie_word_embeddings=True,
                                                       eos_token_id=None, initializer_range=0.1, num_local_experts=6,
                                                       num_experts_per_tok=2, intermediate_size=32,
                                                       shared_intermediate_size=96,
                                                       layer_types=["mamba", "mamba", "attention", "mamba"],
                                                       mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
                                                       mamba_d_head=32, mamba_d_conv=4, mamba_expand=2,
                                                       mamba_conv_bias=True, position_embedding_type="nope",
                                                       embedding_multiplier=3.0, attention_multiplier=0.2,
                                                       residual_multiplier=0.6, logits_scaling=2.5),
                              "Granite 4 hybrid with experts (granite-4.0-h-tiny's kind): tiny_granite4's mixers, "
                              "every MLP 6 experts of 32 (top-2, softmax over the chosen logits, gate|up stacked per "
                              "expert) plus the layer's own MLP of 96 added ungated"),
        "tiny_nemotron_h_moe": ("NemotronH", dict(vocab_size=256, hidden_size=64, max_position_embeddings=256,
                                                  initializer_range=0.1, bos_token_id=1, eos_token_id=None,
                                                  pad_token_id=0,
                                                  layers_block_type=["linear_attention", "moe", "full_attention",
                                                                     "moe", "linear_attention", "moe"],
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                  mamba_num_heads=8, mamba_head_dim=24, n_groups=2, ssm_state_size=16,
                                                  conv_kernel=4, layer_norm_epsilon=1e-5, n_routed_experts=8,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  moe_shared_expert_intermediate_size=48, n_shared_experts=1,
                                                  n_group=2, topk_group=1, norm_topk_prob=True,
                                                  routed_scaling_factor=2.5),
                                "Nemotron-H with experts (Nemotron 3 Nano's kind): tiny_nemotron_h's Mamba2 and "
                                "attention blocks, MoE blocks of 8 ungated relu^2 experts of 32 (sigmoid scores, "
                                "chosen with the score-correction bias within the best 1 of 2 groups, top-2 "
                                "renormalised, x 2.5) plus a shared relu^2 expert of 48"),
        "tiny_falcon_h1": ("FalconH1", dict(BASE, num_hidden_layers=3, eos_token_id=None, initializer_range=0.1,
                                            mamba_d_ssm=96, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
                                            mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=True,
                                            mamba_norm_before_gate=False, embedding_multiplier=3.0,
                                            lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.3], key_multiplier=0.7,
                                            attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                                            ssm_in_multiplier=1.1, ssm_out_multiplier=0.95,
                                            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05]),
                           "Falcon-H1: in each of 3 layers attention (4 / 2 heads of 16) and Mamba2 (4 heads of 24: "
                           "mamba_d_ssm 96, not 2 x hidden; 2 groups, state 16, conv 4 with bias, norm after the "
                           "gate as the released models have it) on the same input, summed; a SwiGLU MLP of 128; "
                           "every muP multiplier away from 1"),
        "tiny_falcon_h1_nonorm": ("FalconH1", dict(BASE, num_hidden_layers=2, eos_token_id=None, initializer_range=0.1,
                                                   tie_word_embeddings=True, mamba_d_ssm=96, mamba_n_heads=4,
                                                   mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=3,
                                                   mamba_chunk_size=8, mamba_rms_norm=False,
                                                   embedding_multiplier=2.0, lm_head_multiplier=0.7,
                                                   key_multiplier=1.3, ssm_multipliers=[0.9, 1.1, 1.0, 1.2, 0.8]),
                                  "Falcon-H1 as transformers' defaults have it: tiny_falcon_h1's mixers with no "
                                  "norm on Mamba2's output (y * silu(z)), conv 3, tied embeddings (scaled on the "
                                  "way in, the head by lm_head_multiplier), some multipliers left at 1"),
        # Dense attention families of 2025-26 (after the hybrids, so their seeds stay).
        "tiny_olmo2": ("Olmo2", dict(BASE, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 5e5}),
                       "OLMo 2: norms after attention and after the MLP only (none before), QK-norm over all of q "
                       "and all of k, rope_theta 5e5"),
        "tiny_olmo3": ("Olmo3", dict(BASE, num_hidden_layers=4, tie_word_embeddings=False, sliding_window=WINDOW,
                                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                      "full_attention": {"rope_type": "yarn", "rope_theta": 5e5,
                                                                         "factor": 8.0, "beta_fast": 4.0,
                                                                         "beta_slow": 1.0,
                                                                         "original_max_position_embeddings": 16}}),
                       f"OLMo 3: OLMo 2's layers, sliding window {WINDOW} in layers 0-2 (plain RoPE) and full "
                       "attention in layer 3 (transformers' default layer_types) with YaRN, as the released models"),
        "tiny_exaone4": ("Exaone4", dict(BASE, num_hidden_layers=4, tie_word_embeddings=False, eos_token_id=None,
                                         sliding_window=WINDOW,
                                         sliding_window_pattern=4, rope_parameters={
                                             "rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
                         f"EXAONE 4: norms after attention and the MLP only, per-head QK-norm; sliding window "
                         f"{WINDOW} in layers 0-2 (RoPE, llama3-scaled), layer 3 full attention without RoPE"),
        "tiny_seed_oss": ("SeedOss", dict(BASE, tie_word_embeddings=False, eos_token_id=None, head_dim=32,
                                          attention_bias=True, attention_out_bias=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e7}),
                          "Seed-OSS: q/k/v biases (none on o_proj or the MLP), head_dim 32 (heads x head_dim 128, "
                          "not hidden 64), rope_theta 1e7"),
        "tiny_ministral3": ("Ministral3", dict(BASE, tie_word_embeddings=True, eos_token_id=None, rope_parameters={
                                "rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0,
                                "original_max_position_embeddings": 16, "max_position_embeddings": 256,
                                "beta_fast": 2.0, "beta_slow": 0.25, "mscale": 1.0, "mscale_all_dim": 0.5,
                                "llama_4_scaling_beta": 0.1}),
                            "Ministral 3: YaRN (factor 16 over 16 positions, the ramp over dims 0-3, attention "
                            "factor from mscale 1 / mscale_all_dim 0.5), queries times 1 + 0.1 ln(1 + floor(p / 16)), "
                            "tied embeddings"),
        "tiny_glm4_moe": ("Glm4Moe", dict(BASE, num_hidden_layers=3, tie_word_embeddings=False, eos_token_id=None,
                                          attention_bias=True, use_qk_norm=True, n_routed_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                          n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                                          routed_scaling_factor=2.5, num_mtp_layers=0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}),
                          "GLM-4.5 MoE: q/k/v biases, per-head QK-norm, RoPE on the first 8 of each head's 16 dims; "
                          "layer 0's MLP dense (128, first_k_dense_replace 1), then 8 experts of 32, top-2 by sigmoid "
                          "score + the score-correction bias within the best 1 of 2 groups, renormalised, x 2.5, "
                          "plus an ungated shared expert of 32"),
        "tiny_gpt_oss": ("GptOss", dict(BASE, num_hidden_layers=2, eos_token_id=None, initializer_range=0.5,
                                        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                        sliding_window=WINDOW,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                         "original_max_position_embeddings": 64}),
                         "gpt-oss: attention sinks, q/k/v/o biases, YaRN (factor 4 over 64), a sliding (8) "
                         "then a full layer; 4 experts of 32 (top-2, softmax over the chosen logits, a router "
                         "bias, expert biases), the clamped SwiGLU at its own limit (7; llama.cpp's converter "
                         "cannot write another), weights of std 0.5 so that its clamps bite"),
        "tiny_minimax_m2": ("MiniMaxM2", dict(BASE, num_hidden_layers=2, tie_word_embeddings=False, eos_token_id=None,
                                              intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                              rope_theta=10000.0, rotary_dim=8),
                            "MiniMax-M2: QK-norm over all of q and all of k, RoPE on the first 8 of each head's 16 "
                            "dims (rotary_dim, as the released configs spell it); every MLP 8 experts of 16, top-2 by "
                            "sigmoid score + the score-correction bias, renormalised"),
        # Multi-head latent attention (MLA): the cache holds the kv latent and the rope key per token.
        "tiny_deepseek_v3": ("DeepseekV3", dict(MLA, q_lora_rank=24, num_mtp_layers=0, n_group=2, topk_group=1, first_k_dense_replace=1,
                                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                 "factor": 4.0, "original_max_position_embeddings": 64,
                                                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                                                 "mscale_all_dim": 0.707}),
                             "DeepSeek-V3: MLA with q LoRA 24, kv LoRA 32, heads of 16 nope + 8 interleaved rope "
                             "dims and values of 16, YaRN (factor 4 over 64; mscale = mscale_all_dim = 0.707, as "
                             "DeepSeek-V2-Lite's: cos and sin unscaled, the softmax scale x (0.0707 ln 4 + 1)^2); layer 0 dense, then 8 experts of 32, top-2 by sigmoid "
                             "score + the score-correction bias within the best 1 of 2 groups, renormalised, x 2.5, "
                             "plus a shared expert of 32"),
        "tiny_glm4_moe_lite": ("Glm4MoeLite", dict(MLA, q_lora_rank=None, mlp_layer_types=["dense", "sparse", "sparse"],
                                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                               "GLM-4 MoE Lite: MLA without q LoRA (q_proj), kv LoRA 32, heads of 16 nope + 8 "
                               "interleaved rope dims and values of 16; layer 0 dense (mlp_layer_types), then 8 "
                               "experts of 32, top-2 by sigmoid score + the score-correction bias, renormalised, "
                               "x 2.5, plus a shared expert of 32"),
        "tiny_gemma4": ("Gemma4", GEMMA4_SMALL,
                        "Gemma 4 (E2B-style): per-layer embeddings (8 per layer), sliding (8) and full layers, the "
                        "full ones with heads of 32 (per_layer_config) and proportional RoPE on a quarter of their "
                        "pairs; the last 2 layers reuse layers 3's and 2's K/V and run a double-wide MLP; q/k/v "
                        "norms, unscaled scores, layer_scalar, final softcap 30"),
        "tiny_gemma4_moe": ("Gemma4", dict(GEMMA4_SMALL, num_hidden_layers=4, num_key_value_heads=2,
                                           layer_types=["sliding_attention", "full_attention"] * 2,
                                           num_kv_shared_layers=0, use_double_wide_mlp=False,
                                           hidden_size_per_layer_input=0, attention_k_eq_v=True,
                                           num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                                           top_k_experts=2, moe_intermediate_size=16),
                            "Gemma 4 MoE (26B-A4B-style): in every layer the dense MLP (64) beside 4 experts of 16 "
                            "(top-2, softmax renormalised, per-expert scales; the router's own scaled norm), each "
                            "with its norms; full layers with K = V, one KV head of 32, proportional RoPE; sliding "
                            "(8) layers with two KV heads of 16; no per-layer embeddings"),
        "tiny_llama4": ("Llama4", dict(BASE, num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=128,
                                       eos_token_id=None, num_local_experts=4, num_experts_per_tok=1,
                                       interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=8,
                                       use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}),
                        "Llama 4 text: layers 0-2 RoPE (llama3 scaling, interleaved pairs) with chunked attention "
                        "(chunks of 8) and the unweighted QK-norm, layer 3 NoPE over the whole context with queries "
                        "times 1 + 0.5 ln(1 + floor((p + 1) / 4)); layers 1 and 3 MoE (4 experts of 32, top-1 by "
                        "sigmoid score scaling the expert's input, plus a shared expert of 32), 0 and 2 dense (128)"),
    }


# Text fixtures also written as their family's multimodal checkpoint (language model + vision tower).
# fixture -> (its multimodal fixture, the multimodal family, that family's tiny vision tower).
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=BASE["hidden_size"],
                   patch_size=2, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=4)
PIXTRAL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                      image_size=16, patch_size=4)
GEMMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
MULTIMODAL = {"tiny_qwen3_5": ("tiny_qwen3_5_vl", "Qwen3_5", QWEN_VISION),
              "tiny_gemma4": ("tiny_gemma4_vl", "Gemma4", GEMMA4_VISION),
              "tiny_qwen3_5_moe": ("tiny_qwen3_5_moe_vl", "Qwen3_5Moe", QWEN_VISION),
              "tiny_ministral3": ("tiny_ministral3_vl", "Mistral3", PIXTRAL_VISION)}
MOE_FIXTURES = ("tiny_qwen3_moe", "tiny_mixtral", "tiny_olmoe", "tiny_qwen2_moe")
SEED_QWEN3_MOE_GGUF = 1234 + 99  # tiny_qwen3_moe_gguf's own weights (see _make_gguf)


def _randomise(model, gemma: bool) -> None:
    """Norms (and biases) default to constants; perturb them so a loader that drops one fails."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            # (norm_f: Nemotron-H's final norm; layernorm_1 / _2: Gemma 4's MoE block's)
            if name.endswith(("norm.weight", "norm_f.weight", "layernorm_1.weight", "layernorm_2.weight")):
                # Gemma norms scale by (1 + w) and start at w = 0.
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith((".bias", ".dt_bias", ".D", "gate_up_proj_bias", "down_proj_bias")):  # (gpt-oss's experts)
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # gpt-oss: logits of the size of the scores, so that they matter
                p.copy_(torch.randn_like(p))
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's, which start at 1
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):  # start at 0: large enough to change choices
                b.copy_(0.3 * torch.randn_like(b))
            elif name.endswith("layer_scalar"):  # Gemma 4's, saved as a buffer of 1
                b.copy_(0.5 + torch.rand_like(b))


def _gguf_tensors(arch: str, sd: dict[str, np.ndarray], n_layers: int) -> dict[str, np.ndarray]:
    """HF state dict -> llama.cpp tensor names. None of these families' q/k rows are permuted
    by llama.cpp's converter (that is done for llama-type archs only); Gemma norms become 1 + w."""
    gemma = arch.startswith("gemma")
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if gemma:
        per_layer.update({"post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        per_layer["post_attention_layernorm"] = "ffn_norm"
    per_layer["mlp.gate"] = "ffn_gate_inp"  # a sparse MLP's router
    out: dict[str, np.ndarray] = {}
    for name, value in sd.items():
        parts = name.split(".")
        if parts[3:5] == ["mlp", "experts"]:  # transformers holds experts as [E, 2I, H] and [E, H, I]
            layer = int(parts[2])
            if parts[5] == "gate_up_proj":
                gate, up = np.split(value, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate, dtype=np.float32)
                out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(up, dtype=np.float32)
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = np.ascontiguousarray(value, dtype=np.float32)
            continue
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            parts = name.split(".")
            assert parts[:2] == ["model", "layers"], name
            layer, suffix = int(parts[2]), ".".join(parts[3:-1])
            gguf_name = f"blk.{layer}.{per_layer[suffix]}.{parts[-1]}"
        if gemma and gguf_name.endswith("norm.weight"):
            value = value + np.float32(1.0)
        out[gguf_name] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def _write_gguf(path: Path, arch: str, cfg, tensors: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.parent.name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma3":
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if getattr(cfg, "num_experts", 0):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_families(fixtures: Path, seed: int, prompts: list[list[int]], golden_for, sha256_file,
                  only: tuple[str, ...] = ()) -> None:
    """Every family's fixture, or those named in `only` (seeds do not depend on the selection)."""
    import torch
    import transformers

    prompts = [*prompts, LONG_PROMPT]
    for index, (fixture, (family, kwargs, description)) in enumerate(_families().items()):
        if only and fixture not in only:
            continue
        t0 = time.time()
        config_cls = getattr(transformers, f"{family}TextConfig" if family in TEXT_CONFIGS else f"{family}Config")
        model_cls = getattr(transformers, f"{family}ForCausalLM")
        torch.manual_seed(seed + 10 + index)
        cfg = config_cls(**kwargs)
        cfg._attn_implementation = "eager"  # as the reloaded model runs: the reload check compares like with like
        model = model_cls(cfg).to(torch.float32).eval()
        _randomise(model, gemma=family in ONE_PLUS_W_NORMS)
        for name, p in model.named_parameters():  # expert tensors start torch.empty until initialised
            values = p.detach()
            if not bool(torch.isfinite(values).all()) or float(values.std()) == 0.0 and values.numel() > 1:
                raise SystemExit(f"{fixture}: parameter {name} is not initialised")
        out_dir = fixtures / fixture
        _save_fresh(model, out_dir)
        reloaded = model_cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            a = model(torch.tensor([LONG_PROMPT])).logits
            b = reloaded(torch.tensor([LONG_PROMPT])).logits
        if not torch.allclose(a, b, atol=1e-5):
            raise SystemExit(f"{fixture}: reload changed the logits")
        saved = json.loads((out_dir / "config.json").read_text())
        gold = golden_for(reloaded, fixture, "float32", {
            "family": family,
            "description": description,
            "tie_word_embeddings": bool(saved.get("tie_word_embeddings")),
            "rope_scaling": saved.get("rope_parameters"),
            "model_sha256": sha256_file(out_dir / "model.safetensors"),
        }, prompts)
        (out_dir / "golden.json").write_text(json.dumps(gold, separators=(",", ":")) + "\n")
        print(f"{fixture}: {time.time() - t0:.1f}s", flush=True)

        if fixture in MULTIMODAL:
            _make_multimodal(fixtures, fixture, cfg, reloaded, prompts, golden_for, sha256_file)
        if family in CONVERTED_FAMILIES and fixture not in NOT_CONVERTED:
            if fixture in CONVERT_AS_RUN:
                as_run = model_cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                                   **CONVERT_AS_RUN[fixture](saved)).eval()
                gold = golden_for(as_run, f"{fixture}_gguf", "float32", gold["meta"], prompts)
            _convert_gguf(fixtures, fixture, gold, family in MTP_FAMILIES, CONVERT_CONFIG.get(family),
                          CONVERT_NOTES.get(fixture, " (an exact conversion)"),
                          cfg.vocab_size if family in CONVERT_VOCAB else 0)
        if family == "GptOss":  # its converted file again, the experts in MXFP4
            from mxfp4_fixture import make_mxfp4_gguf, make_mxfp4_hf

            make_mxfp4_gguf(fixtures, reloaded, prompts, golden_for, sha256_file)
            make_mxfp4_hf(fixtures, prompts, golden_for, sha256_file)  # and as gpt-oss is released
        if family in GGUF_FAMILIES:
            _make_gguf(fixtures, fixture, family, kwargs, cfg, reloaded, prompts, golden_for, sha256_file)


def _save_fresh(model, out_dir: Path) -> None:
    """`model` as the only contents of `out_dir` (safetensors, config.json; no generation_config.json:
    tests feed ids and drive decoding themselves)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").unlink(missing_ok=True)


def _make_multimodal(fixtures: Path, fixture: str, text_cfg, text_model, prompts: list[list[int]],
                     golden_for, sha256_file) -> None:
    """The text fixture's weights as the language model of the family's multimodal checkpoint (a tiny
    vision tower beside it, the language model under model.language_model. as users download them);
    the golden is that checkpoint's own forward on text."""
    import torch
    import transformers

    t0 = time.time()
    name, family, vision = MULTIMODAL[fixture]
    out_dir = fixtures / name
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForConditionalGeneration")
    torch.manual_seed(4321)
    cfg = config_cls(text_config=text_cfg.to_dict(), vision_config=vision, tie_word_embeddings=text_cfg.tie_word_embeddings)
    model = model_cls(cfg).to(torch.float32).eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    _save_fresh(model, out_dir)
    reloaded = model_cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        a = text_model(torch.tensor([LONG_PROMPT])).logits
        b = reloaded(torch.tensor([LONG_PROMPT])).logits
    if not torch.allclose(a, b, atol=1e-5):
        raise SystemExit(f"{out_dir.name}: the multimodal checkpoint's text logits differ from {fixture}'s")
    gold = golden_for(reloaded, out_dir.name, "float32", {
        "family": f"{family}ForConditionalGeneration",
        "description": f"{fixture}'s weights as the language model of a {family}ForConditionalGeneration "
                       "checkpoint with a one-block vision tower; golden = that model's forward on text",
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "rope_scaling": text_cfg.rope_parameters,
        "model_sha256": sha256_file(out_dir / "model.safetensors"),
    }, prompts)
    (out_dir / "golden.json").write_text(json.dumps(gold, separators=(",", ":")) + "\n")
    print(f"{out_dir.name}: {time.time() - t0:.1f}s", flush=True)


def _make_gguf(fixtures: Path, fixture: str, family: str, kwargs: dict[str, Any], cfg, model,
               prompts: list[list[int]], golden_for, sha256_file) -> None:
    """The same family as a GGUF; the golden is transformers' forward of the GGUF file."""
    import torch
    import transformers

    t0 = time.time()
    arch = family.lower()
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    overrides: dict[str, Any] = {}
    if family == "Gemma3":
        # transformers' GGUF reader cannot express rope scaling for gemma3, so this file's
        # model has none (a fresh model with plain rope on both layer types, same weights).
        cfg = transformers.Gemma3TextConfig(**dict(GEMMA3_SMALL, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}))
    elif family == "Gemma2":
        # llama.cpp scales queries by 1/sqrt(head_dim) (the 27B aside): this file's model
        # has query_pre_attn_scalar = head_dim, the rest (softcaps included) as before.
        cfg = transformers.Gemma2Config(**dict(kwargs, query_pre_attn_scalar=kwargs["head_dim"]))
        overrides["attn_logit_softcapping"] = cfg.attn_logit_softcapping
        overrides["final_logit_softcapping"] = cfg.final_logit_softcapping
    elif family == "Qwen3":
        # transformers' qwen3 GGUF mapping does not read attention.key_length.
        overrides["head_dim"] = cfg.head_dim
    elif family == "Qwen3Moe":
        # A GGUF cannot say mlp_only_layers (llama.cpp makes every layer sparse), so this file
        # is its own model: every layer sparse, fresh weights of the same seed. transformers'
        # qwen3_moe GGUF mapping does not read expert_feed_forward_length.
        torch.manual_seed(SEED_QWEN3_MOE_GGUF)
        cfg = transformers.Qwen3MoeConfig(**dict(kwargs, mlp_only_layers=[]))
        model = model_cls(cfg).to(torch.float32).eval()
        _randomise(model, gemma=False)
        overrides["moe_intermediate_size"] = cfg.moe_intermediate_size
    if family.startswith("Gemma"):
        same_weights = model_cls(cfg).eval()
        same_weights.load_state_dict(model.state_dict())
        model = same_weights
        # transformers' GGUF reader leaves query_pre_attn_scalar at its default (256).
        overrides["query_pre_attn_scalar"] = cfg.head_dim
    out_dir = fixtures / f"{fixture}_gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    gguf_path = out_dir / "model.gguf"
    _write_gguf(gguf_path, arch, cfg, _gguf_tensors(arch, sd, cfg.num_hidden_layers))
    loaded = model_cls.from_pretrained(out_dir, gguf_file="model.gguf", dtype=torch.float32,
                                       attn_implementation="eager", **overrides).eval()
    with torch.no_grad():
        a = model(torch.tensor([LONG_PROMPT])).logits
        b = loaded(torch.tensor([LONG_PROMPT])).logits
    if not torch.allclose(a, b, atol=1e-4):
        raise SystemExit(f"{fixture}_gguf: transformers reads the GGUF differently: "
                         f"max diff {float((a - b).abs().max())}")
    gold = golden_for(loaded, f"{fixture}_gguf", "float32", {
        "family": family,
        "model_file": "model.gguf",
        "description": f"{fixture}{' with every layer sparse' if family == 'Qwen3Moe' else ''} written as GGUF "
                       "(llama.cpp names and row order); golden = "
                       f"transformers from_pretrained(gguf_file=..., {overrides})",
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "rope_scaling": None,
        "model_sha256": sha256_file(gguf_path),
    }, prompts)
    (out_dir / "golden.json").write_text(json.dumps(gold, separators=(",", ":")) + "\n")
    print(f"{fixture}_gguf: {time.time() - t0:.1f}s", flush=True)


def _llamacpp_dir() -> Path:
    """vendor/llama.cpp of an unpacked llama-cpp-python source package (`pip download --no-deps
    --no-binary :all: llama-cpp-python`, unpacked under build/llamacpp/), or $VKRT_LLAMACPP."""
    import os

    named = os.environ.get("VKRT_LLAMACPP")
    candidates = [Path(named)] if named else sorted(LLAMACPP_DEFAULT.glob("llama_cpp_python-*/vendor/llama.cpp"))
    for path in candidates:
        if (path / "convert_hf_to_gguf.py").is_file():
            return path
    raise SystemExit("llama.cpp's converter not found: pip download --no-deps --no-binary :all: llama-cpp-python "
                     f"-d {LLAMACPP_DEFAULT}, unpack it there, or set VKRT_LLAMACPP to its vendor/llama.cpp")


# Runs convert_hf_to_gguf.main with the vocabulary step skipped: the tiny fixtures carry no
# tokenizer (vkrt takes the vocabulary size from the embedding); tensors and metadata are the
# converter's own.
_CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
from conversion.base import TextModel
TextModel.set_vocab = lambda self: None
import convert_hf_to_gguf
model_class = convert_hf_to_gguf.get_model_class
def no_vocab(name, mmproj=False):  # families with their own set_vocab (Mamba2's, Nemotron-H's) skip it too,
    cls = model_class(name, mmproj)  # and those a wrapper delegates to (Mistral3's Ministral3Model)
    for outer in [cls, *(v for v in vars(cls).values() if isinstance(v, type) and issubclass(v, TextModel))]:
        for c in outer.__mro__[:outer.__mro__.index(TextModel)]:
            if "set_vocab" in vars(c):
                c.set_vocab = lambda self: None
    return cls
convert_hf_to_gguf.get_model_class = no_vocab
from conversion.base import ModelBase
load_hparams = ModelBase.load_hparams
def hparams(*args, **kwargs):  # Nemotron-H as NVIDIA's configs have it, not as transformers 5 loads it:
    h = load_hparams(*args, **kwargs)  # no num_experts_per_tok when dense (it means MoE to the converter),
    kinds = h.get("layers_block_type") or []  # the layers as a pattern string (its list form misses "mlp")
    if "NemotronHForCausalLM" in (h.get("architectures") or []) and "moe" not in kinds:
        h.pop("num_experts_per_tok", None)
        h["hybrid_override_pattern"] = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[k]
                                               for k in kinds)
    return h
ModelBase.load_hparams = staticmethod(hparams)
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def _convert_gguf(fixtures: Path, fixture: str, hf_golden: dict, no_mtp: bool, edit: Any = None,
                  note: str = "", vocab: int = 0) -> None:
    """The HF fixture through llama.cpp's converter as f32 `model.gguf`. The conversion is exact
    (f32 in, f32 out; the q/k rows it permutes for llama-type families the loader puts back) but
    for what `note` says, so the golden is the HF one (`hf_golden`)."""
    import shutil
    import subprocess
    import sys

    t0 = time.time()
    llamacpp = _llamacpp_dir()
    out_dir = fixtures / f"{fixture}_gguf"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    gguf_path = out_dir / "model.gguf"
    source = fixtures / fixture
    if edit is not None or vocab:  # a copy with what the converter expects (CONVERT_CONFIG, CONVERT_VOCAB)
        import tempfile
        source = Path(tempfile.mkdtemp()) / fixture
        shutil.copytree(fixtures / fixture, source)
        if edit is not None:
            (source / "config.json").write_text(json.dumps(edit(json.loads((source / "config.json").read_text()))))
        if vocab:
            words = {"model": {"vocab": {f"t{i}": i for i in range(vocab)}}, "added_tokens": []}
            (source / "tokenizer.json").write_text(json.dumps(words))
    subprocess.run([sys.executable, "-c", _CONVERT, str(llamacpp), str(source), "--outfile",
                    str(gguf_path), "--outtype", "f32", *(["--no-mtp"] if no_mtp else [])], check=True, capture_output=True)
    gold = json.loads(json.dumps(hf_golden))
    gold["meta"] |= {"model_file": "model.gguf", "model_sha256": _sha256(gguf_path),
                     "description": f"{fixture} through llama.cpp's convert_hf_to_gguf.py (f32, vocabulary "
                                    f"step skipped); golden = the HF fixture's{note}"}
    (out_dir / "golden.json").write_text(json.dumps(gold, separators=(",", ":")) + "\n")
    print(f"{fixture}_gguf: {time.time() - t0:.1f}s", flush=True)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
