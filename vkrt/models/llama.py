"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral without sliding window).

embedding -> N x [RMSNorm, GQA attention with RoPE, residual, RMSNorm, SwiGLU MLP, residual]
-> final RMSNorm -> LM head. Written against vkrt.ops only; the engine decides batching.
"""

from __future__ import annotations

import numpy as np

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.errors import ModelFormatError, UnsupportedModelError, VkrtError
from vkrt.loader.config import LoadedModel, WeightData
from vkrt.models.base import CausalLM, KVCache, StepTensors
from vkrt.models.rope import inv_frequencies
from vkrt.ops.quant import dequantize
from vkrt.ops.tensor import Tensor


def _concat_rows(parts: list[WeightData], name: str) -> WeightData:
    """Stack weights along output rows (e.g. gate and up into one matmul), format kept."""
    if len({p.fmt for p in parts}) != 1:
        return WeightData(name, "f32", (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                          np.concatenate([dequantize(p.data, p.fmt).reshape(p.shape) for p in parts]))
    data = np.concatenate([np.asarray(p.data) for p in parts], axis=0)
    return WeightData(name, parts[0].fmt, (sum(p.shape[0] for p in parts), parts[0].shape[1]), data)


class Layer:
    def __init__(self, model: LlamaModel, i: int) -> None:
        w = model.weight
        self.attn_norm = model.norm_weight(f"layers.{i}.attn_norm")
        # q, k and v stacked into one matmul when they share a format (mixed GGUF quant
        # layouts, e.g. Q6_K v, keep three matmuls rather than a dequantized f32 copy).
        qkv = [model.raw(f"layers.{i}.{name}") for name in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj: Tensor | None = None
        self.q_proj: Tensor | None = None
        self.k_proj: Tensor | None = None
        self.v_proj: Tensor | None = None
        if len({p.fmt for p in qkv}) == 1:
            self.qkv_proj = model.upload(_concat_rows(qkv, f"layers.{i}.qkv"))
        else:
            self.q_proj, self.k_proj, self.v_proj = (model.upload(p) for p in qkv)
        self.o_proj = w(f"layers.{i}.o_proj")
        self.ffn_norm = model.norm_weight(f"layers.{i}.ffn_norm")
        gate, up = model.raw(f"layers.{i}.gate_proj"), model.raw(f"layers.{i}.up_proj")
        self.gate_up = model.upload(_concat_rows([gate, up], f"layers.{i}.gate_up"))
        self.down_proj = w(f"layers.{i}.down_proj")


class LlamaModel(CausalLM):
    def __init__(self, loaded: LoadedModel, backend: Backend) -> None:
        self.config = c = loaded.config
        self.backend = backend
        self._weights = loaded.weights
        self._path = loaded.path
        if c.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"{loaded.path}: hidden_act {c.hidden_act!r} is not supported "
                                        "for llama (expected silu)")
        backend.reserve("weights", self._device_bytes())
        self.embed_tokens = self.weight("embed_tokens")
        self.layers = [Layer(self, i) for i in range(c.num_layers)]
        self.final_norm = self.norm_weight("final_norm")
        tied = c.tie_word_embeddings or "lm_head" not in self._weights
        self.lm_head = self.embed_tokens if tied else self.weight("lm_head")
        freqs = self._weights.get("rope_freqs")
        self._inv_freq = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling,
                                         dequantize(freqs.data, freqs.fmt).reshape(-1) if freqs is not None else None)
        self._cos_sin: Tensor | None = None  # sized by allocate_kv_cache
        self.scale = 1.0 / float(np.sqrt(c.head_dim))
        self._weights = {}  # uploaded: drop the host (memory-mapped) references

    # -- weight upload ------------------------------------------------------------
    def _device_bytes(self) -> int:
        """What the upload below will occupy: matrices as stored, norms as f32."""
        total = 0
        for wd in self._weights.values():
            if len(wd.shape) == 2:
                total += self.backend.weight_nbytes(wd.fmt, wd.shape)
            else:
                total += self.backend.weight_nbytes("f32", wd.shape)
        return total

    @property
    def cos_sin(self) -> Tensor:
        if self._cos_sin is None:
            raise VkrtError("the RoPE table is sized by allocate_kv_cache(); call it before forward()")
        return self._cos_sin

    def allocate_kv_cache(self, num_blocks: int, block_size: int = 16, dtype: str = "f32") -> KVCache:
        # The RoPE table covers the positions a cache can hold, never the file's claimed
        # context (a GGUF may claim 2^32-1): no sequence outgrows num_blocks * block_size.
        c = self.config
        positions = min(c.max_position_embeddings, num_blocks * block_size)
        if self._cos_sin is None or self._cos_sin.shape[0] < positions:
            table = ops.rope_cos_sin(positions, c.head_dim, c.rope_theta, inv_freq=self._inv_freq)
            self._cos_sin = self.backend.upload(table, "f32", purpose="weights")
        return super().allocate_kv_cache(num_blocks, block_size, dtype)

    def raw(self, name: str) -> WeightData:
        try:
            return self._weights[name]
        except KeyError:
            raise ModelFormatError(f"{self._path}: missing weight {name!r}") from None

    def upload(self, wd: WeightData) -> Tensor:
        return self.backend.upload_weight(wd.data, wd.fmt, wd.shape)

    def weight(self, name: str) -> Tensor:
        return self.upload(self.raw(name))

    def norm_weight(self, name: str) -> Tensor:
        wd = self.raw(name)
        return self.backend.upload(dequantize(wd.data, wd.fmt).reshape(-1), "f32", purpose="weights")

    # -- forward ------------------------------------------------------------------
    def _qkv(self, layer: Layer, h: Tensor, step: StepTensors, kv: KVCache, i: int) -> Tensor:
        """rope(q) of rms_norm(h); rope(k) and v stored in layer i's cache at the step's slots."""
        c = self.config
        x = ops.rms_norm(h, layer.attn_norm, c.rms_norm_eps)
        if layer.qkv_proj is not None:
            return ops.qkv_rope_kv_write(ops.matmul(x, layer.qkv_proj), step.positions, self.cos_sin,
                                         kv.keys[i], kv.values[i], step.slots, c.num_heads,
                                         c.num_kv_heads, c.head_dim)
        assert layer.q_proj is not None and layer.k_proj is not None and layer.v_proj is not None
        q = ops.rope(ops.matmul(x, layer.q_proj), step.positions, self.cos_sin, c.head_dim)
        k = ops.rope(ops.matmul(x, layer.k_proj), step.positions, self.cos_sin, c.head_dim)
        ops.kv_write(kv.keys[i], kv.values[i], k, ops.matmul(x, layer.v_proj), step.slots)
        return q

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        """The residual stream h goes through each layer's two pre-norm blocks. Written in
        primitive ops; vkrt.ops.fusion folds each norm into the matmul that consumes it and
        each residual add into the projection that produces it: 5 dispatches per layer."""
        c = self.config
        eps = c.rms_norm_eps
        h = ops.embedding(self.embed_tokens, step.token_ids)
        for i, layer in enumerate(self.layers):
            q = self._qkv(layer, h, step, kv, i)
            attn = ops.paged_attention(q, kv.keys[i], kv.values[i], step.block_tables, step.seq_index,
                                       step.positions, c.num_heads, c.num_kv_heads, self.scale)
            h = ops.add(ops.matmul(attn, layer.o_proj), h)
            x = ops.rms_norm(h, layer.ffn_norm, eps)
            h = ops.add(ops.matmul(ops.silu_and_mul(ops.matmul(x, layer.gate_up)), layer.down_proj), h)
        # Only the rows that need logits go through the final norm and the LM head.
        x = ops.rms_norm(ops.gather_rows(h, step.logits_index), self.final_norm, eps)
        return ops.matmul(x, self.lm_head)
