"""The parameters layer: a checkpoint's tensors as the typed records a model computes with.

`build_weights(loaded, backend)` stands between the loader and the model. It reads the
LoadedModel once and decides, from the config and what the file holds, how each projection
is stored: q, k and v (or gate and up) become one stacked matrix when they share a storage
format, or stay parts in their own formats, whose outputs the model concatenates (a GGUF may
mix Q5_0 q/k with Q8_0 v; nothing is dequantized to stack them). Every tensor is uploaded
once, in its storage format, its stacked pieces joined as it is uploaded (`HostWeight`), and
the records hold only what the forward computes with: the model never asks which tensors a
file had.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import numpy as np

from vkrt.backend.base import Backend
from vkrt.core.host_weight import HostWeight, RowBlock
from vkrt.core.quant import dequantize, f32_to_bf16
from vkrt.core.tensor import Tensor
from vkrt.errors import ModelFormatError, OutOfDeviceMemory, UnsupportedModelError
from vkrt.loader.config import LoadedModel, ModelConfig, WeightData
from vkrt.models.base import Stage
from vkrt.models.mla import absorbed_query, absorbed_value


@dataclass(frozen=True)
class Linear:
    """x @ W.T (+ bias): W one matrix, or row parts in different storage formats whose outputs
    are concatenated; a bias (f32 [rows]) per part or none."""

    parts: tuple[Tensor, ...]
    biases: tuple[Tensor | None, ...]


@dataclass(frozen=True)
class Attention:
    """q|k|v as one projection ([T, (H + 2 KVH) * head_dim]; its parts are q, k and v when they
    differ in format or a QK-norm spans every head), the output projection, the QK-norms."""

    qkv: Linear
    o: Linear
    q_norm: Tensor | None  # [head_dim] per head, or [H * head_dim] over all of q (OLMoE)
    k_norm: Tensor | None
    gate: Linear | None = None  # the output gate's projection, [H * head_dim] (Qwen3.5)
    sinks: Tensor | None = None  # a softmax-denominator logit per head [H] (gpt-oss)
    v_norm: Tensor | None = None  # ones [head_dim]: Gemma 4's weightless norm of v where v is k's projection


@dataclass(frozen=True)
class ShortConv:
    """LFM2's gated short convolution: in_proj to [B | C | x], C * conv(B * x) with taps [C, K]
    and a bias [C] (zeros where the checkpoint has none), out_proj."""

    in_proj: Linear
    taps: Tensor
    bias: Tensor
    out_proj: Linear


@dataclass(frozen=True)
class GatedDeltaNet:
    """Qwen3.5's linear attention: projections to q|k|v, z and b|a, the causal conv over q|k|v
    (taps [C, K], zero bias), the decay's rate A = -exp(A_log) and dt_bias [Hv], the gated output norm [dv]
    (plain w, not 1 + w), out_proj."""

    qkv: Linear
    z: Linear
    ba: Linear
    conv_taps: Tensor
    conv_bias: Tensor
    a_rate: Tensor
    dt_bias: Tensor
    norm: Tensor
    out_proj: Linear


@dataclass(frozen=True)
class Mamba2:
    """Mamba2 (Granite 4): in_proj's rows as three projections, z (the gate), x|B|C and dt; the
    conv over x|B|C (taps [C, K], bias), A = -exp(A_log), D and dt_bias [H], the grouped norm
    weight [inner] (None: no norm, Falcon-H1's option), out_proj."""

    z: Linear
    xbc: Linear
    dt: Linear
    conv_taps: Tensor
    conv_bias: Tensor
    a_rate: Tensor
    skip: Tensor
    dt_bias: Tensor
    norm: Tensor | None
    out_proj: Linear


@dataclass(frozen=True)
class AttentionMamba2:
    """Falcon-H1's mixer: attention and Mamba2 on the same input, their outputs summed."""

    attention: Attention
    mamba: Mamba2


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention with its up-projections absorbed (vkrt/models/mla.py): q (q_proj,
    or q_b_proj after q_a_proj and its norm) [T, H * (nope + rope)], kv_a_proj (the latent's rows,
    then the rope key's), the latent's norm, the per-head query absorption [H, rope + kv_lora, nope +
    rope] and value up-projection [H, v, rope + kv_lora] (made at load, in kv_b_proj's or k_b's / v_b's
    float format; f32 from a block format), o_proj."""

    q: Linear
    q_a: Linear | None
    q_a_norm: Tensor | None
    kv_a: Linear
    kv_a_norm: Tensor
    q_absorb: Tensor
    v_up: Tensor
    o: Linear


Mixer = Attention | ShortConv | GatedDeltaNet | Mamba2 | AttentionMamba2 | LatentAttention


@dataclass(frozen=True)
class Mlp:
    """down(act(gate(x)) * up(x)): gate rows over up rows in one projection (an ungated MLP,
    relu2's, has up's rows alone there)."""

    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: the router [E, hidden], each expert's gate|up [E, 2F, hidden] (or
    gate and up apart, [E, F, hidden] each, when their formats differ) and down [E, hidden, F],
    and maybe a shared expert with its sigmoid gate [1, hidden] (Qwen2-MoE)."""

    router: Linear
    gate_up: tuple[Tensor, ...]
    down: Tensor
    shared: Mlp | None = None
    shared_gate: Linear | None = None
    bias: Tensor | None = None  # a sigmoid router's per-expert bias [E] (zeros when the file has none)
    gate_up_bias: Tensor | None = None  # each expert's bias on gate|up [E, 2F] and on down [E, hidden] (gpt-oss)
    down_bias: Tensor | None = None
    expert_scale: Tensor | None = None  # [E, 1]: each chosen weight times its expert's scale (Gemma 4)


@dataclass(frozen=True)
class MlpAndExperts:
    """Gemma 4's MoE block: the dense MLP (its output normed) beside the experts, whose input and
    output have norms of their own and whose router reads the block's input through a norm of
    its own (weightless in the checkpoint: here router.scale / sqrt(hidden))."""

    mlp: Mlp
    mlp_out_norm: Tensor
    experts: Experts
    experts_in_norm: Tensor
    experts_out_norm: Tensor
    router_norm: Tensor


@dataclass(frozen=True)
class PerLayerInput:
    """Gemma 4's branch at the end of a layer: h + norm(proj(gelu(gate(h)) * the layer's per-layer input))."""

    gate: Linear
    proj: Linear
    norm: Tensor


@dataclass(frozen=True)
class PerLayerEmbedding:
    """Gemma 4's per-layer inputs: a table [vocab, layers * width], a projection of the scaled
    embeddings to the same width, and the norm over each layer's slice of it [width]."""

    table: Tensor
    model_proj: Linear
    model_norm: Tensor


@dataclass(frozen=True)
class Layer:
    """One block's weights: the norms (post-norms with sandwich norms), its token mixer (attention
    or a recurrent mixer), MLP or experts. A block of one sublayer (Nemotron-H) has None for the
    other and its norm."""

    attn_norm: Tensor | None
    mixer: Mixer | None
    ffn_norm: Tensor | None
    mlp: Mlp | Experts | MlpAndExperts | None
    post_attn_norm: Tensor | None = None
    post_ffn_norm: Tensor | None = None
    per_layer: PerLayerInput | None = None
    scalar: float = 1.0  # the block's output times this (Gemma 4's layer_scalar)


@dataclass(frozen=True)
class Weights:
    """Everything a decoder computes with; `lm_head` is `embed_tokens` when they are tied. A
    pipeline stage's holds only its part: None for the layers, embedding and head it does not run."""

    embed_tokens: Tensor | None
    layers: tuple[Layer | None, ...]
    final_norm: Tensor | None
    lm_head: Tensor | None
    rope_freqs: np.ndarray | None  # host f32 [head_dim / 2]: llama3 scaling baked per frequency (GGUF)
    per_layer: PerLayerEmbedding | None = None


@dataclass(frozen=True)
class _ExpertStack:
    """One projection of a layer's experts as stored: format, each expert's row blocks, one
    block's [out, in], and the stored tensors they view."""

    fmt: str
    blocks: list[list[RowBlock]]
    shape: tuple[int, ...]
    stored: list[WeightData]


class WeightSink(Protocol):
    """Where the builder puts tensors: a backend, or `_Sizes` (which only counts them)."""

    def upload_host_weight(self, weight: HostWeight) -> Tensor: ...

    def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Tensor: ...

    def weight_nbytes(self, dtype: str, shape: tuple[int, ...]) -> int: ...


def build_weights(loaded: LoadedModel, backend: Backend, stage: Stage | None = None) -> Weights:
    """Upload `loaded`'s weights to `backend` as a model's records, reserving their device memory
    first; a pipeline `stage` uploads only what it computes with (its layers; the embedding on
    the first stage, the final norm and head on the last)."""
    weights = _upload(loaded, backend, _Builder.build, stage)
    loaded.release_pages()  # every weight uploaded: the files' other pages need not stay resident either
    return weights


_Built = TypeVar("_Built")


def _upload(loaded: LoadedModel, backend: Backend, build: Callable[[_Builder], _Built],
            stage: Stage | None = None) -> _Built:
    """`build` twice: on `_Sizes` (the same decisions, uploading nothing: exact sizes), then, once
    the device memory is reserved, on the backend."""
    sizes = _Sizes(backend)
    sizing = _Builder(loaded, sizes, stage=stage)
    build(sizing)
    try:
        backend.reserve("weights", sizes.total)
    except OutOfDeviceMemory as exc:
        raise sizes.out_of_memory(loaded.path, exc, sizing.expert_weights) from None
    return build(_Builder(loaded, backend, release=True, stage=stage))


@dataclass(frozen=True)
class MtpInput:
    """What a multi-token-prediction head makes its layer's input from: fc([norm_embedding(e),
    norm_hidden(h)]) of a token's embedding e and the hidden state h it continues from."""

    norm_embedding: Tensor
    norm_hidden: Tensor
    fc: Linear


def build_mtp_weights(loaded: LoadedModel, backend: Backend, target: Weights,
                      own_head: bool = False) -> tuple[Weights, MtpInput]:
    """Upload an MTP head (`loaded`: the head as a model of its layers, vkrt/models/mtp.py) beside
    the target whose weights are `target`: its layers, final norm and input, and with `own_head`
    its own LM head (`mtp.lm_head`); the embedding, RoPE frequencies and otherwise the LM head
    are the target's own tensors, not copies."""
    return _upload(loaded, backend, lambda builder: builder.mtp(target, own_head))


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


class _Sizes:
    """Counts the device bytes each upload would take on `backend` (uploads nothing)."""

    name = "sizes"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.total = 0

    def upload_host_weight(self, weight: HostWeight) -> Tensor:
        self.total += self.backend.weight_nbytes(weight.dtype, weight.shape)
        return Tensor(weight.shape, weight.dtype, self, None)  # type: ignore[arg-type]  # never used

    def upload(self, array: np.ndarray, dtype: str | None = None, purpose: str = "activations") -> Tensor:
        self.total += self.backend.weight_nbytes("f32", array.shape)
        return Tensor(array.shape, "f32", self, None)  # type: ignore[arg-type]

    def weight_nbytes(self, dtype: str, shape: tuple[int, ...]) -> int:
        return int(self.backend.weight_nbytes(dtype, shape))

    def out_of_memory(self, path: str, exc: OutOfDeviceMemory, experts: list[tuple[str, HostWeight]]
                      ) -> OutOfDeviceMemory:
        """The reservation failed: say how much of it the stacked `experts` are and name the largest."""
        if not experts:
            return exc
        sized = [(self.backend.weight_nbytes(w.dtype, w.shape), name, w) for name, w in experts]
        size, name, largest = max(sized, key=lambda entry: entry[:2])  # ties: the later name
        return OutOfDeviceMemory(
            f"{path}: the weights need {_mib(self.total)} on the device, {_mib(sum(e[0] for e in sized))} "
            f"of it in {len(sized)} stacked expert tensors (the largest: {name}, {largest.dtype} "
            f"{list(largest.shape)}, {_mib(size)}): {exc}", requested=exc.requested, purpose="weights")


class _Builder:
    """Reads one LoadedModel into Weights on one sink (a backend, or `_Sizes`)."""

    def __init__(self, loaded: LoadedModel, sink: WeightSink, release: bool = False,
                 stage: Stage | None = None) -> None:
        self.config: ModelConfig = loaded.config
        self.stage = stage
        self.sink = sink
        self.path = loaded.path
        self.stored = loaded.weights
        self.release = loaded.release_pages if release else None  # after each upload
        self.expert_weights: list[tuple[str, HostWeight]] = []  # stacked expert weights, by canonical name

    def build(self) -> Weights:
        c = self.config
        stage = self.stage or Stage(0, c.num_layers, c.num_layers)
        embed = self.matrix([self.raw("embed_tokens")]) if stage.first or (stage.last and c.tie_word_embeddings) \
            else None
        freqs = self.stored.get("rope_freqs")
        return Weights(
            embed_tokens=embed,
            layers=tuple(self.layer(i) if i in stage.layers else None for i in range(c.num_layers)),
            final_norm=self.norm("final_norm") if stage.last else None,
            lm_head=(embed if c.tie_word_embeddings else self.matrix([self.raw("lm_head")])) if stage.last else None,
            rope_freqs=None if freqs is None else dequantize(freqs.data, freqs.fmt).reshape(-1),
            per_layer=PerLayerEmbedding(self.matrix([self.raw("per_layer.embed")]),
                                        self.linear(["per_layer.model_proj"]), self.norm("per_layer.model_norm"))
            if c.per_layer_input_size else None,
        )

    def mtp(self, target: Weights, own_head: bool) -> tuple[Weights, MtpInput]:
        """An MTP head's records (build_mtp_weights)."""
        layers = tuple(self.layer(i) for i in range(self.config.num_layers))
        lm_head = self.matrix([self.raw("mtp.lm_head")]) if own_head else target.lm_head
        weights = Weights(embed_tokens=target.embed_tokens, layers=layers, final_norm=self.norm("final_norm"),
                          lm_head=lm_head, rope_freqs=target.rope_freqs)
        return weights, MtpInput(self.norm("mtp.norm_embedding"), self.norm("mtp.norm_hidden"), self.linear(["mtp.fc"]))

    def layer(self, i: int) -> Layer:
        c = self.config
        p = f"layers.{i}."
        sandwich = c.sandwich_norms
        kind = c.layer(i)
        if kind.post_norms:  # OLMo 2's attention layers: a norm after each sublayer, none before
            return Layer(attn_norm=None, mixer=self.mixer(p, kind.mixer), ffn_norm=None,
                         mlp=self.experts(p) if kind.moe else self.mlp(p),
                         post_attn_norm=self.norm(p + "ffn_norm"), post_ffn_norm=self.norm(p + "post_ffn_norm"))
        if kind.mixer == "none" or not kind.mlp:  # one sublayer (Nemotron-H): the block's one norm
            norm = self.norm(p + "norm")
            return Layer(attn_norm=None if kind.mixer == "none" else norm,
                         mixer=None if kind.mixer == "none" else self.mixer(p, kind.mixer),
                         ffn_norm=norm if kind.mlp else None,
                         mlp=(self.experts(p) if kind.moe else self.mlp(p)) if kind.mlp else None)
        mixer = self.mixer(p, kind.mixer)
        if c.qk_l2_norm and kind.rope and isinstance(mixer, Attention):  # Llama 4: a norm without weights
            unit = self.f32(np.ones(c.head_dim, np.float32))
            mixer = replace(mixer, q_norm=unit, k_norm=unit)
        return Layer(
            attn_norm=self.norm(p + "attn_norm"),
            mixer=mixer,
            ffn_norm=self.norm(p + "ffn_norm"),
            mlp=(self.mlp_and_experts(p) if c.moe_beside_mlp else self.experts(p)) if kind.moe else self.mlp(p),
            post_attn_norm=self.norm(p + "post_attn_norm") if sandwich else None,
            post_ffn_norm=self.norm(p + "post_ffn_norm") if sandwich else None,
            per_layer=PerLayerInput(self.linear([p + "per_layer.gate"]), self.linear([p + "per_layer.proj"]),
                                    self.norm(p + "per_layer.norm")) if c.per_layer_input_size else None,
            scalar=float(self.vector(p + "layer_scalar")[0]) if p + "layer_scalar" in self.stored else 1.0,
        )

    def attention(self, p: str) -> Attention:
        c = self.config
        if c.v_norm:
            return self.normed_attention(p)
        gate: WeightData | None = None  # Qwen3.5's output gate, from the rows q_proj holds beside q
        if p + "qkv_proj" in self.stored:  # a fused checkpoint (Phi-3): stacked as stored
            qkv = self.linear([p + "qkv_proj"])
        else:  # a norm over all of q and of k (OLMoE) needs their outputs apart
            q: str | WeightData = p + "q_proj"
            if c.attn_output_gate:
                q, gate = self.query_and_gate(self.raw(p + "q_proj"))
            m = c.multipliers
            qkv = self.linear([self.scaled(q, m.attention_in), self.scaled(p + "k_proj", m.attention_in * m.key),
                               self.scaled(p + "v_proj", m.attention_in)],
                              biases=[p + n for n in ("q_bias", "k_bias", "v_bias")] if c.qkv_bias else (),
                              apart=c.qk_norm and not c.qk_norm_per_head)
        q_norm = self.norm(p + "q_norm") if c.qk_norm else None
        k_norm = self.norm(p + "k_norm") if c.qk_norm else None
        o_bias = [p + "o_bias"] if p + "o_bias" in self.stored else []
        return Attention(qkv, self.linear([self.scaled(p + "o_proj", c.multipliers.attention_out)], biases=o_bias),
                         q_norm, k_norm, gate=self.linear([gate]) if gate is not None else None,
                         sinks=self.f32(self.vector(p + "sinks")) if p + "sinks" in self.stored else None)

    def normed_attention(self, p: str) -> Attention:
        """Gemma 4 (q, k and v each normed per head): q|k|v stacked; k and v absent where the layer
        reads an earlier layer's cache; q and k apart where v is k's projection (K = V), whose norm
        without a weight is a vector of ones."""
        c = self.config
        i = int(p.split(".")[1])
        own, k_eq_v = c.kv_layer_of(i) == i, c.layer(i).k_eq_v
        parts = [p + "q_proj"]
        if own:
            parts += [p + "k_proj"] if k_eq_v else [p + "k_proj", p + "v_proj"]
        return Attention(self.linear(parts, apart=k_eq_v), self.linear([p + "o_proj"]), self.norm(p + "q_norm"),
                         self.norm(p + "k_norm") if own else None,
                         v_norm=self.f32(np.ones(c.head_dim_of(i), np.float32)) if own and k_eq_v else None)

    def mixer(self, p: str, kind: str) -> Mixer:
        if kind == "short_conv":
            return self.short_conv(p)
        if kind == "gated_delta_net":
            return self.gated_delta_net(p)
        if kind == "mamba2":
            return self.mamba2(p)
        if kind == "attention_mamba2":
            return AttentionMamba2(self.attention(p), self.mamba2(p))
        if kind == "mla":
            return self.latent_attention(p)
        return self.attention(p)

    def latent_attention(self, p: str) -> LatentAttention:
        """MLA's weights; the up-projection (one kv_b_proj, or llama.cpp's k_b and v_b per head)
        becomes the absorbed query and value matrices."""
        c = self.config
        heads, nope, v, rank = c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        if p + "kv_b_proj" in self.stored:  # per head: nope rows of W_uk, then v rows of W_uv
            kv_b = self.vector(p + "kv_b_proj").reshape(heads, nope + v, rank)
            w_uk_t, w_uv = kv_b[:, :nope].transpose(0, 2, 1), kv_b[:, nope:]
            uk_fmt = uv_fmt = self.raw(p + "kv_b_proj").fmt
        else:
            w_uk_t = self.vector(p + "k_b").reshape(heads, rank, nope)
            w_uv = self.vector(p + "v_b").reshape(heads, v, rank)
            uk_fmt, uv_fmt = self.raw(p + "k_b").fmt, self.raw(p + "v_b").fmt
        lora = c.q_lora_rank > 0
        return LatentAttention(
            q=self.linear([p + ("q_b_proj" if lora else "q_proj")]),
            q_a=self.linear([p + "q_a_proj"]) if lora else None,
            q_a_norm=self.norm(p + "q_a_norm") if lora else None,
            kv_a=self.linear([p + "kv_a_proj"]),
            kv_a_norm=self.norm(p + "kv_a_norm"),
            q_absorb=self.float_stack(p + "q_absorb", absorbed_query(w_uk_t, c.qk_rope_head_dim), uk_fmt),
            v_up=self.float_stack(p + "v_up", absorbed_value(w_uv, c.qk_rope_head_dim), uv_fmt),
            o=self.linear([p + "o_proj"]))

    def per_key_head(self, w: WeightData, sizes: tuple[int, ...]) -> list[WeightData]:
        """Qwen3-Next's projections hold per key head consecutive pieces of `sizes` rows: piece j
        of every key head, as one row selection each (nothing copied)."""
        heads, group, starts = self.config.linear_num_key_heads, sum(sizes), np.cumsum((0, *sizes))
        orders = [np.concatenate([g * group + np.arange(starts[j], starts[j + 1]) for g in range(heads)])
                  for j in range(len(sizes))]
        return [WeightData(f"{w.name}[{j}]", w.fmt, (o.size, *w.shape[1:]), w.data, o) for j, o in enumerate(orders)]

    def mamba2(self, p: str) -> Mamba2:
        c = self.config
        inner = c.mamba_num_heads * c.mamba_head_dim
        channels = inner + 2 * c.mamba_n_groups * c.mamba_state_size
        in_proj = self.raw(p + "mamba.in_proj")
        z, xbc, dt = (_rows(in_proj, start, stop) for start, stop in
                      ((0, inner), (inner, inner + channels), (inner + channels, in_proj.shape[0])))
        m = c.multipliers  # Falcon-H1's: its input times ssm_in, each of z, x, B, C, dt times its own
        bc = c.mamba_n_groups * c.mamba_state_size
        xbc_scale = np.repeat(np.float32(m.ssm_in) * np.array(m.ssm_zxbcdt[1:4], np.float32), (inner, bc, bc))
        bias = self.vector(p + "mamba.conv.bias") if c.conv_bias else np.zeros(channels, np.float32)
        return Mamba2(z=self.linear([self.scaled(z, m.ssm_in * m.ssm_zxbcdt[0])]),
                      xbc=self.linear([self.scaled(xbc, xbc_scale)]),
                      dt=self.linear([self.scaled(dt, m.ssm_in * m.ssm_zxbcdt[4])]),
                      conv_taps=self.f32(self.vector(p + "mamba.conv.weight").reshape(channels, c.conv_kernel)),
                      conv_bias=self.f32(bias), a_rate=self.f32(self.decay_rate(p, "mamba")),
                      skip=self.f32(self.vector(p + "mamba.D")), dt_bias=self.f32(self.vector(p + "mamba.dt_bias")),
                      norm=None if c.mamba_norm == "none" else self.f32(self.vector(p + "mamba.norm")),
                      out_proj=self.linear([self.scaled(p + "mamba.out_proj", m.ssm_out)]))

    def query_and_gate(self, q_proj: WeightData) -> tuple[WeightData, WeightData]:
        """Qwen3.5's q_proj holds per head its query rows, then its gate rows: the two as row
        selections of the stored tensor (nothing copied)."""
        c = self.config
        rows = np.arange(q_proj.shape[0]).reshape(c.num_heads, 2, c.head_dim)
        shape = (c.num_heads * c.head_dim, q_proj.shape[1])
        return (WeightData(q_proj.name + "[query]", q_proj.fmt, shape, q_proj.data, rows[:, 0].reshape(-1)),
                WeightData(q_proj.name + "[gate]", q_proj.fmt, shape, q_proj.data, rows[:, 1].reshape(-1)))

    def gated_delta_net(self, p: str) -> GatedDeltaNet:
        c = self.config
        channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        if p + "delta.conv_q" in self.stored:  # OLMo-hybrid: q, k and v convolved apart (depthwise: stacked)
            taps = np.concatenate([self.vector(p + f"delta.conv_{n}") for n in "qkv"]).reshape(channels, c.conv_kernel)
        else:
            taps = self.vector(p + "delta.conv.weight").reshape(channels, c.conv_kernel)
        qkv: list[str | WeightData] = [p + "delta.in_proj_qkv"]
        if p + "delta.in_proj_q" in self.stored:  # OLMo-hybrid: projected apart
            qkv = [p + "delta.in_proj_q", p + "delta.in_proj_k", p + "delta.in_proj_v"]
        z: list[str | WeightData] = [p + "delta.in_proj_z"]
        ba: list[str | WeightData] = [p + "delta.in_proj_b", p + "delta.in_proj_a"]
        r, dk, dv = c.linear_num_value_heads // c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        if p + "delta.in_proj_qkvz" in self.stored:  # Qwen3-Next: per key head [q, k, v, z]
            q, k, v, zs = self.per_key_head(self.raw(p + "delta.in_proj_qkvz"), (dk, dk, r * dv, r * dv))
            qkv, z = [q, k, v], [zs]
        if p + "delta.in_proj_ba" in self.stored:  # and per key head [b, a]
            ba = list(self.per_key_head(self.raw(p + "delta.in_proj_ba"), (r, r)))
        return GatedDeltaNet(
            qkv=self.linear(qkv), z=self.linear(z), ba=self.linear(ba),
            conv_taps=self.f32(taps), conv_bias=self.f32(np.zeros(channels, np.float32)),
            a_rate=self.f32(self.decay_rate(p, "delta")), dt_bias=self.f32(self.vector(p + "delta.dt_bias")),
            norm=self.f32(self.vector(p + "delta.norm")), out_proj=self.linear([p + "delta.out_proj"]))

    def short_conv(self, p: str) -> ShortConv:
        c = self.config
        taps = self.vector(p + "conv.weight").reshape(c.hidden_size, c.conv_kernel)
        bias = self.vector(p + "conv.bias") if c.conv_bias else np.zeros(c.hidden_size, np.float32)
        return ShortConv(self.linear([p + "conv.in_proj"]), self.f32(taps), self.f32(bias),
                         self.linear([p + "conv.out_proj"]))

    def decay_rate(self, p: str, mixer: str) -> np.ndarray:
        """A = -exp(A_log) of a delta net or Mamba2, in f32 as transformers computes it; llama.cpp's
        GGUF stores A itself."""
        if self.config.linear_decay_stored:
            return self.vector(f"{p}{mixer}.A")
        return -np.exp(self.vector(f"{p}{mixer}.A_log"))

    def mlp(self, p: str) -> Mlp:
        if self.config.hidden_act == "relu2":  # ungated: up alone
            return Mlp(self.linear([p + "up_proj"]), self.linear([p + "down_proj"]))
        m = self.config.multipliers  # Falcon-H1's: gate and down (their rows) times their own
        gate_up: list[str | WeightData] = [p + "gate_up_proj"]
        if p + "gate_up_proj" not in self.stored:
            gate_up = [self.scaled(p + "gate_proj", m.mlp_gate), p + "up_proj"]
        elif m.mlp_gate != 1.0:
            raise UnsupportedModelError(f"{self.path}: a gate multiplier on a stacked gate_up_proj is not supported")
        return Mlp(self.linear(gate_up), self.linear([self.scaled(p + "down_proj", m.mlp_down)]))

    def experts(self, p: str) -> Experts:
        c = self.config
        shared, shared_gate = None, None
        if c.shared_expert_intermediate_size:  # Qwen2-MoE's gated shared expert, or the layer's own MLP
            own = (not c.shared_expert_gated and p + "shared_expert.gate_proj" not in self.stored  # (HF Granite 4)
                   and p + "shared_expert.up_proj" not in self.stored)
            shared = self.mlp(p) if own else self.mlp(p + "shared_expert.")
            shared_gate = self.linear([p + "shared_expert_gate"]) if c.shared_expert_gated else None
        if p + "experts.gate_up_proj" in self.stored:  # stored as one [E, 2F, K] stack (Granite 4, Gemma 4)
            down = self.expert_stack(p, "down_proj")
            scale = self.vector(p + "router.expert_scale").reshape(-1, 1) if c.moe_beside_mlp else None
            return Experts(router=self.linear([p + "router"]),
                           gate_up=(self.experts_weight(p + "experts.gate_up_proj", self.expert_stack(p, "gate_up_proj")),),
                           down=self.experts_weight(p + "experts.down_proj", down), shared=shared, shared_gate=shared_gate,
                           expert_scale=None if scale is None else self.f32(scale))
        bias = None
        if self.config.moe_router == "sigmoid":
            values = self.vector(p + "expert_bias") if self.config.expert_bias else None
            bias = self.f32(values if values is not None else np.zeros(self.config.num_experts, np.float32))
        if c.hidden_act == "relu2":  # ungated experts (Nemotron-H): up alone
            up, down = self.expert_stack(p, "up_proj"), self.expert_stack(p, "down_proj")
            return Experts(router=self.linear([p + "router"]), gate_up=(self.experts_weight(p + "experts.up_proj", up),),
                           down=self.experts_weight(p + "experts.down_proj", down), shared=shared, bias=bias)
        router = self.linear([p + "router"], biases=[p + "router_bias"] if p + "router_bias" in self.stored else [])
        gate_up_bias = down_bias = None
        if p + "experts.down_bias" in self.stored:  # gpt-oss: each expert's biases, gate's and up's side by side
            f, h = c.moe_intermediate_size, c.hidden_size
            gate_up_bias = self.f32(np.concatenate([self.vector(p + f"experts.{n}_bias").reshape(-1, f)
                                                    for n in ("gate", "up")], axis=1))
            down_bias = self.f32(self.vector(p + "experts.down_bias").reshape(-1, h))
        gate, up, down = (self.expert_stack(p, n) for n in ("gate_proj", "up_proj", "down_proj"))
        if gate.fmt == up.fmt:  # one [E, 2F, K] stack, gate over up per expert
            both = _ExpertStack(gate.fmt, [g + u for g, u in zip(gate.blocks, up.blocks, strict=True)], gate.shape,
                                gate.stored + up.stored)
            gate_up: tuple[Tensor, ...] = (self.experts_weight(p + "experts.gate_up_proj", both),)
        else:  # kept in their own formats: two expert matmuls whose outputs are concatenated
            gate_up = (self.experts_weight(p + "experts.gate_proj", gate), self.experts_weight(p + "experts.up_proj", up))
        return Experts(router=router, gate_up=gate_up, down=self.experts_weight(p + "experts.down_proj", down),
                       shared=shared, shared_gate=shared_gate, bias=bias, gate_up_bias=gate_up_bias,
                       down_bias=down_bias)

    # -- pieces ---------------------------------------------------------------------------
    def raw(self, name: str) -> WeightData:
        try:
            return self.stored[name]
        except KeyError:
            raise ModelFormatError(f"{self.path}: missing weight {name!r}") from None

    def linear(self, names: Sequence[str | WeightData], biases: Sequence[str] = (), apart: bool = False) -> Linear:
        """One projection from its stored pieces (names, or row selections of stored tensors):
        one stacked matrix when they share a storage format (and need not stay apart), else one
        matrix per piece; a bias per piece or none."""
        parts = [self.raw(n) if isinstance(n, str) else n for n in names]
        bias_values = [self.vector(n) for n in biases]
        if len(parts) == 1 or (not apart and len({w.fmt for w in parts}) == 1):
            bias = self.f32(np.concatenate(bias_values)) if bias_values else None
            return Linear((self.matrix(parts),), (bias,))
        return Linear(tuple(self.matrix([w]) for w in parts),
                      tuple(self.f32(b) for b in bias_values) if bias_values else (None,) * len(parts))

    def matrix(self, parts: list[WeightData]) -> Tensor:
        """Matrices of one format stacked along their rows, as one device tensor."""
        first = parts[0]
        shape = (sum(w.shape[0] for w in parts), *first.shape[1:])
        return self.upload(HostWeight(first.fmt, shape, (tuple(w.block() for w in parts),)),
                           "+".join(w.name for w in parts), parts)

    def mlp_and_experts(self, p: str) -> MlpAndExperts:
        c = self.config
        router_scale = self.vector(p + "router.scale") * np.float32(c.hidden_size ** -0.5)
        return MlpAndExperts(self.mlp(p), self.norm(p + "post_ffn_norm_1"), self.experts(p), self.norm(p + "ffn_norm_2"),
                             self.norm(p + "post_ffn_norm_2"), self.f32(router_scale))

    def expert_stack(self, p: str, projection: str) -> _ExpertStack:
        """One projection of layer p's experts: from llama.cpp's stacked [E, out, in] tensor or
        HF's one tensor per expert (all in one format, else refused naming the odd one)."""
        experts = self.config.num_experts
        stacked = self.stored.get(f"{p}experts.{projection}")
        if stacked is not None:
            per_expert = stacked.data.reshape(experts, stacked.shape[1], -1)
            return _ExpertStack(stacked.fmt, [[RowBlock(m)] for m in per_expert], stacked.shape[1:], [stacked])
        tensors = [self.raw(f"{p}experts.{e}.{projection}") for e in range(experts)]
        odd = next((w for w in tensors if w.fmt != tensors[0].fmt), None)
        if odd is not None:
            raise UnsupportedModelError(
                f"{self.path}: expert weight {odd.name} is {odd.fmt} while {tensors[0].name} is {tensors[0].fmt}; "
                "the experts of one projection must share a storage format (convert the checkpoint to one dtype)")
        return _ExpertStack(tensors[0].fmt, [[w.block()] for w in tensors], tensors[0].shape, tensors)

    def experts_weight(self, name: str, stack: _ExpertStack) -> Tensor:
        """One stacked [E, rows, in] expert weight from each expert's row blocks."""
        rows = sum(b.num_rows for b in stack.blocks[0])
        weight = HostWeight(stack.fmt, (len(stack.blocks), rows, stack.shape[-1]), tuple(map(tuple, stack.blocks)))
        self.expert_weights.append((name, weight))
        return self.upload(weight, name, stack.stored)

    def upload(self, weight: HostWeight, name: str, stored: list[WeightData]) -> Tensor:
        """Upload `weight`, then release the file pages of the `stored` tensors it was made of
        (the peak then holds one weight's file pages at a time, not the whole file's)."""
        try:
            tensor = self.sink.upload_host_weight(weight)
        except OutOfDeviceMemory as exc:
            size = self.sink.weight_nbytes(weight.dtype, weight.shape)
            raise OutOfDeviceMemory(f"{self.path}: weight {name} ({weight.dtype} {list(weight.shape)}, {_mib(size)} on "
                                    f"the device) does not fit: {exc}", requested=exc.requested,
                                    purpose="weights") from None
        if self.release is not None:
            self.release(stored)
        return tensor

    def scaled(self, weight: str | WeightData, factor: float | np.ndarray) -> str | WeightData:
        """`weight` with its rows times `factor` (one, or one per row) as they are uploaded: a muP
        multiplier folded in (float formats only: a GGUF has them folded by its converter)."""
        if np.all(np.asarray(factor) == 1.0):
            return weight
        w = self.raw(weight) if isinstance(weight, str) else weight
        if w.fmt not in ("f32", "f16", "bf16"):
            raise UnsupportedModelError(f"{self.path}: weight {w.name} is {w.fmt}; multipliers fold into float weights only")
        scale = np.broadcast_to(np.asarray(factor, np.float32), (w.shape[0],)).copy()
        if w.row_scale is not None:
            scale *= w.row_scale
        return WeightData(w.name, w.fmt, w.shape, w.data, w.row_order, scale)

    def float_stack(self, name: str, stack: np.ndarray, source_fmt: str) -> Tensor:
        """A stacked [E, rows, in] matrix made at load (f32 values), uploaded as an expert weight in
        its source's float format when that is f16 or bf16 (which hold its values exactly: zeros,
        ones and the source's own), else in f32 (an f32 or block-format source)."""
        if source_fmt == "bf16":
            stored, fmt = f32_to_bf16(stack), "bf16"
        elif source_fmt == "f16":
            stored, fmt = stack.astype(np.float16), "f16"
        else:
            stored, fmt = np.asarray(stack, np.float32), "f32"
        matrices = tuple((RowBlock(np.ascontiguousarray(m)),) for m in stored)
        return self.upload(HostWeight(fmt, stack.shape, matrices), name, [])

    def vector(self, name: str) -> np.ndarray:
        w = self.raw(name)
        return dequantize(w.data, w.fmt).reshape(-1).astype(np.float32)

    def f32(self, values: np.ndarray) -> Tensor:
        return self.sink.upload(np.ascontiguousarray(values, dtype=np.float32), "f32", purpose="weights")

    def norm(self, name: str) -> Tensor:
        """A norm's scale as f32; HF Gemma stores w of (1 + w), folded here once."""
        return self.f32(self.vector(name) + np.float32(self.config.norm_offset))


def _rows(w: WeightData, start: int, stop: int) -> WeightData:
    """Rows start .. stop - 1 of a stored weight, as a row selection (nothing copied)."""
    order = np.arange(start, stop) if w.row_order is None else w.row_order[start:stop]
    scale = None if w.row_scale is None else w.row_scale[start:stop]
    return WeightData(f"{w.name}[{start}:{stop}]", w.fmt, (stop - start, *w.shape[1:]), w.data, order, scale)
