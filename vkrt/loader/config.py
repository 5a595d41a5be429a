"""The normalised model description every loader produces."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkrt.core.host_weight import RowBlock


@dataclass(frozen=True)
class LayerConfig:
    """What can differ between the layers of one model (Gemma's local/global, Mistral's window)."""

    window: int = 0  # sliding window W: attend to positions p - W < j <= p; 0 = full attention
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # transformers' rope_parameters minus rope_theta
    rope: bool = True  # False: no positional rotation at all (SmolLM3's NoPE layers)
    moe: bool = False  # the MLP is a mixture of experts (ModelConfig.num_experts), not dense
    # The token mixer: "attention" (paged attention over the KV cache) or a recurrent mixer with
    # a fixed-size state per sequence: "short_conv" (LFM2's gated convolution),
    # "gated_delta_net" (Qwen3.5's linear attention), "mamba2" (Granite 4's selective scan);
    # "attention_mamba2": both side by side on the same input, their outputs summed (Falcon-H1);
    # "mla": multi-head latent attention over a cache of one latent row per token (DeepSeek-V3);
    # or "none": the block is only its MLP (Nemotron-H).
    mixer: str = "attention"
    mlp: bool = True  # False: the block is only its mixer (Nemotron-H)
    post_norms: bool = False  # OLMo 2's order: no norm before attention or MLP, one after each
    # Gemma 4's per-layer shapes (0: the model's head_dim / num_kv_heads / intermediate_size): its
    # full-attention layers have wider heads (and, with K = V, their own KV head count), the layers
    # that reuse another's K/V a double-wide MLP.
    head_dim: int = 0
    num_kv_heads: int = 0
    intermediate_size: int = 0
    kv_layer: int = -1  # the earlier layer whose K/V cache this layer reads and never writes; -1: its own
    k_eq_v: bool = False  # the values are the keys' projection (no v_proj), normed without RoPE
    chunked: bool = False  # the window is chunk-aligned: floor(p / W) * W <= j <= p (Llama 4's chunked attention)

    @property
    def attends(self) -> bool:
        """The layer attends over a KV cache (alone, or beside a recurrent mixer)."""
        return self.mixer in ("attention", "attention_mamba2", "mla")

    @property
    def recurrent(self) -> str:
        """The layer's recurrent mixer, whose state lives in a slot per sequence ("" if none)."""
        if self.mixer == "attention_mamba2":
            return "mamba2"
        return "" if self.mixer in ("attention", "mla", "none") else self.mixer


