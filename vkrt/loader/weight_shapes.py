"""The shapes a model's canonical weights must have, from its config: `check_weights` refuses a
checkpoint whose tensors are missing or disagree with the config, naming the weight."""

from __future__ import annotations

import math

from vkrt.errors import ModelFormatError
from vkrt.loader.arch import arch_named
from vkrt.loader.config import ModelConfig, WeightData
from vkrt.loader.mla import mla_weight_shapes

# The attention's own weights, which a layer without attention does not have; a recurrent
# layer has its mixer's (MIXER_WEIGHTS, by LayerConfig.recurrent).
_ATTENTION_ONLY = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_bias", "k_bias", "v_bias", "o_bias", "sinks",
                   "q_norm", "k_norm")
MIXER_WEIGHTS = {"short_conv": ("conv.in_proj", "conv.weight", "conv.out_proj"),
                 "gated_delta_net": ("delta.in_proj_qkv", "delta.in_proj_z", "delta.in_proj_b", "delta.in_proj_a",
                                     "delta.conv.weight", "delta.A_log", "delta.dt_bias", "delta.norm",
                                     "delta.out_proj"),
                 "mamba2": ("mamba.in_proj", "mamba.conv.weight", "mamba.A_log", "mamba.D", "mamba.dt_bias",
                            "mamba.norm", "mamba.out_proj")}
