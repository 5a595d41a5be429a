"""The decoder-only transformer every supported family is a configuration of.

embedding (x scale) -> N x [norm, token mixer: attention (+bias, QK-norm, RoPE, window,
softcap, output gate) or a recurrent mixer (LFM2's gated short convolution, the gated delta
net of Qwen3.5 / Qwen3-Next, Mamba2; its state in a slot per sequence) or attention and Mamba2
summed, (post-norm), residual (x scale), norm, gated MLP (or relu2's ungated one) or mixture of
experts, (post-norm), residual (x scale)] -> final norm -> LM head (x scale, softcap). Llama,
Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM3, Granite, ERNIE 4.5, LFM2, Qwen3.5, Qwen3-Next,
Granite 4, Nemotron-H (a block is only its mixer or only its MLP), Falcon-H1, OLMo 2 / 3, EXAONE 4,
Seed-OSS, Ministral 3, Qwen3-MoE, Mixtral, OLMoE, GLM-4.5, gpt-oss (attention sinks, biased experts,
the clamped SwiGLU), DeepSeek-V3 and GLM-4 MoE Lite (multi-head latent attention), Llama 4 (chunked
attention, input-scaled experts) and Gemma 4 (per-layer embeddings, per-layer head shapes, K/V
shared across layers, the dense MLP beside the experts) differ only in ModelConfig
(vkrt/loader/normalize.py builds it): the traits are read from there, never from a family name.
Written in primitive ops; vkrt.ops.fusion folds them into fused kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.tensor import Tensor
from vkrt.errors import VkrtError
from vkrt.loader.config import LoadedModel, ModelConfig, WeightData
from vkrt.models.base import CausalLM, KVCache, Stage, StepTensors
from vkrt.models.rope import query_temperature_table, rope_table
from vkrt.models.weights import (
    Attention,
    AttentionMamba2,
    Experts,
    GatedDeltaNet,
    LatentAttention,
    Layer,
    Linear,
    Mamba2,
    Mlp,
    MlpAndExperts,
    PerLayerEmbedding,
    PerLayerInput,
    ShortConv,
    Weights,
    build_weights,
)

# ModelConfig.hidden_act -> the MLP's activation: gated ones take gate|up, relu2 takes up alone.
ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul, "relu2": ops.relu_squared}


def linear(x: Tensor, lin: Linear) -> Tensor:
    """x @ W.T (+ bias): one matmul, or one per part with the outputs side by side."""
    outputs = linear_parts(x, lin)
    return outputs[0] if len(outputs) == 1 else ops.concat_columns(*outputs)


def linear_parts(x: Tensor, lin: Linear) -> list[Tensor]:
    """Each part's output (+ its bias, a row [N] for every token)."""
    return [ops.matmul(x, w) if b is None else ops.add(ops.matmul(x, w), b)
            for w, b in zip(lin.parts, lin.biases, strict=True)]


# MLA's per-head ids are kept for steps of up to this many tokens: at most 64 x 65 / 2 x H x 4 bytes
# (1 MiB for DeepSeek-V3's 128 heads) however many prompt lengths a server sees.
HEAD_IDS_KEPT = 64