@dataclass(frozen=True)
class Multipliers:
    """Falcon-H1's muP multipliers, each folded into the rows of the weight it scales as that
    weight is uploaded (llama.cpp's converter folds them into a GGUF's weights, so a GGUF has
    none): attention's input (q, k, v) and output, the keys again, Mamba2's input and output,
    its in_proj's five row ranges z | x | B | C | dt, and the MLP's gate and down."""

    attention_in: float = 1.0
    key: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm_zxbcdt: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, normalised from config.json or GGUF metadata.

    The family traits below the hyper-parameters default to Llama's; loaders set them from
    the architecture table and the file, so a model reads them and never its family name.
    """

    architecture: str  # registry key, e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # -- family traits --------------------------------------------------------------------
    layers: tuple[LayerConfig, ...] = ()  # one per layer; empty = every layer full with rope_theta/scaling
    qkv_bias: bool = False  # q/k/v projections add a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # attention and MLP outputs are normed before the residual add (Gemma 2/3)
    norm_offset: float = 0.0  # norms scale by (offset + w): 1.0 for HF Gemma, already folded in GGUF
    embedding_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden))
    query_scale: float = 0.0  # attention score scale; 0 = 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c); 0 = off (Gemma 2)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c); 0 = off (Gemma 2)
    residual_scale: float = 1.0  # attention and MLP outputs times this before the residual add (Granite)
    logit_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    qk_norm_per_head: bool = True  # QK-norm over each head; False: over all of q and of k (OLMoE)
    rotary_dim: int = 0  # RoPE rotates the first rotary_dim dims of each head (partial rotary); 0 = all
    rope_interleaved: bool = False  # RoPE pairs (2i, 2i + 1) instead of (i, i + rotated / 2) (ERNIE 4.5)
    # Queries times 1 + beta * ln(1 + floor(p / length)) after RoPE (Ministral 3's llama_4_scaling_beta,
    # length its original context); beta 0 = none.
    query_temperature_beta: float = 0.0
    query_temperature_length: int = 0
    # Llama 4's attention temperature tuning: positions counted from 1 (p + 1 for p), unrotated layers only.
    query_temperature_shift: int = 0
    query_temperature_nope_only: bool = False
    qk_l2_norm: bool = False  # an RMS norm of each q and k head with no weight, on rotated layers (Llama 4)
    # -- recurrent mixers (layers whose LayerConfig.recurrent is set) -------------------------
    conv_kernel: int = 0  # taps K of the depthwise causal convolution (LFM2's conv_L_cache)
    conv_bias: bool = False  # the convolution adds a bias per channel
    # Gated delta nets: key heads (each serving num_v / num_k value heads) and their dims.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Mamba2: heads of head_dim, n_groups of B and C of state_size, dt's limits (time_step_limit).
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 0
    mamba_state_size: int = 0
    mamba_dt_min: float = 0.0
    mamba_dt_max: float = float("inf")
    # The gated output norm: "after_gate" rms_norm(y * silu(z)) * w (Mamba2's, Granite 4's),
    # "before_gate" rms_norm(y) * w * silu(z), or "none": y * silu(z) (Falcon-H1's options).
    mamba_norm: str = "after_gate"
    multipliers: Multipliers = Multipliers()  # folded into the weights (Falcon-H1)
    # A GGUF as llama.cpp converts it: value heads tiled over key heads; A = -exp(A_log) stored
    # (delta.A, mamba.A) instead of A_log.
    linear_v_heads_tiled: bool = False
    linear_decay_stored: bool = False
    linear_beta_scale: float = 1.0  # 2: beta in [0, 2], the state's eigenvalues may go negative (OLMo-hybrid)
    linear_norm_eps: float = 0.0  # the delta net's gated output norm's eps (0: rms_norm_eps)
    attn_output_gate: bool = False  # attention output times sigmoid of a per-head gate from q_proj (Qwen3.5)
    # -- multi-head latent attention (layers whose LayerConfig.mixer is "mla") ----------------
    # The cache holds per token one row of head_dim = qk_rope_head_dim + kv_lora_rank: the roped
    # key shared by every head, then the normed latent (rope first: the rope op rotates a head's
    # first dims). Queries are [q_rope, W_uk^T q_nope] per head; q_lora_rank 0: q_proj, no q LoRA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    v_norm: bool = False  # each value head RMS-normed (no weight) before it is cached (Gemma 4)
    # Gemma 4's per-layer embeddings: a second table [per_layer_vocab_size, layers * this] whose
    # slice, with a projection of the embeddings, gates a residual branch at the end of every layer.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # -- mixture of experts (layers whose LayerConfig.moe is set) -------------------------
    num_experts: int = 0  # E; 0 = every MLP is dense
    num_experts_per_tok: int = 0  # k experts per token
    moe_intermediate_size: int = 0  # one expert's FFN width
    norm_topk_prob: bool = False  # the k router weights are renormalised to sum to 1
    # A dense gated MLP every token runs beside the experts, scaled by sigmoid of its own gate
    # (Qwen2-MoE's shared_expert and shared_expert_gate); 0 = none.
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # False: the shared expert is added as it is (Granite 4)
    # Gemma 4's MoE: the dense MLP (normed input and output) plus the experts (their own input and
    # output norms; the router reads the unnormed residual through a norm of its own), their sum normed.
    moe_beside_mlp: bool = False
    # "softmax" (the k largest logits, softmax weights) or "sigmoid" (LFM2-MoE: sigmoid scores,
    # chosen with a per-expert bias when expert_bias, weights times routed_scaling_factor).
    moe_router: str = "softmax"
    moe_input_scaled: bool = False  # the router weight scales the expert's input, not its output (Llama 4)
    expert_bias: bool = False
    routed_scaling_factor: float = 1.0
    # The sigmoid router: the eps added to the chosen weights' sum when renormalising (LFM2-MoE
    # 1e-6, Nemotron-H 1e-20), and its expert groups: only the moe_top_groups best of moe_groups
    # consecutive groups are chosen from (Nemotron-H's and DeepSeek-V3's n_group, topk_group).
    router_norm_eps: float = 1e-6
    moe_groups: int = 1
    moe_top_groups: int = 1
    # gpt-oss's clamped SwiGLU of the experts: gate <= limit, |up| <= limit, gate * sigmoid(alpha *
    # gate) * (up + 1); limit 0 = the plain activation of hidden_act.
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # -- pooling (vkrt/loader/pooling.py) -----------------------------------------------------
    num_labels: int = 0  # a sequence-classification head of this many labels is the LM head; 0 = a causal LM
    classifier_labels: tuple[str, ...] = ()  # the head's label names, where the file gives them (GGUF rank)
    pooling: str = ""  # the checkpoint's declared pooling: "last", "mean", "cls"; "" = none declared
    pooling_normalize: bool = True  # L2-normalise embeddings (a sentence-transformers model without Normalize: no)
    matryoshka: bool = False  # embeddings may be truncated to fewer dimensions (the `dimensions` field)

    def layer(self, i: int) -> LayerConfig:
        """Layer i's mixer, attention window and rope settings."""
        if self.layers:
            return self.layers[i]
        return LayerConfig(0, self.rope_theta, self.rope_scaling)

    def head_dim_of(self, i: int) -> int:
        return self.layer(i).head_dim or self.head_dim

    def kv_heads_of(self, i: int) -> int:
        return self.layer(i).num_kv_heads or self.num_kv_heads

    def ffn_width_of(self, i: int) -> int:
        return self.layer(i).intermediate_size or self.intermediate_size

    def kv_layer_of(self, i: int) -> int:
        """The layer whose K/V cache layer i attends over (itself unless it shares an earlier one's)."""
        source = self.layer(i).kv_layer
        return i if source < 0 else source