# A dense layer's MLP; a MoE layer has the router and experts instead (check_weights).
DENSE_MLP_WEIGHTS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def check_weights(source: str, config: ModelConfig, weights: dict[str, WeightData]) -> None:
    """Raise ModelFormatError unless every canonical weight is present with its logical shape."""
    hidden = config.hidden_size
    v_heads, key_dim = config.linear_num_value_heads, config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = v_heads * config.linear_value_head_dim
    mamba_inner = config.mamba_num_heads * config.mamba_head_dim
    mamba_bc = config.mamba_n_groups * config.mamba_state_size  # B's (and C's) channels
    expected: dict[str, tuple[int, ...]] = {
        "embed_tokens": (config.vocab_size, hidden),
        "final_norm": (hidden,),
    }
    if not config.tie_word_embeddings:
        expected["lm_head"] = (config.num_labels or config.vocab_size, hidden)
    shapes: dict[str, tuple[int, ...]] = {
        "norm": (hidden,),
        "attn_norm": (hidden,),
        "o_bias": (hidden,),
        "sinks": (config.num_heads,),
        "post_attn_norm": (hidden,),
        "ffn_norm": (hidden,),
        "post_ffn_norm": (hidden,),
        "conv.in_proj": (3 * hidden, hidden),
        "conv.weight": (hidden, config.conv_kernel),
        "conv.bias": (hidden,),
        "conv.out_proj": (hidden, hidden),
        "delta.in_proj_qkv": (2 * key_dim + value_dim, hidden),
        "delta.in_proj_z": (value_dim, hidden),
        "delta.in_proj_b": (v_heads, hidden),
        "delta.in_proj_a": (v_heads, hidden),
        "delta.in_proj_qkvz": (2 * key_dim + 2 * value_dim, hidden),
        "delta.in_proj_q": (key_dim, hidden),
        "delta.in_proj_k": (key_dim, hidden),
        "delta.in_proj_v": (value_dim, hidden),
        "delta.conv_q": (key_dim, config.conv_kernel),
        "delta.conv_k": (key_dim, config.conv_kernel),
        "delta.conv_v": (value_dim, config.conv_kernel),
        "delta.in_proj_ba": (2 * v_heads, hidden),
        "delta.conv.weight": (2 * key_dim + value_dim, config.conv_kernel),
        "delta.A_log": (v_heads,),
        "delta.A": (v_heads,),
        "delta.dt_bias": (v_heads,),
        "delta.norm": (config.linear_value_head_dim,),
        "delta.out_proj": (hidden, value_dim),
        "mamba.in_proj": (2 * mamba_inner + 2 * mamba_bc + config.mamba_num_heads, hidden),
        "mamba.conv.weight": (mamba_inner + 2 * mamba_bc, config.conv_kernel),
        "mamba.conv.bias": (mamba_inner + 2 * mamba_bc,),
        "mamba.A_log": (config.mamba_num_heads,),
        "mamba.A": (config.mamba_num_heads,),
        "mamba.D": (config.mamba_num_heads,),
        "mamba.dt_bias": (config.mamba_num_heads,),
        "mamba.norm": (mamba_inner,),
        "mamba.out_proj": (hidden, mamba_inner),
    }
    if config.per_layer_input_size:  # Gemma 4's per-layer embeddings
        width = config.num_layers * config.per_layer_input_size
        expected |= {"per_layer.embed": (config.per_layer_vocab_size, width), "per_layer.model_proj": (width, hidden),
                     "per_layer.model_norm": (config.per_layer_input_size,)}
    for i in range(config.num_layers):
        layer = config.layer(i)
        names = list(arch_named(config.architecture).layer_weights)
        shapes |= _layer_shapes(config, i)
        if config.kv_layer_of(i) != i:  # it attends over an earlier layer's K/V and computes none
            names = [n for n in names if n not in ("k_proj", "v_proj", "k_norm", "k_bias", "v_bias")]
        elif layer.k_eq_v:  # its values are its keys' projection
            names = [n for n in names if n not in ("v_proj", "v_bias")]
        if config.per_layer_input_size:
            names += ["per_layer.gate", "per_layer.proj", "per_layer.norm"]
        if not layer.attends:
            names = [n for n in names if n not in _ATTENTION_ONLY]
        if not config.qk_norm:  # (a family whose QK-norm is optional: ArchSpec.qk_norm_optional)
            names = [n for n in names if n not in ("q_norm", "k_norm")]
        if layer.recurrent:
            names += MIXER_WEIGHTS[layer.recurrent]
            if config.mamba_norm == "none":  # Mamba2 without its gated norm (Falcon-H1's option)
                names = [n for n in names if n != "mamba.norm"]
            if config.conv_bias and layer.recurrent in ("mamba2", "short_conv"):
                names.append("mamba.conv.bias" if layer.recurrent == "mamba2" else "conv.bias")
            if config.linear_decay_stored:  # llama.cpp's A = -exp(A_log)
                names = [{"delta.A_log": "delta.A", "mamba.A_log": "mamba.A"}.get(n, n) for n in names]
            for fused, apart in (("delta.in_proj_qkvz", ("delta.in_proj_qkv", "delta.in_proj_z")),
                                 ("delta.in_proj_ba", ("delta.in_proj_b", "delta.in_proj_a"))):
                if f"layers.{i}.{fused}" in weights:  # Qwen3-Next's projections, interleaved per key head
                    names = [n for n in names if n not in apart] + [fused]
            if f"layers.{i}.delta.in_proj_q" in weights:  # OLMo-hybrid's: q, k, v apart, each convolved apart
                merged = f"layers.{i}.delta.conv.weight" in weights  # (as transformers holds it in memory)
                names = [n for n in names if n not in ("delta.in_proj_qkv", "delta.conv.weight")]
                names += ["delta.in_proj_q", "delta.in_proj_k", "delta.in_proj_v"]
                names += ["delta.conv.weight"] if merged else ["delta.conv_q", "delta.conv_k", "delta.conv_v"]
        if "gate_up_proj" in names and f"layers.{i}.gate_proj" in weights:  # stored apart (GGUF)
            names = [n for n in names if n != "gate_up_proj"] + ["gate_proj", "up_proj"]
        if layer.post_norms:  # OLMo 2's attention layers: ffn_norm is the attention's output norm here
            names = [n for n in names if n != "attn_norm"] + ["post_ffn_norm"]
        if not layer.mlp:  # a block of one mixer (Nemotron-H)
            names = [n for n in names if n not in DENSE_MLP_WEIGHTS and n != "ffn_norm"]
        for name in names:
            if not (layer.moe and name in DENSE_MLP_WEIGHTS and not config.moe_beside_mlp):
                expected[f"layers.{i}.{name}"] = shapes[name]
        if layer.mixer == "mla":
            expected.update(mla_weight_shapes(config, f"layers.{i}.", weights))
        if layer.moe:
            expected.update(_expert_shapes(source, config, i, weights))
    for name, shape in expected.items():
        weight = weights.get(name)
        if weight is None:
            raise ModelFormatError(
                f"{source}: weight {name!r} is missing; the file is incomplete or not a "
                f"{config.architecture} checkpoint"
            )
        vector = len(shape) == 1 and math.prod(weight.shape) == shape[0]
        if weight.shape != shape and not vector and not (
                "conv" in name and weight.shape == (shape[0], 1, *shape[1:])):
            # (HF keeps a depthwise conv's weight as [C, 1, K], llama.cpp as [C, K]; llama.cpp writes
            # some vectors with unit dims or as rows of groups: Mamba2's A, D [H, 1] and norm [G, inner / G])
            raise ModelFormatError(
                f"{source}: weight {name!r} has shape {weight.shape}, but the config implies "
                f"{shape}; the checkpoint and its config disagree"
            )


