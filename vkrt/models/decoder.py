"""The decoder-only transformer every supported family is a configuration of.

embedding (x scale) -> N x [norm, attention (+bias, QK-norm, RoPE, window, softcap),
(post-norm), residual (x scale), norm, gated MLP or mixture of experts, (post-norm), residual
(x scale)] -> final norm -> LM head (x scale, softcap). Llama, Mistral, Qwen2/3, Gemma 2/3,
Phi-3, SmolLM3, Granite, Qwen3-MoE, Mixtral and OLMoE differ only in ModelConfig
(vkrt/loader/normalize.py builds it): the traits are read from there, never from a family
name. Written in primitive ops; vkrt.ops.fusion folds them into fused kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.quant import dequantize
from vkrt.core.tensor import Tensor
from vkrt.errors import ModelFormatError, OutOfDeviceMemory, UnsupportedModelError, VkrtError
from vkrt.loader.config import LoadedModel, ModelConfig, WeightData
from vkrt.models.base import CausalLM, KVCache, StepTensors
from vkrt.models.rope import rope_table

GATED_ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}


def stack_rows(parts: list[WeightData], name: str) -> WeightData:
    """Weights stacked along output rows in their shared storage format (q/k/v, gate/up)."""
    rows = sum(p.shape[0] for p in parts)
    assert len({p.fmt for p in parts}) == 1, f"{name}: parts in different formats stay apart"
    data = np.concatenate([np.asarray(p.data) for p in parts], axis=0)
    return WeightData(name, parts[0].fmt, (rows, parts[0].shape[1]), data)


def expert_matrices(w: WeightData) -> list[np.ndarray]:
    """A stacked [E, out, in] expert weight as E storage-format matrices (views)."""
    return list(np.asarray(w.data).reshape(w.shape[0], w.shape[1], -1))


def stack_experts(experts: list[list[WeightData]], name: str) -> WeightData:
    """[E, rows, in] from each expert's matrices stacked along rows (gate over up), in their
    shared storage format (dequantized to f32 only if the formats differ)."""
    parts = [p for expert in experts for p in expert]
    rows, cols = sum(p.shape[0] for p in experts[0]), parts[0].shape[1]
    if len({p.fmt for p in parts}) != 1:
        data = np.stack([np.concatenate([dequantize(p.data, p.fmt).reshape(p.shape) for p in e]) for e in experts])
        return WeightData(name, "f32", (len(experts), rows, cols), data)
    data = np.stack([np.concatenate([np.asarray(p.data) for p in e], axis=0) for e in experts])
    return WeightData(name, parts[0].fmt, (len(experts), rows, cols), data)


GatedMLP = tuple[Tensor | None, tuple[Tensor, Tensor] | None, Tensor]  # gate|up or (gate, up), down


def gated_mlp_weights(model: DecoderModel, p: str) -> GatedMLP:
    """A gated MLP's weights under prefix p: gate|up stacked (as stored, or stacked here when
    gate and up share a format; else the two apart) and down."""
    if model.has(p + "gate_up_proj"):
        return model.matrix(model.raw(p + "gate_up_proj")), None, model.matrix(model.raw(p + "down_proj"))
    gate, up = model.raw(p + "gate_proj"), model.raw(p + "up_proj")
    down = model.matrix(model.raw(p + "down_proj"))
    if gate.fmt == up.fmt:
        return model.matrix(stack_rows([gate, up], p + "gate_up_proj")), None, down
    return None, (model.matrix(gate), model.matrix(up)), down


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


class Block:
    """One layer's weights on the device, and its attention window."""

    def __init__(self, model: DecoderModel, i: int) -> None:
        c = model.config
        has = model.has
        p = f"layers.{i}."
        self.window = c.layer(i).window
        self.attn_norm = model.norm(p + "attn_norm")
        self.ffn_norm = model.norm(p + "ffn_norm")
        self.post_attn_norm = model.norm(p + "post_attn_norm") if c.sandwich_norms else None
        self.post_ffn_norm = model.norm(p + "post_ffn_norm") if c.sandwich_norms else None
        self.q_norm = model.norm(p + "q_norm") if c.qk_norm else None
        self.k_norm = model.norm(p + "k_norm") if c.qk_norm else None
        # q, k and v are one matmul when they share a storage format (a fused checkpoint
        # already is one). A GGUF mix such as Q5_0 q/k with Q8_0 v keeps three matmuls in
        # their own formats (nothing is dequantized to stack them), whose outputs are
        # concatenated into the stacked layout (`qkv_parts`). A norm over all of q and of k
        # (OLMoE) needs them apart; per-head QK-norm does not.
        self.qkv: Tensor | None = None
        self.qkv_parts: tuple[Tensor, Tensor, Tensor] | None = None
        self.q_proj = self.k_proj = self.v_proj = None
        self.qkv_bias: Tensor | None = None
        self.q_bias = self.k_bias = self.v_bias = None
        apart = c.qk_norm and not c.qk_norm_per_head
        if has(p + "qkv_proj"):
            self.qkv = model.matrix(model.raw(p + "qkv_proj"))
        else:
            parts = [model.raw(p + n) for n in ("q_proj", "k_proj", "v_proj")]
            if apart:
                self.q_proj, self.k_proj, self.v_proj = (model.matrix(w) for w in parts)
            elif len({w.fmt for w in parts}) == 1:
                self.qkv = model.matrix(stack_rows(parts, p + "qkv_proj"))
            else:
                q_proj, k_proj, v_proj = (model.matrix(w) for w in parts)
                self.qkv_parts = (q_proj, k_proj, v_proj)
        if c.qkv_bias:  # one bias per matmul: each joins its projection (vkrt.ops.fusion)
            biases = [model.vector(p + n) for n in ("q_bias", "k_bias", "v_bias")]
            if self.qkv is not None:
                self.qkv_bias = model.upload_f32(np.concatenate(biases))
            else:
                self.q_bias, self.k_bias, self.v_bias = (model.upload_f32(b) for b in biases)
        self.o_proj = model.matrix(model.raw(p + "o_proj"))
        # The MLP is dense (gate|up stacked, down) or sparse: the router and each expert's
        # stacked gate|up and down, [E, out, in], and maybe a shared expert (a dense MLP) with
        # its gate [1, hidden].
        self.gate_up = self.down_proj = None
        self.gate_up_parts: tuple[Tensor, Tensor] | None = None  # gate and up in different formats
        self.router = self.experts_gate_up = self.experts_down = None
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Tensor | None = None
        if c.layer(i).moe:
            self.router = model.matrix(model.raw(p + "router"))
            self.experts_gate_up = model.matrix(stack_experts(model.experts(i, "gate_proj", "up_proj"),
                                                              p + "experts.gate_up_proj"))
            self.experts_down = model.matrix(stack_experts(model.experts(i, "down_proj"), p + "experts.down_proj"))
            if c.shared_expert_intermediate_size:
                self.shared_expert = gated_mlp_weights(model, p + "shared_expert.")
                self.shared_expert_gate = model.matrix(model.raw(p + "shared_expert_gate"))
        else:
            self.gate_up, self.gate_up_parts, self.down_proj = gated_mlp_weights(model, p)