@dataclass
class WeightData:
    """One weight as stored on disk: `shape` is logical (out_features, in_features) or (n,).

    `fmt` is a row of vkrt.core.formats.FORMATS: float formats hold typed arrays (bf16 as
    uint16), block formats the GGUF bytes, one row of blocks per output row. `data` is the
    file's bytes (a view of its memory map); `row_order`, when set, is the order its rows take
    in vkrt's layout (row j of the weight is data[row_order[j]]), applied when the rows are
    read (`rows()`, `block()`), so the file's rows are never copied to reorder them."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    data: np.ndarray  # float formats: float32/float16/uint16(bf16); block formats: uint8 [rows, row_bytes]
    row_order: np.ndarray | None = None
    row_scale: np.ndarray | None = None  # f32 [rows]: each row times its factor as it is read (floats only)

    def rows(self) -> np.ndarray:
        """The weight's rows in vkrt's order (a view of `data` unless they are reordered or scaled)."""
        return self.block().rows()

    def block(self) -> RowBlock:
        """The weight as a row block of a HostWeight (no copy)."""
        return RowBlock(self.data, self.row_order, self.row_scale)


@dataclass
class LoadedModel:
    """What `vkrt.loader.load_model` returns."""

    path: str
    config: ModelConfig
    weights: dict[str, WeightData]
    file_type: str = ""  # e.g. "Q4_1", "F32", "BF16"
    metadata: dict[str, Any] = field(default_factory=dict)
    # The multi-token-prediction head, by canonical name (empty: the file has none, or its form is
    # not one vkrt loads); uploaded only for {"method": "mtp"} speculation (vkrt/models/mtp.py).
    mtp_weights: dict[str, WeightData] = field(default_factory=dict)

    def release_pages(self, weights: Iterable[WeightData] | None = None) -> None:
        """Once weights are uploaded: drop the resident pages of the file bytes they map (all
        the files' pages when `weights` is None). The weights stay readable (a page comes back
        from its file when read), but the process no longer holds the file's bytes beside their
        device copy, which on a unified-memory device is host memory too."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # not Linux: leave the pages to the kernel
            return
        for w in self.weights.values() if weights is None else weights:
            mapped, root = _mapping_of(w.data)
            if mapped is None or root is None:
                continue  # not a view of a file (a copy, or an array made in memory)
            start = 0 if weights is None else w.data.ctypes.data - root.ctypes.data
            length = len(mapped) if weights is None else w.data.nbytes
            first = start - start % mmap.PAGESIZE
            with contextlib.suppress(OSError, ValueError):  # a closed map, or a kernel that refuses
                mapped.madvise(mmap.MADV_DONTNEED, first, min(len(mapped), start + length) - first)


def _mapping_of(array: np.ndarray) -> tuple[mmap.mmap | None, np.ndarray | None]:
    """The file map an array views, and the array at the map's first byte (numpy keeps the map
    as `_mmap` on every view of a memmap; the loaders map whole files from offset 0)."""
    mapped = getattr(array, "_mmap", None)
    if not isinstance(mapped, mmap.mmap):
        return None, None
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return mapped, root