def _layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The shapes of layer i's weights that follow its own head dim, KV heads and MLP width
    (Gemma 4's differ between layers; every other family's are the model's); q_proj holds a gate
    per head beside q with an output gate (Qwen3.5)."""
    hidden, head_dim, inter = config.hidden_size, config.head_dim_of(i), config.ffn_width_of(i)
    q_rows, kv_rows = config.num_heads * head_dim, config.kv_heads_of(i) * head_dim
    out: dict[str, tuple[int, ...]] = {
        "q_proj": (2 * q_rows if config.attn_output_gate else q_rows, hidden), "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden), "qkv_proj": (q_rows + 2 * kv_rows, hidden), "q_bias": (q_rows,),
        "k_bias": (kv_rows,), "v_bias": (kv_rows,), "o_proj": (hidden, q_rows),
        "q_norm": (head_dim,) if config.qk_norm_per_head else (q_rows,),
        "k_norm": (head_dim,) if config.qk_norm_per_head else (kv_rows,),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter), "layer_scalar": (1,)}
    if config.per_layer_input_size:
        width = config.per_layer_input_size
        out |= {"per_layer.gate": (width, hidden), "per_layer.proj": (hidden, width), "per_layer.norm": (hidden,)}
    return out


def _expert_shapes(source: str, config: ModelConfig, i: int, weights: dict[str, WeightData]
                   ) -> dict[str, tuple[int, ...]]:
    """Layer i's router and experts: stacked [E, out, in] tensors (GGUF) or one tensor per
    expert (HF); an expert beyond num_experts is an error naming it."""
    experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    p = f"layers.{i}."
    out: dict[str, tuple[int, ...]] = {p + "router": (experts, hidden)}
    if config.expert_bias:
        out[p + "expert_bias"] = (experts,)
    shared = config.shared_expert_intermediate_size
    ungated = config.hidden_act == "relu2"  # Nemotron-H's experts and shared expert: up and down only
    if shared and ungated:
        out |= {p + "shared_expert.up_proj": (shared, hidden), p + "shared_expert.down_proj": (hidden, shared)}
    elif shared and config.shared_expert_gated:
        out |= {p + "shared_expert.gate_proj": (shared, hidden), p + "shared_expert.up_proj": (shared, hidden),
                p + "shared_expert.down_proj": (hidden, shared), p + "shared_expert_gate": (1, hidden)}
    elif shared and p + "shared_expert.gate_proj" in weights:  # Granite 4's ungated shared MLP, from GGUF
        out |= {p + "shared_expert.gate_proj": (shared, hidden), p + "shared_expert.up_proj": (shared, hidden),
                p + "shared_expert.down_proj": (hidden, shared)}
    elif shared:  # Granite 4: the layer's own MLP (gate|up fused) runs beside the experts, ungated
        out |= {p + "gate_up_proj": (2 * shared, hidden), p + "down_proj": (hidden, shared)}
    if arch_named(config.architecture).expert_biases:
        out |= {p + "router_bias": (experts,), p + "experts.gate_bias": (experts, inter),
                p + "experts.up_bias": (experts, inter), p + "experts.down_bias": (experts, hidden)}
    proj = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    if ungated:
        del proj["gate_proj"]
    if config.moe_beside_mlp:  # Gemma 4: the router's own scales, the experts' norms beside the dense MLP's
        out |= {p + "router.scale": (hidden,), p + "router.expert_scale": (experts,), p + "ffn_norm_2": (hidden,),
                p + "post_ffn_norm_1": (hidden,), p + "post_ffn_norm_2": (hidden,)}
    if p + "experts.gate_up_proj" in weights:  # Granite 4: gate|up stacked per expert [E, 2F, H]
        return out | {p + "experts.gate_up_proj": (experts, 2 * inter, hidden), p + "experts.down_proj": (experts, hidden, inter)}
    if p + "experts.down_proj" in weights:  # stacked (GGUF)
        return out | {f"{p}experts.{n}": (experts, *shape) for n, shape in proj.items()}
    prefix = p + "experts."
    for name in weights:
        index = name[len(prefix):].split(".")[0] if name.startswith(prefix) else ""
        if index.isdigit() and int(index) >= experts:
            raise ModelFormatError(f"{source}: weight {name!r} is an expert beyond the config's "
                                   f"{experts} experts; the checkpoint and its config disagree")
    return out | {f"{prefix}{e}.{n}": shape for e in range(experts) for n, shape in proj.items()}