class DecoderModel(CausalLM):
    def __init__(self, loaded: LoadedModel, backend: Backend) -> None:
        self.config = c = loaded.config
        self.backend = backend
        self._weights = loaded.weights
        self._path = loaded.path
        if c.hidden_act not in GATED_ACTIVATIONS:
            raise UnsupportedModelError(f"{loaded.path}: hidden_act {c.hidden_act!r} is not supported "
                                        f"(supported: {', '.join(GATED_ACTIVATIONS)})")
        self.activation = GATED_ACTIVATIONS[c.hidden_act]
        self._reserve_weights()
        self.embed_tokens = self.matrix(self.raw("embed_tokens"))
        self.blocks = [Block(self, i) for i in range(c.num_layers)]
        self.final_norm = self.norm("final_norm")
        tied = c.tie_word_embeddings or "lm_head" not in self._weights
        self.lm_head = self.embed_tokens if tied else self.matrix(self.raw("lm_head"))
        freqs = self._weights.get("rope_freqs")
        self._freq_factors = dequantize(freqs.data, freqs.fmt).reshape(-1) if freqs is not None else None
        self._rope: dict[int, Tensor] = {}  # layer -> cos|sin table, sized by allocate_kv_cache
        self._rope_positions = 0
        self.scale = c.query_scale or 1.0 / float(np.sqrt(c.head_dim))
        self._weights = {}  # uploaded: drop the host (memory-mapped) references

    # -- weights ------------------------------------------------------------------
    def _device_bytes(self) -> int:
        """What the upload will occupy: matrices as stored, vectors as f32."""
        return sum(self.backend.weight_nbytes(w.fmt if len(w.shape) >= 2 else "f32", w.shape)
                   for w in self._weights.values())

    def _reserve_weights(self) -> None:
        """Reserve the weights' device memory; if it does not fit, say how much of it the
        experts are and name the largest expert tensor."""
        total = self._device_bytes()
        try:
            self.backend.reserve("weights", total)
        except OutOfDeviceMemory as exc:
            experts = [(self.backend.weight_nbytes(fmt, shape), name, fmt, shape)
                       for name, fmt, shape in self._expert_tensors()]
            if not experts:
                raise
            size, name, fmt, shape = max(experts)
            raise OutOfDeviceMemory(
                f"{self._path}: the weights need {_mib(total)} on the device, {_mib(sum(e[0] for e in experts))} "
                f"of it in {len(experts)} stacked expert tensors (the largest: {name}, {fmt} {list(shape)}, "
                f"{_mib(size)}): {exc}", requested=exc.requested, purpose="weights") from None

    def _expert_tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, format, shape) of each stacked expert weight the upload makes (Block)."""
        c = self.config
        f, h = c.moe_intermediate_size, c.hidden_size
        out: list[tuple[str, str, tuple[int, ...]]] = []
        for i, layer in enumerate(c.layers):
            if not layer.moe:
                continue
            for name, projections, shape in (("gate_up_proj", ("gate_proj", "up_proj"), (2 * f, h)),
                                             ("down_proj", ("down_proj",), (h, f))):
                formats = {w.fmt for expert in self.experts(i, *projections) for w in expert}
                fmt = formats.pop() if len(formats) == 1 else "f32"  # as stack_experts stacks them
                out.append((f"layers.{i}.experts.{name}", fmt, (c.num_experts, *shape)))
        return out

    def has(self, name: str) -> bool:
        return name in self._weights

    def raw(self, name: str) -> WeightData:
        try:
            return self._weights[name]
        except KeyError:
            raise ModelFormatError(f"{self._path}: missing weight {name!r}") from None

    def experts(self, i: int, *projections: str) -> list[list[WeightData]]:
        """Layer i's experts, each as its list of `projections` matrices (from the stacked
        [E, out, in] tensors of a GGUF or HF's one tensor per expert)."""
        p = f"layers.{i}.experts."
        if self.has(p + projections[0]):
            stacked = [self.raw(p + n) for n in projections]
            split = [expert_matrices(w) for w in stacked]
            return [[WeightData(w.name, w.fmt, w.shape[1:], m[e]) for w, m in zip(stacked, split, strict=True)]
                    for e in range(self.config.num_experts)]
        return [[self.raw(f"{p}{e}.{n}") for n in projections] for e in range(self.config.num_experts)]

    def matrix(self, wd: WeightData) -> Tensor:
        try:
            return self.backend.upload_weight(wd.data, wd.fmt, wd.shape)
        except OutOfDeviceMemory as exc:
            size = self.backend.weight_nbytes(wd.fmt, wd.shape)
            raise OutOfDeviceMemory(f"{self._path}: weight {wd.name} ({wd.fmt} {list(wd.shape)}, {_mib(size)} on "
                                    f"the device) does not fit: {exc}", requested=exc.requested,
                                    purpose="weights") from None

    def vector(self, name: str) -> np.ndarray:
        wd = self.raw(name)
        return dequantize(wd.data, wd.fmt).reshape(-1).astype(np.float32)

    def upload_f32(self, values: np.ndarray) -> Tensor:
        return self.backend.upload(np.ascontiguousarray(values, dtype=np.float32), "f32", purpose="weights")

    def norm(self, name: str) -> Tensor:
        """A norm's scale as f32; HF Gemma stores w of (1 + w), folded here once."""
        return self.upload_f32(self.vector(name) + np.float32(self.config.norm_offset))

    # -- rope ---------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int | Sequence[int], block_size: int = 16, dtype: str = "f32",
                          max_len: int | None = None) -> KVCache:
        # The RoPE tables cover the positions a cache can hold, never the file's claimed context.
        positions = self.kv_positions(num_blocks, block_size, max_len)
        if positions > self._rope_positions:
            self._rope = rope_tables(self.config, positions, self._freq_factors, self.upload_f32)
            self._rope_positions = positions
        return super().allocate_kv_cache(num_blocks, block_size, dtype, max_len)

    def cos_sin(self, i: int) -> Tensor:
        if not self._rope:
            raise VkrtError("the RoPE tables are sized by allocate_kv_cache(); call it before forward()")
        return self._rope[i]

    # -- forward ------------------------------------------------------------------
    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        c = self.config
        h = ops.embedding(self.embed_tokens, step.token_ids)
        if c.embedding_scale != 1.0:
            h = ops.scale(h, c.embedding_scale)
        for i, block in enumerate(self.blocks):
            h = self.attention(block, h, step, kv, i)
            h = self.mlp(block, h)
        # Only the rows that need logits go through the final norm and the LM head.
        x = ops.rms_norm(ops.gather_rows(h, step.logits_index), self.final_norm, c.rms_norm_eps)
        logits = ops.matmul(x, self.lm_head)
        if c.logit_scale != 1.0:
            logits = ops.scale(logits, c.logit_scale)
        return ops.softcap(logits, c.final_softcap) if c.final_softcap else logits

    def attention(self, b: Block, h: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        c = self.config
        x = ops.rms_norm(h, b.attn_norm, c.rms_norm_eps)
        q = self.query_and_cache_write(b, x, step, kv, i)
        tables = step.block_tables_of(kv.group_of(i))  # the block tables of layer i's KV group
        a = ops.paged_attention(q, kv.keys[i], kv.values[i], tables, step.seq_index, step.positions,
                                c.num_heads, c.num_kv_heads, self.scale, window=b.window, softcap=c.attn_softcap)
        out = ops.matmul(a, b.o_proj)
        if b.post_attn_norm is not None:
            out = ops.rms_norm(out, b.post_attn_norm, c.rms_norm_eps)
        return self.residual(out, h)

    def mlp(self, b: Block, h: Tensor) -> Tensor:
        c = self.config
        x = ops.rms_norm(h, b.ffn_norm, c.rms_norm_eps)
        if b.down_proj is not None:
            out = self.gated_mlp((b.gate_up, b.gate_up_parts, b.down_proj), x)
        else:
            out = self.sparse_mlp(b, x)
        if b.post_ffn_norm is not None:
            out = ops.rms_norm(out, b.post_ffn_norm, c.rms_norm_eps)
        return self.residual(out, h)

    def sparse_mlp(self, b: Block, x: Tensor) -> Tensor:
        """Mixture of experts: each token through the gated MLPs of its k routed experts,
        summed with the router's weights (routing stays on the device: vkrt.ops.moe)."""
        assert b.router is not None and b.experts_gate_up is not None and b.experts_down is not None
        c = self.config
        ids, weights = ops.moe_router(ops.matmul(x, b.router), c.num_experts_per_tok, c.norm_topk_prob)
        act = self.activation(ops.moe_matmul(x, b.experts_gate_up, ids))  # [T, k, F]
        y = ops.moe_matmul(act, b.experts_down, ids)
        if b.shared_expert is None or b.shared_expert_gate is None:
            return ops.moe_combine(y, weights)
        # Qwen2-MoE: + sigmoid(x @ shared_expert_gate.T) * shared_expert(x)
        return ops.moe_combine_shared(y, weights, self.gated_mlp(b.shared_expert, x),
                                      ops.matmul(x, b.shared_expert_gate))

    def gated_mlp(self, weights: GatedMLP, x: Tensor) -> Tensor:
        """down(act(gate(x)) * up(x)): the dense MLP, or a MoE layer's shared expert."""
        gate_up, parts, down = weights
        if gate_up is not None:
            return ops.matmul(self.activation(ops.matmul(x, gate_up)), down)
        assert parts is not None
        return ops.matmul(self.activation(ops.concat_columns(*(ops.matmul(x, w) for w in parts))), down)

    def residual(self, branch: Tensor, h: Tensor) -> Tensor:
        scale = self.config.residual_scale
        return ops.add(branch if scale == 1.0 else ops.scale(branch, scale), h)

    def query_and_cache_write(self, b: Block, x: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        """rope(q) of the normed input; rope(k) and v stored in layer i's cache at the step's slots."""
        c = self.config
        cos_sin = self.cos_sin(i)
        slots = step.slots_of(kv.group_of(i))
        heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        if b.qkv is not None or b.qkv_parts is not None:
            if b.qkv is not None:
                qkv = with_bias(ops.matmul(x, b.qkv), b.qkv_bias)
            else:
                assert b.qkv_parts is not None
                biases = (b.q_bias, b.k_bias, b.v_bias)
                qkv = ops.concat_columns(*(with_bias(ops.matmul(x, w), bias)
                                           for w, bias in zip(b.qkv_parts, biases, strict=True)))
            if b.q_norm is not None and b.k_norm is not None:
                return ops.qkv_norm_rope_kv_write(qkv, b.q_norm, b.k_norm, step.positions, cos_sin, kv.keys[i],
                                                  kv.values[i], slots, c.rms_norm_eps, *heads)
            return ops.qkv_rope_kv_write(qkv, step.positions, cos_sin, kv.keys[i], kv.values[i], slots, *heads)
        assert b.q_proj is not None and b.k_proj is not None and b.v_proj is not None
        q, k, v = (with_bias(ops.matmul(x, w), bias)
                   for w, bias in ((b.q_proj, b.q_bias), (b.k_proj, b.k_bias), (b.v_proj, b.v_bias)))
        if b.q_norm is not None and b.k_norm is not None and c.qk_norm_per_head:
            q, k = self.head_norm(q, b.q_norm), self.head_norm(k, b.k_norm)
        elif b.q_norm is not None and b.k_norm is not None:  # one norm over all heads (OLMoE)
            q, k = ops.rms_norm(q, b.q_norm, c.rms_norm_eps), ops.rms_norm(k, b.k_norm, c.rms_norm_eps)
        q = ops.rope(q, step.positions, cos_sin, c.head_dim)
        ops.kv_write(kv.keys[i], kv.values[i], ops.rope(k, step.positions, cos_sin, c.head_dim), v, slots)
        return q

    def head_norm(self, x: Tensor, w: Tensor) -> Tensor:
        """RMSNorm of each head of x [T, heads * head_dim] (QK-norm), through a per-head view."""
        c = self.config
        rows = ops.reshape(x, (-1, c.head_dim))
        return ops.reshape(ops.rms_norm(rows, w, c.rms_norm_eps), x.shape)


def with_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    """y + bias (a row [N] for every token), or y when the projection has none."""
    return y if bias is None else ops.add(y, bias)


def rope_tables(config: ModelConfig, positions: int, freq_factors: np.ndarray | None,
                upload: Callable[[np.ndarray], Tensor]) -> dict[int, Tensor]:
    """One cos|sin table per distinct (rope base, scaling) among the layers, keyed by layer.

    The one place a table is sized: `positions` is what the KV cache can hold.
    """
    by_params: dict[str, Tensor] = {}
    tables: dict[int, Tensor] = {}
    for i in range(config.num_layers):
        layer = config.layer(i)
        key = repr((layer.rope, layer.rope_theta, sorted((layer.rope_scaling or {}).items())))
        if key not in by_params:
            if layer.rope:
                table = rope_table(positions, config.head_dim, layer.rope_theta, layer.rope_scaling, freq_factors)
            else:  # cos 1, sin 0: the rotation is exactly the identity, so NoPE layers need no other op
                table = np.concatenate([np.ones((positions, config.head_dim // 2), np.float32),
                                        np.zeros((positions, config.head_dim // 2), np.float32)], axis=1)
            by_params[key] = upload(table)
        tables[i] = by_params[key]
    return tables
