"""What an architecture family is to the loaders: `ArchSpec` (its checkpoint names and traits), the
canonical per-layer weight names, Llama's checkpoint names that the families' tables start from, and
`canonical_name`, which maps a checkpoint's tensor name through one family's tables.

The families' rows are in vkrt/loader/arch.py; the shapes their weights must have, in
vkrt/loader/weight_shapes.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vkrt.errors import UnsupportedModelError

# Canonical per-layer weights, in the order a block uses them. A family has a subset:
# q/k/v or the fused qkv_proj, gate/up or the fused gate_up_proj; the rest are traits.
LAYER_WEIGHTS = (
    "attn_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "ffn_norm",
    "gate_proj",
    "up_proj",
    "down_proj",
)


# The MTP head's own tensors -> canonical names (None: a copy of the target's embedding, not kept):
# the Qwen3.5 / Qwen3-Next head's after its "mtp." prefix; a DeepSeek-V3 / GLM-4.5 MTP layer's after
# "model.layers.<i>."; and llama.cpp's nextn tensors of either after "blk.<i>.".
MTP_HEAD_HF = {"fc.weight": "mtp.fc", "pre_fc_norm_embedding.weight": "mtp.norm_embedding",
               "pre_fc_norm_hidden.weight": "mtp.norm_hidden", "norm.weight": "final_norm"}
MTP_LAYER_HF: dict[str, str | None] = {
    "eh_proj.weight": "mtp.fc", "enorm.weight": "mtp.norm_embedding", "hnorm.weight": "mtp.norm_hidden",
    "shared_head.norm.weight": "final_norm", "shared_head.head.weight": "mtp.lm_head", "embed_tokens.weight": None}
MTP_LAYER_GGUF: dict[str, str | None] = {
    "nextn.eh_proj.weight": "mtp.fc", "nextn.enorm.weight": "mtp.norm_embedding",
    "nextn.hnorm.weight": "mtp.norm_hidden", "nextn.shared_head_norm.weight": "final_norm",
    "nextn.shared_head_head.weight": "mtp.lm_head", "nextn.embed_tokens.weight": None}


def mtp_tensor_name(where: object, spec: ArchSpec, tensor: str, rest: str, own: Mapping[str, str | None],
                    layer_name: str | None, mtp_layers: int) -> str | None:
    """The canonical name of one tensor of a checkpoint's MTP head: `own[rest]` for the head's own
    tensors (None: not kept), else `layer_name`, its decoder layer's (computed by the loader).
    UnsupportedModelError names `tensor` in `where` when it is neither, or the family runs one
    layer per head (DeepSeek's form) and the file has more."""
    if spec.mtp_form == "deepseek_v3" and mtp_layers > 1:
        raise UnsupportedModelError(f"{where}: {mtp_layers} multi-token-prediction layers; vkrt loads a model "
                                    "with one (each further one is a head of its own)")
    if rest in own:
        return own[rest]
    if layer_name is None:
        raise UnsupportedModelError(f"{where}: tensor {tensor!r} is not part of the multi-token-prediction head "
                                    f"vkrt implements for {spec.name}")
    return layer_name


def canonical_name(name: str, global_names: dict[str, str], layer_pattern: re.Pattern[str],
                   layer_names: dict[str, str]) -> str | None:
    """A checkpoint tensor name -> vkrt's canonical name ("layers.{i}.<name>" for per-layer
    tensors, whose layer index and suffix `layer_pattern` captures), or None if unknown."""
    if name in global_names:
        return global_names[name]
    m = layer_pattern.match(name)
    if not m:
        return None
    if m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    # One expert of a sparse MLP saved on its own: "...experts.{e}..." in the table.
    e = _EXPERT_INDEX.search(m.group(2))
    if e and str(int(e.group(1))) == e.group(1):
        canonical = layer_names.get(f"{m.group(2)[:e.start(1)]}{{e}}{m.group(2)[e.end(1):]}")
        if canonical is not None:
            return f"layers.{m.group(1)}.{canonical.format(e=e.group(1))}"
    return None


_EXPERT_INDEX = re.compile(r"experts\.(\d+)\.")


GGUF_GLOBAL = {
    "token_embd.weight": "embed_tokens",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
GGUF_LAYER = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
HF_GLOBAL = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
HF_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_ROTARY = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a cached table, recomputed from the config


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture family is named in GGUF and HF checkpoints, and what it computes."""

    name: str  # ModelConfig.architecture
    gguf_archs: tuple[str, ...]  # values of GGUF `general.architecture`
    hf_archs: tuple[str, ...]  # entries of config.json `architectures`
    # Tensor names: GGUF global names and per-layer suffixes (after "blk.{i}."), HF's (after
    # "model.layers.{i}."), each -> vkrt's canonical name. Llama's unless a row says otherwise.
    gguf_global: dict[str, str] = field(default_factory=lambda: dict(GGUF_GLOBAL))
    gguf_layer: dict[str, str] = field(default_factory=lambda: dict(GGUF_LAYER))
    hf_global: dict[str, str] = field(default_factory=lambda: dict(HF_GLOBAL))
    hf_layer: dict[str, str] = field(default_factory=lambda: dict(HF_LAYER))
    layer_weights: tuple[str, ...] = LAYER_WEIGHTS  # required per layer
    # llama.cpp's converter interleaves the RoPE halves of q/k rows for this family.
    gguf_qk_permuted: bool = False
    # A GGUF of one of gguf_archs is this family only when it has experts (`<arch>.expert_count`):
    # llama.cpp writes Mixtral as "llama", as it runs it.
    gguf_with_experts: bool = False
    # `<arch>.<suffix>` keys llama.cpp refuses a file of this family without (Granite: logit_scale).
    gguf_required: tuple[str, ...] = ()
    # llama.cpp leaves every n-th layer unrotated (NoPE) in this family, a rule it does not write
    # into the file (SmolLM3: 4); 0: every layer rotates.
    gguf_nope_every: int = 0
    # Tensors present in some checkpoints that carry no information vkrt needs.
    hf_ignored: re.Pattern[str] = _ROTARY
    # -- family traits (ModelConfig fields of the same names) --
    activation: str = "silu"  # MLP gate when config.json names none (GGUF never does)
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    hf_norm_offset: float = 0.0  # HF checkpoints store norm weights as w of (1 + w)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden)
    # Which layers are sliding when config.json has no `layer_types` (None: none are).
    default_sliding: Callable[[int, dict[str, Any]], bool] | None = None
    # Local layers' rope base when the file names none (Gemma 3: 10000), which also keeps the
    # file's rope scaling to the global layers; 0 = local layers rope as global ones do.
    local_rope_theta: float = 0.0
    # The file's one rope scaling is the full-attention layers'; sliding ones rotate unscaled at the
    # same base unless the file names theirs (OLMo 3, as transformers and llama.cpp read it).
    sliding_rope_unscaled: bool = False
    # llama.cpp scales Gemma queries by 1/sqrt(hidden/heads) for the 27B models (this many
    # layers) and by 1/sqrt(head_dim) otherwise; GGUF files carry no query_pre_attn_scalar.
    gguf_wide_query_layers: int = 0
    # QK-norm over each head (Qwen3, Gemma 3) or over all of q and all of k (OLMoE).
    qk_norm_per_head: bool = True
    # The QK-norm is config.json's `use_qk_norm` (default on) and, in a GGUF, there when its tensors
    # are, as llama.cpp's optional ones (GLM-4.5; GLM-4.5-Air has none).
    qk_norm_optional: bool = False
    # RoPE rotates pairs (2i, 2i + 1) instead of the halves (i, i + d/2) (ERNIE 4.5).
    rope_interleaved: bool = False
    # Recurrent mixers some of the family's layers use instead of attention: config.json's
    # layer type -> LayerConfig.mixer ("conv" -> "short_conv" for LFM2).
    mixer_types: dict[str, str] = field(default_factory=dict)
    # Every layer's mixer when the file lists no layer types (Falcon-H1: "attention_mamba2").
    default_mixer: str = "attention"
    # config.json's muP multipliers (Falcon-H1's) are read into ModelConfig.multipliers.
    hf_multipliers: bool = False
    # The attention's q_proj also gives a gate per head: output * sigmoid(gate) (Qwen3.5).
    attn_output_gate: bool = False
    # The file's per-layer head dims, KV heads, FFN widths, shared K/V, per-layer embeddings and
    # proportional RoPE are read as config.json spells them (Gemma 4: vkrt/loader/gguf_fields.py).
    gguf_per_layer_shapes: bool = False
    v_norm: bool = False  # each value head is RMS-normed without a weight before it is cached (Gemma 4)
    # llama.cpp's converter reorders this family's delta-net value heads tiled over key heads (Qwen3.5).
    gguf_v_heads_tiled: bool = False
    # Mixture of experts: whether the k router weights are renormalised when the file does
    # not say (config.json's norm_topk_prob; GGUF never does: llama.cpp's per-arch choice).
    norm_topk_prob: bool = False
    # A shared expert beside the routed ones (Qwen2-MoE): its width is read from the file; gated by
    # sigmoid(x @ shared_expert_gate) (Qwen2-MoE), or not (Granite 4: the layer's own MLP).
    shared_expert: bool = False
    shared_expert_gated: bool = True
    moe_flag: str = ""  # a config.json flag without which the expert fields are ignored (Gemma 4's enable_moe_block)
    moe_beside_mlp: bool = False  # ModelConfig.moe_beside_mlp
    moe_router: str = "softmax"  # ModelConfig.moe_router: how the router's logits pick experts
    router_norm_eps: float = 1e-6  # ModelConfig.router_norm_eps (the sigmoid router's)
    # A bias on the router and on every expert's projections (gpt-oss).
    expert_biases: bool = False
    clamped_swiglu: bool = False  # the experts' activation is gpt-oss's (ModelConfig.swiglu_limit)
    # rope_scaling settings a GGUF cannot say, as the family's own configs have them (gpt-oss's
    # YaRN ramp is not truncated; llama.cpp always truncates it, transformers follows the config).
    gguf_rope_scaling: dict[str, Any] = field(default_factory=dict)
    # HF's expert stacks are [E, in, out] with gate and up columns interleaved (gpt-oss): the
    # loader turns them into llama.cpp's gate, up and down stacks.
    hf_interleaved_experts: bool = False
    # HF's expert stacks are [E, in, out] with the gate columns, then the up columns (Llama 4).
    hf_stacked_experts: bool = False
    # Llama 4's layer traits (vkrt/loader/llama4.py): chunked attention on RoPE layers, NoPE ones
    # with the query temperature, input-scaled experts every interleave_moe_layer_step-th layer.
    chunked_attention: bool = False
    # -- config.json in this family's own words --
    hf_prefix: str = "model"  # per-layer tensors are "<hf_prefix>.layers.{i}.<suffix>"
    hf_renames: dict[str, str] = field(default_factory=dict)  # its field -> the name normalize reads
    # The characters of a layer-pattern string (Nemotron-H's hybrid_override_pattern) -> layer types.
    hf_pattern: dict[str, str] = field(default_factory=dict)
    hf_defaults: dict[str, Any] = field(default_factory=dict)  # fields the family implies when absent
    # Each block is one norm, one sublayer (a mixer, or the MLP: layer type "mlp") and a residual,
    # not a mixer and an MLP (Nemotron-H); the block's norm is "norm".
    one_sublayer: bool = False
    # config.json flags that, when true, add weights vkrt does not run (Seed-OSS's o_proj and MLP
    # biases): such a model is refused with one line naming the flag.
    hf_refused_flags: tuple[str, ...] = ()
    # Full-attention layers do not rotate positions when the file sets a sliding window (EXAONE 4).
    global_nope_with_window: bool = False
    # OLMo 2's order in attention layers: no norm before attention or MLP, one after each (the
    # file's post-attention norm, canonical ffn_norm, normalises the attention's output there).
    attention_post_norms: bool = False
    # No RoPE when config.json has no rope_parameters (OLMo-hybrid's NoPE checkpoints).
    nope_without_rope_parameters: bool = False
    linear_norm_eps: float = 0.0  # the delta net's gated output norm's eps (0: rms_norm_eps)
    # Multimodal checkpoints whose language model is this family (config.json's text_config, tensors
    # under "model.language_model."); the other towers are skipped with one log line each.
    hf_multimodal_archs: tuple[str, ...] = ()
    # Tensors a checkpoint carries that vkrt does not run, by name prefix -> what they are (logged).
    hf_skipped: dict[str, str] = field(default_factory=dict)
    # Multi-token-prediction layers saved after the main ones, as many as this config.json field says
    # (GGUF: `<arch>.nextn_predict_layers`, counted in block_count): the MTP head's, kept apart
    # (LoadedModel.mtp_weights), never among the main layers.
    mtp_layers: str = ""
    # The multi-token-prediction head a checkpoint carries under this prefix (Qwen3.5 / Qwen3-Next:
    # "mtp."): fc, its two input norms, a final norm, and decoder layers named as the main ones.
    # Kept apart (LoadedModel.mtp_weights) for `{"method": "mtp"}` speculation (vkrt/models/mtp.py).
    hf_mtp_prefix: str = ""
    # How the family's MTP head runs (vkrt/models/mtp.py, as vLLM runs it): "qwen3_next" (the
    # head under hf_mtp_prefix; a further guess continues from its final-norm output) or
    # "deepseek_v3" (the `mtp_layers` after the main ones, each with its own eh_proj, enorm, hnorm
    # and shared head; position 0's embedding is zeroed; a further guess continues from the
    # layer's output before the norm). "": the family has no head vkrt runs.
    mtp_form: str = ""