class DecoderModel(CausalLM):
    def __init__(self, loaded: LoadedModel, backend: Backend, stage: Stage | None = None,
                 weights: Weights | None = None) -> None:
        """`weights`: records already uploaded (an MTP head's, vkrt/models/mtp.py); else `loaded`'s are."""
        self.config = c = loaded.config
        self.backend = backend
        self.stage = stage
        self.activation = ACTIVATIONS[c.hidden_act]  # the loader admits only these
        self.weights = weights if weights is not None else build_weights(loaded, backend, stage)
        # The checkpoint's MTP head stays on the host until speculation asks for it, with the LM
        # head (or tied embedding) its own may be a copy of; the other weights are not kept.
        self.mtp_source = None
        if loaded.mtp_weights and stage is None:
            kept: dict[str, WeightData] = {n: loaded.weights[n] for n in ("embed_tokens", "lm_head")
                                           if n in loaded.weights}
            self.mtp_source = replace(loaded, weights=kept)
        self._rope: dict[int, Tensor] = {}  # layer -> cos|sin table, sized by allocate_kv_cache
        self._query_temperature: Tensor | None = None  # a rotation by 0 that scales each query (Ministral 3)
        self._rope_positions = 0
        self._head_ids: dict[int, Tensor] = {}  # tokens -> MLA's per-head ids

    def upload_f32(self, values: np.ndarray) -> Tensor:
        return self.backend.upload(np.ascontiguousarray(values, dtype=np.float32), "f32", purpose="weights")

    # -- rope ---------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int | Sequence[int], block_size: int = 16, dtype: str = "f32",
                          max_len: int | None = None, state_slots: int = 1) -> KVCache:
        # The RoPE tables cover the positions a cache can hold, never the file's claimed context.
        positions = self.kv_positions(num_blocks, block_size, max_len)
        if positions > self._rope_positions:
            self._rope = rope_tables(self.config, positions, self.weights.rope_freqs, self.upload_f32)
            c = self.config
            if c.query_temperature_beta:
                self._query_temperature = self.upload_f32(query_temperature_table(
                    positions, c.head_dim, c.query_temperature_beta, c.query_temperature_length,
                    c.query_temperature_shift))
            self._rope_positions = positions
        return super().allocate_kv_cache(num_blocks, block_size, dtype, max_len, state_slots)

    def cos_sin(self, i: int) -> Tensor:
        if not self._rope:
            raise VkrtError("the RoPE tables are sized by allocate_kv_cache(); call it before forward()")
        return self._rope[i]

    # -- forward ------------------------------------------------------------------
    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        return self.head(self.hidden_states(step, kv), step.logits_index)

    def forward_pooled(self, step: StepTensors, kv: KVCache, hidden_index: Tensor,
                       hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        h = self.hidden_states(step, kv, hidden)
        assert self.weights.final_norm is not None
        normed = ops.rms_norm(ops.gather_rows(h, hidden_index), self.weights.final_norm, self.config.rms_norm_eps)
        return self.head(h, step.logits_index), normed

    def stage_forward(self, step: StepTensors, kv: KVCache, hidden: Tensor | None) -> Tensor:
        """A pipeline stage's part of `forward`: from the tokens (first stage) or the previous
        stage's hidden states [T, hidden], through this stage's layers, to the logits (last stage)
        or the hidden states the next stage takes."""
        h = self.hidden_states(step, kv, hidden)
        return self.head(h, step.logits_index) if self.stage is None or self.stage.last else h

    def hidden_states(self, step: StepTensors, kv: KVCache, hidden: Tensor | None = None) -> Tensor:
        """Every token's hidden state [T, hidden] after the last block, before the final norm (of a
        stage: after its last layer, from `hidden`, the previous stage's, unless it is the first)."""
        c, w = self.config, self.weights
        head_ids = self.head_ids(step.token_ids.shape[0]) if c.kv_lora_rank else None  # MLA's per-head matmuls
        if hidden is None:
            assert w.embed_tokens is not None, "only the first stage embeds tokens"
            h = ops.embedding(w.embed_tokens, step.token_ids)
            if c.embedding_scale != 1.0:
                h = ops.scale(h, c.embedding_scale)
        else:
            h = hidden
        per_layer = None if w.per_layer is None else self.per_layer_inputs(w.per_layer, h, step)
        for i, layer in enumerate(w.layers):  # a Nemotron-H block has only a mixer or only an MLP
            if layer is None:  # another pipeline stage's
                continue
            mixer = layer.mixer
            if isinstance(mixer, Attention):
                h = self.attention(layer, mixer, h, step, kv, i)
            elif isinstance(mixer, ShortConv):
                h = self.short_conv(layer, mixer, h, step, kv, i)
            elif isinstance(mixer, GatedDeltaNet):
                h = self.gated_delta_net(layer, mixer, h, step, kv, i)
            elif isinstance(mixer, Mamba2):
                h = self.mamba2(layer, mixer, h, step, kv, i)
            elif isinstance(mixer, AttentionMamba2):
                h = self.attention_mamba2(layer, mixer, h, step, kv, i)
            elif isinstance(mixer, LatentAttention):
                assert head_ids is not None
                x = self.pre_norm(h, layer.attn_norm)
                h = self.residual(self.latent_attention(mixer, x, step, kv, i, head_ids), h)
            if layer.mlp is not None:
                h = self.feed_forward(layer, layer.mlp, h)
            if layer.per_layer is not None and per_layer is not None:
                h = self.per_layer_branch(layer.per_layer, h, per_layer, i)
            if layer.scalar != 1.0:
                h = ops.scale(h, layer.scalar)
        return h

    def head(self, h: Tensor, logits_index: Tensor) -> Tensor:
        """Logits of the rows in `logits_index`: only they go through the final norm and the LM head
        (a classification head's `score` in its place gives the labels' logits)."""
        c, w = self.config, self.weights
        assert w.final_norm is not None and w.lm_head is not None, "only the last stage has the head"
        x = ops.rms_norm(ops.gather_rows(h, logits_index), w.final_norm, c.rms_norm_eps)
        logits = ops.matmul(x, w.lm_head)
        if c.logit_scale != 1.0:
            logits = ops.scale(logits, c.logit_scale)
        return ops.softcap(logits, c.final_softcap) if c.final_softcap else logits

    def per_layer_inputs(self, ple: PerLayerEmbedding, x: Tensor, step: StepTensors) -> Tensor:
        """Gemma 4's [T, layers * width]: (norm(proj(x) / sqrt(hidden)) + table[ids] * sqrt(width)) / sqrt(2),
        normed per layer's slice; layer i takes columns i * width .. (i + 1) * width - 1."""
        c = self.config
        t, width = x.shape[0], c.per_layer_input_size
        table = ops.scale(ops.embedding(ple.table, step.token_ids), float(np.sqrt(width)))
        proj = ops.scale(linear(x, ple.model_proj), c.hidden_size ** -0.5)
        normed = ops.rms_norm(ops.reshape(proj, (t * c.num_layers, width)), ple.model_norm, c.rms_norm_eps)
        return ops.scale(ops.add(ops.reshape(normed, (t, c.num_layers * width)), table), 0.5 ** 0.5)

    def per_layer_branch(self, branch: PerLayerInput, h: Tensor, inputs: Tensor, i: int) -> Tensor:
        """h + norm(proj(gelu(gate(h)) * layer i's per-layer input)) (Gemma 4)."""
        gated = ops.gelu_tanh_mul_slice(linear(h, branch.gate), inputs, i * self.config.per_layer_input_size)
        return ops.add(ops.rms_norm(linear(gated, branch.proj), branch.norm, self.config.rms_norm_eps), h)

    def attention(self, layer: Layer, attn: Attention, h: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        c = self.config
        out = self.attend(attn, self.pre_norm(h, layer.attn_norm), step, kv, i)
        if layer.post_attn_norm is not None:
            out = ops.rms_norm(out, layer.post_attn_norm, c.rms_norm_eps)
        return self.residual(out, h)

    def attention_mamba2(self, layer: Layer, both: AttentionMamba2, h: Tensor, step: StepTensors, kv: KVCache,
                         i: int) -> Tensor:
        """Falcon-H1: attention and Mamba2 on the same normed input, their outputs summed (each
        one's multipliers folded into its weights)."""
        x = self.pre_norm(h, layer.attn_norm)
        return self.residual(ops.add(self.attend(both.attention, x, step, kv, i),
                                     self.selective_scan(both.mamba, x, step, kv, i)), h)

    def attend(self, attn: Attention, x: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        """Attention of the normed input x over layer i's cache (its K/V written first), through o_proj."""
        c = self.config
        layer = c.layer(i)
        q = self.query_and_cache_write(attn, x, step, kv, i)
        if self._query_temperature is not None and not (c.query_temperature_nope_only and layer.rope):
            q = ops.rope(q, step.positions, self._query_temperature, c.head_dim)  # after RoPE, as transformers
        tables = step.block_tables_of(kv.group_of(i))  # the block tables of layer i's KV group
        cached = c.kv_layer_of(i)  # i, or the earlier layer whose K/V it shares (Gemma 4)
        scale, kv_heads = c.query_scale or 1.0 / float(np.sqrt(c.head_dim_of(i))), c.kv_heads_of(i)
        if attn.sinks is None:
            a = ops.paged_attention(q, kv.keys[cached], kv.values[cached], tables, step.seq_index, step.positions,
                                    c.num_heads, kv_heads, scale, window=c.layer(i).window, softcap=c.attn_softcap,
                                    chunked=c.layer(i).chunked)
        else:  # gpt-oss: a learned logit per head in every softmax's denominator
            a = ops.paged_attention_sinks(q, kv.keys[cached], kv.values[cached], tables, step.seq_index,
                                          step.positions, attn.sinks, c.num_heads, kv_heads, scale,
                                          window=c.layer(i).window, softcap=c.attn_softcap,
                                          chunked=c.layer(i).chunked)
        if attn.gate is not None:  # Qwen3.5: each head's output times sigmoid of its gate
            a = ops.sigmoid_mul(a, linear(x, attn.gate))
        return linear(a, attn.o)

    def latent_attention(self, attn: LatentAttention, x: Tensor, step: StepTensors, kv: KVCache, i: int,
                         ids: Tensor) -> Tensor:
        """MLA of the normed input x, absorbed (vkrt/models/mla.py): the row [rope(k_rope), norm(c_kv)]
        cached as layer i's key and value, MQA of the absorbed queries over it, each head's latent
        output up-projected, o_proj; `ids` is head_ids of the step."""
        c = self.config
        t, heads, width = x.shape[0], c.num_heads, c.head_dim
        cos_sin, pairs = self.cos_sin(i), c.rope_interleaved
        q_in = x  # the q LoRA: q_a_proj, its norm, then q_b_proj (attn.q)
        if attn.q_a is not None and attn.q_a_norm is not None:
            q_in = ops.rms_norm(linear(x, attn.q_a), attn.q_a_norm, c.rms_norm_eps)
        q = ops.reshape(linear(q_in, attn.q), (t, heads, c.qk_nope_head_dim + c.qk_rope_head_dim))
        cache = kv.keys[i]  # = kv.values[i]: the value is the key row
        ops.latent_kv_write(linear(x, attn.kv_a), attn.kv_a_norm, step.positions, cos_sin, cache,
                            step.slots_of(kv.group_of(i)), c.rms_norm_eps, interleaved=pairs)
        query = ops.reshape(ops.moe_matmul(q, attn.q_absorb, ids), (t, heads * width))
        query = ops.rope(query, step.positions, cos_sin, width, interleaved=pairs)
        a = ops.paged_attention(query, cache, cache, step.block_tables_of(kv.group_of(i)), step.seq_index,
                                step.positions, heads, 1, c.query_scale)
        out = ops.moe_matmul(ops.reshape(a, (t, heads, width)), attn.v_up, ids)
        return linear(ops.reshape(out, (t, heads * c.v_head_dim)), attn.o)

    def head_ids(self, tokens: int) -> Tensor:
        """i32 [tokens, H] of 0 .. H - 1: the per-head matmuls' "experts". Steps of up to
        HEAD_IDS_KEPT tokens (decode buckets, short prompts) keep theirs; longer ones upload their
        own (a recorded step keeps what it binds alive)."""
        ids = self._head_ids.get(tokens)
        if ids is None:
            ids = self.backend.upload(np.tile(np.arange(self.config.num_heads, dtype=np.int32), (tokens, 1)), "i32",
                                      purpose="inputs")
            if tokens <= HEAD_IDS_KEPT:
                self._head_ids[tokens] = ids
        return ids

    def short_conv(self, layer: Layer, conv: ShortConv, h: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        """LFM2's gated convolution over each sequence, its state in layer i's slots."""
        x = self.pre_norm(h, layer.attn_norm)
        (state,) = kv.states[i]
        y = ops.short_conv(linear(x, conv.in_proj), conv.taps, conv.bias, state, step.seq_start, step.positions,
                           step.state_slots)
        return self.residual(linear(y, conv.out_proj), h)

    def gated_delta_net(self, layer: Layer, net: GatedDeltaNet, h: Tensor, step: StepTensors, kv: KVCache,
                        i: int) -> Tensor:
        """Qwen3.5's linear attention: q|k|v convolved (silu), the gated delta rule over each
        sequence, its output normed per value head and gated by silu(z); both states in layer i's slots."""
        c = self.config
        x = self.pre_norm(h, layer.attn_norm)
        conv_state, delta_state = kv.states[i]
        qkv = ops.causal_conv1d(linear(x, net.qkv), net.conv_taps, net.conv_bias, conv_state, step.seq_start,
                                step.positions, step.state_slots, activation="silu")
        o = ops.gated_delta_net(qkv, linear(x, net.ba), net.a_rate, net.dt_bias, delta_state, step.seq_start,
                                step.positions, step.state_slots, c.linear_num_key_heads, c.linear_num_value_heads,
                                c.linear_key_head_dim, c.linear_value_head_dim, tiled_heads=c.linear_v_heads_tiled,
                                beta_scale=c.linear_beta_scale)
        gated = ops.gated_rms_norm(o, linear(x, net.z), net.norm, c.linear_norm_eps or c.rms_norm_eps,
                                   group_size=c.linear_value_head_dim)
        return self.residual(linear(gated, net.out_proj), h)

    def mamba2(self, layer: Layer, m: Mamba2, h: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        return self.residual(self.selective_scan(m, self.pre_norm(h, layer.attn_norm), step, kv, i), h)

    def selective_scan(self, m: Mamba2, x: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        """Mamba2 of the normed input x: x|B|C convolved (silu), the selective scan over each
        sequence, gated by silu(z) and normed in groups (ModelConfig.mamba_norm says in which
        order, or without the norm), through out_proj; both states in layer i's slots."""
        c = self.config
        conv_state, ssm_state = kv.states[i]
        xbc = ops.causal_conv1d(linear(x, m.xbc), m.conv_taps, m.conv_bias, conv_state, step.seq_start,
                                step.positions, step.state_slots, activation="silu")
        y = ops.ssm_scan(xbc, linear(x, m.dt), m.a_rate, m.skip, m.dt_bias, ssm_state, step.seq_start, step.positions,
                         step.state_slots, c.mamba_num_heads, c.mamba_head_dim, c.mamba_n_groups, c.mamba_state_size,
                         c.mamba_dt_min, c.mamba_dt_max)
        z = linear(x, m.z)
        if m.norm is None:  # y * silu(z)
            gated = ops.silu_and_mul(ops.concat_columns(z, y))
        else:
            group = c.mamba_num_heads * c.mamba_head_dim // c.mamba_n_groups
            gated = ops.gated_rms_norm(y, z, m.norm, c.rms_norm_eps, group_size=group,
                                       gate_first=c.mamba_norm == "after_gate")
        return linear(gated, m.out_proj)

    def pre_norm(self, h: Tensor, weight: Tensor | None) -> Tensor:
        """The sublayer's input norm; None: it has none (OLMo 2's attention layers norm outputs only)."""
        return h if weight is None else ops.rms_norm(h, weight, self.config.rms_norm_eps)

    def feed_forward(self, layer: Layer, mlp: Mlp | Experts | MlpAndExperts, h: Tensor) -> Tensor:
        c = self.config
        x = self.pre_norm(h, layer.ffn_norm)
        if isinstance(mlp, MlpAndExperts):
            out = self.mlp_and_experts(mlp, x, h)
        else:
            out = self.sparse_mlp(mlp, x) if isinstance(mlp, Experts) else self.mlp(mlp, x)
        if layer.post_ffn_norm is not None:
            out = ops.rms_norm(out, layer.post_ffn_norm, c.rms_norm_eps)
        return self.residual(out, h)

    def mlp(self, mlp: Mlp, x: Tensor) -> Tensor:
        """down(act(gate(x)) * up(x)): the dense MLP, or a MoE layer's shared expert; ungated
        (relu2), down(act(up(x)))."""
        return linear(self.activation(linear(x, mlp.gate_up)), mlp.down)

    def mlp_and_experts(self, block: MlpAndExperts, x: Tensor, h: Tensor) -> Tensor:
        """Gemma 4: norm(mlp(x)) + norm(experts(norm(h))), the router reading its own norm of h."""
        eps = self.config.rms_norm_eps
        dense = ops.rms_norm(self.mlp(block.mlp, x), block.mlp_out_norm, eps)
        routed = self.sparse_mlp(block.experts, ops.rms_norm(h, block.experts_in_norm, eps),
                                 router_input=ops.rms_norm(h, block.router_norm, eps))
        return ops.add(dense, ops.rms_norm(routed, block.experts_out_norm, eps))

    def sparse_mlp(self, experts: Experts, x: Tensor, router_input: Tensor | None = None) -> Tensor:
        """Mixture of experts: each token through the MLPs (gated, or relu2's ungated) of its k routed experts,
        summed with the router's weights (routing stays on the device: vkrt.ops.moe); the router reads
        x unless given its own input."""
        c = self.config
        logits = linear(x if router_input is None else router_input, experts.router)
        if experts.bias is not None:  # LFM2-MoE, Nemotron-H: sigmoid scores, chosen with the expert bias
            ids, weights = ops.moe_router_sigmoid(logits, experts.bias, c.num_experts_per_tok, c.norm_topk_prob,
                                                  c.routed_scaling_factor, c.router_norm_eps, c.moe_groups,
                                                  c.moe_top_groups)
        else:
            ids, weights = ops.moe_router(logits, c.num_experts_per_tok, c.norm_topk_prob)
        if experts.expert_scale is not None:  # Gemma 4: each chosen weight times its expert's scale
            t, k = weights.shape
            weights = ops.reshape(ops.moe_scale(ops.reshape(weights, (t, k, 1)), experts.expert_scale, ids), (t, k))
        if c.moe_input_scaled:  # Llama 4: the one expert's input times its score, its output as it is
            return self.input_scaled_experts(experts, x, ids, weights)
        gate_up = self.expert_gate_up(experts, x, ids)  # [T, k, 2F]
        if experts.gate_up_bias is not None:  # gpt-oss: each chosen expert's biases
            gate_up = ops.moe_add_bias(gate_up, experts.gate_up_bias, ids)
        if c.swiglu_limit:
            act = ops.clamped_swiglu(gate_up, c.swiglu_alpha, c.swiglu_limit)
        else:
            act = self.activation(gate_up)  # [T, k, F]
        y = ops.moe_matmul(act, experts.down, ids)
        if experts.down_bias is not None:
            y = ops.moe_add_bias(y, experts.down_bias, ids)
        if experts.shared is None:
            return ops.moe_combine(y, weights)
        if experts.shared_gate is None:  # Granite 4: the layer's MLP added as it is
            return ops.add(ops.moe_combine(y, weights), self.mlp(experts.shared, x))
        # Qwen2-MoE: + sigmoid(x @ shared_expert_gate.T) * shared_expert(x)
        return ops.moe_combine_shared(y, weights, self.mlp(experts.shared, x), linear(x, experts.shared_gate))

    def input_scaled_experts(self, experts: Experts, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """shared(x) + expert(x * w) of each token's one expert (k = 1, the loader's check): the
        combine over one slot is the scaling of x, and the output [T, 1, H] is a row per token."""
        assert experts.shared is not None
        t, hidden = x.shape
        scaled = ops.moe_combine(ops.reshape(x, (t, 1, hidden)), weights)
        y = ops.moe_matmul(self.activation(self.expert_gate_up(experts, scaled, ids)), experts.down, ids)
        return ops.add(ops.reshape(y, (t, hidden)), self.mlp(experts.shared, x))

    def expert_gate_up(self, experts: Experts, x: Tensor, ids: Tensor) -> Tensor:
        """[T, k, 2F]: gate over up of each token's k experts (two expert matmuls side by side
        when gate and up are stored in different formats)."""
        if len(experts.gate_up) == 1:
            return ops.moe_matmul(x, experts.gate_up[0], ids)
        gate, up = (ops.moe_matmul(x, w, ids) for w in experts.gate_up)
        t, k, f = gate.shape
        both = ops.concat_columns(ops.reshape(gate, (t * k, f)), ops.reshape(up, (t * k, f)))
        return ops.reshape(both, (t, k, 2 * f))

    def residual(self, branch: Tensor, h: Tensor) -> Tensor:
        scale = self.config.residual_scale
        return ops.add(branch if scale == 1.0 else ops.scale(branch, scale), h)

    def query_and_cache_write(self, attn: Attention, x: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        """rope(q) of the normed input; rope(k) and v stored in layer i's cache at the step's slots."""
        c = self.config
        if c.v_norm or c.kv_layer_of(i) != i:
            return self.normed_query_and_cache_write(attn, x, step, kv, i)
        cos_sin = self.cos_sin(i)
        slots = step.slots_of(kv.group_of(i))
        heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        pairs = c.rope_interleaved
        if c.qk_norm and not c.qk_norm_per_head:  # one norm over all of q and all of k (OLMoE)
            assert attn.q_norm is not None and attn.k_norm is not None
            q, k, v = linear_parts(x, attn.qkv)
            q, k = ops.rms_norm(q, attn.q_norm, c.rms_norm_eps), ops.rms_norm(k, attn.k_norm, c.rms_norm_eps)
            q = ops.rope(q, step.positions, cos_sin, c.head_dim, interleaved=pairs)
            k = ops.rope(k, step.positions, cos_sin, c.head_dim, interleaved=pairs)
            ops.kv_write(kv.keys[i], kv.values[i], k, v, slots)
            return q
        qkv = linear(x, attn.qkv)
        if attn.q_norm is not None and attn.k_norm is not None:
            return ops.qkv_norm_rope_kv_write(qkv, attn.q_norm, attn.k_norm, step.positions, cos_sin, kv.keys[i],
                                              kv.values[i], slots, c.rms_norm_eps, *heads, interleaved=pairs)
        return ops.qkv_rope_kv_write(qkv, step.positions, cos_sin, kv.keys[i], kv.values[i], slots, *heads,
                                     interleaved=pairs)

    def normed_query_and_cache_write(self, attn: Attention, x: Tensor, step: StepTensors, kv: KVCache,
                                     i: int) -> Tensor:
        """Gemma 4: q, k and v each normed per head (v without a weight), q and k roped, k and v
        cached, in one dispatch after the qkv matmul; a layer reading an earlier layer's cache
        computes its query alone; a K = V layer takes v from k's projection."""
        c = self.config
        head_dim, cos_sin, slots = c.head_dim_of(i), self.cos_sin(i), step.slots_of(kv.group_of(i))
        assert attn.q_norm is not None
        if c.kv_layer_of(i) == i and not c.layer(i).k_eq_v:
            assert attn.k_norm is not None
            return ops.qkv_norm_rope_kv_write(linear(x, attn.qkv), attn.q_norm, attn.k_norm, step.positions, cos_sin,
                                              kv.keys[i], kv.values[i], slots, c.rms_norm_eps, c.num_heads,
                                              c.kv_heads_of(i), head_dim, v_norm=True)
        parts = linear_parts(x, attn.qkv)
        q = ops.rope(self.head_norm(parts[0], attn.q_norm, head_dim), step.positions, cos_sin, head_dim)
        if c.kv_layer_of(i) == i:  # K = V: parts [q, k]
            assert attn.k_norm is not None and attn.v_norm is not None
            k = ops.rope(self.head_norm(parts[1], attn.k_norm, head_dim), step.positions, cos_sin, head_dim)
            ops.kv_write(kv.keys[i], kv.values[i], k, self.head_norm(parts[1], attn.v_norm, head_dim), slots)
        return q

    def head_norm(self, x: Tensor, weight: Tensor, head_dim: int) -> Tensor:
        """RMSNorm of each head of x [T, heads * head_dim] (a view of its rows as heads)."""
        t, width = x.shape
        return ops.reshape(ops.rms_norm(ops.reshape(x, (t * width // head_dim, head_dim)), weight,
                                        self.config.rms_norm_eps), (t, width))


def rope_tables(config: ModelConfig, positions: int, freq_factors: np.ndarray | None,
                upload: Callable[[np.ndarray], Tensor]) -> dict[int, Tensor]:
    """One cos|sin table per distinct (rope base, scaling) among the layers, keyed by layer.

    The one place a table is sized: `positions` is what the KV cache can hold; its width is
    the rotated dims (`rotary_dim`: partial rotary rotates only the first ones of each head).
    """
    by_params: dict[str, Tensor] = {}
    tables: dict[int, Tensor] = {}
    for i in range(config.num_layers):
        layer = config.layer(i)
        rotated = config.rotary_dim or config.head_dim_of(i)
        key = repr((layer.rope, layer.rope_theta, sorted((layer.rope_scaling or {}).items()), rotated))
        if key not in by_params:
            if layer.rope:
                table = rope_table(positions, rotated, layer.rope_theta, layer.rope_scaling, freq_factors)
            else:  # cos 1, sin 0: the rotation is exactly the identity, so NoPE layers need no other op
                table = np.concatenate([np.ones((positions, rotated // 2), np.float32),
                                        np.zeros((positions, rotated // 2), np.float32)], axis=1)
            by_params[key] = upload(table)
        tables[i] = by_params[key]
    return tables
