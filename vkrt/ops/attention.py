"""Rotary embedding, the paged KV cache write and paged attention.

Layouts: activations are [T, heads * head_dim]. The KV cache of one layer is
[num_blocks, block_size, kv_heads * head_dim] in f32, f16 or q8_0 (vkrt/core/kv_format.py, the
formats' spec); a token's slot is block * block_size + offset. `block_table[s]` lists sequence s's blocks in order; token t of the batch belongs to
sequence `seq_index[t]` at position `positions[t]` and attends to positions 0..positions[t].
"""

from __future__ import annotations

import numpy as np

from vkrt.core import kv_format
from vkrt.core.op import register_op, require
from vkrt.core.tensor import KV_Q8_0, TensorSpec
from vkrt.ops.linear import _rms_norm_matmul_infer, rms_norm_matmul
from vkrt.ops.norm import rms_norm

KV_DTYPES = ("f32", "f16", KV_Q8_0)  # cache tensor dtypes (kv_format.tensor_dtype of each format)


def rope_inv_freq(rot_dim: int, theta: float) -> np.ndarray:
    """RoPE's unscaled inverse frequencies theta^(-2i / rot_dim), i < rot_dim / 2, in float64:
    the one definition, which rope scaling adjusts."""
    return 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)


def rope_cos_sin(max_positions: int, rot_dim: int, theta: float,
                 inv_freq: np.ndarray | None = None) -> np.ndarray:
    """[P, rot_dim] float32 table: cos in the first half, sin in the second (float64 math);
    inv_freq defaults to rope_inv_freq(rot_dim, theta)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rot_dim, theta)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def _rope_infer(x: TensorSpec, positions: TensorSpec, cos_sin: TensorSpec, head_dim: int,
                interleaved: bool = False) -> tuple[TensorSpec, ...]:
    specs = (x, positions, cos_sin)
    require(x.dtype == "f32" and len(x.shape) == 2 and x.shape[1] % head_dim == 0, "rope", specs,
            f"x must be f32 [T, heads * {head_dim}]")
    require(positions.dtype == "i32" and positions.shape == (x.shape[0],), "rope", specs,
            "positions must be i32 [T]")
    require(cos_sin.dtype == "f32" and len(cos_sin.shape) == 2 and cos_sin.shape[1] % 2 == 0
            and cos_sin.shape[1] <= head_dim, "rope", specs, "cos_sin must be f32 [P, rot_dim <= head_dim]")
    return (x,)


@register_op("rope", _rope_infer)
def rope(x: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray, head_dim: int,
         interleaved: bool = False) -> np.ndarray:
    """Rotate the first rot_dim dims of each head: NeoX pairs (i, i + rot/2) or pairs (2i, 2i+1)."""
    t = x.shape[0]
    half = cos_sin.shape[1] // 2
    heads = x.reshape(t, -1, head_dim).astype(np.float32).copy()
    cos = cos_sin[positions, :half][:, None, :]
    sin = cos_sin[positions, half:][:, None, :]
    if interleaved:
        a, b = heads[..., 0 : 2 * half : 2].copy(), heads[..., 1 : 2 * half : 2].copy()
        heads[..., 0 : 2 * half : 2] = a * cos - b * sin
        heads[..., 1 : 2 * half : 2] = b * cos + a * sin
    else:
        a, b = heads[..., :half].copy(), heads[..., half : 2 * half].copy()
        heads[..., :half] = a * cos - b * sin
        heads[..., half : 2 * half] = b * cos + a * sin
    return heads.reshape(t, -1)


def _kv_write_infer(k_cache: TensorSpec, v_cache: TensorSpec, k: TensorSpec, v: TensorSpec,
                    slots: TensorSpec) -> tuple[TensorSpec, ...]:
    specs = (k_cache, v_cache, k, v, slots)
    require(k_cache == v_cache and k_cache.dtype in KV_DTYPES and len(k_cache.shape) == 3,
            "kv_write", specs, f"caches must be equal [blocks, block_size, kv_dim] in {KV_DTYPES}")
    require(k == v and k.dtype == "f32" and k.shape[1:] == k_cache.shape[2:], "kv_write", specs,
            "k and v must be f32 [T, kv_dim] matching the cache")
    require(slots.dtype == "i32" and slots.shape == (k.shape[0],), "kv_write", specs, "slots must be i32 [T]")
    return ()


@register_op("kv_write", _kv_write_infer, inplace=(0, 1))
def kv_write(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slots: np.ndarray) -> None:
    """Store each token's k and v at its slot in the cache's format; slots < 0 are padding."""
    stored = slots >= 0
    kv_format.write_rows(k_cache, slots[stored], k[stored])
    kv_format.write_rows(v_cache, slots[stored], v[stored])


def _require_kv_format(cache: TensorSpec, num_kv_heads: int, head_dim: int, name: str,
                       specs: tuple[TensorSpec, ...]) -> None:
    kv_dtype = "q8_0" if cache.dtype == KV_Q8_0 else cache.dtype
    why = kv_format.unsupported(kv_dtype, num_kv_heads, head_dim)
    require(why is None, name, specs, f"this cache format does not fit the heads: {why}")


def _paged_infer(q: TensorSpec, k_cache: TensorSpec, v_cache: TensorSpec, block_table: TensorSpec,
                 seq_index: TensorSpec, positions: TensorSpec, num_heads: int, num_kv_heads: int,
                 scale: float, window: int = 0, softcap: float = 0.0,
                 chunked: bool = False) -> tuple[TensorSpec, ...]:
    specs = (q, k_cache, v_cache, block_table, seq_index, positions)
    name = "paged_attention"
    require(q.dtype == "f32" and len(q.shape) == 2 and q.shape[1] % num_heads == 0, name, specs,
            "q must be f32 [T, heads * head_dim]")
    head_dim = q.shape[1] // num_heads
    require(k_cache == v_cache and k_cache.dtype in KV_DTYPES and len(k_cache.shape) == 3
            and k_cache.shape[2] == num_kv_heads * head_dim, name, specs,
            "caches must be [blocks, block_size, kv_heads * head_dim]")
    require(num_heads % num_kv_heads == 0, name, specs, "num_heads must be a multiple of num_kv_heads")
    _require_kv_format(k_cache, num_kv_heads, head_dim, name, specs)
    require(block_table.dtype == "i32" and len(block_table.shape) == 2, name, specs,
            "block_table must be i32 [S, max_blocks]")
    require(seq_index.dtype == "i32" and positions.dtype == "i32"
            and seq_index.shape == positions.shape == (q.shape[0],), name, specs,
            "seq_index and positions must be i32 [T]")
    require(window >= 0, name, specs, f"window must be >= 0 (0: full attention), got {window}")
    require(not chunked or 0 < window < CHUNKED_WINDOW, name, specs,
            f"a chunked window must be in 1..{CHUNKED_WINDOW - 1}, got {window}")
    require(softcap >= 0.0 and np.isfinite(softcap), name, specs, f"softcap must be >= 0 (0: off), got {softcap}")
    return (q,)


# A long prompt is attended in chunks of its tokens so that one KV head's scores, [tokens * group,
# context] float64, stay within 8 MiB. Smaller chunks run faster alone (2 MiB: 0.33 s against
# 0.41 s on a 2048-token prompt) but make more BLAS calls, each stalling on its threads while
# another process holds a core (a 2000-token prompt through SmolLM2 on 2 busy cores: 100 s
# against 65 s).
SCORES_PER_CHUNK = 1 << 20
# The kernels take a chunked window as its width with this bit set (include/chunk_merge.glsl).
CHUNKED_WINDOW = 1 << 31


@register_op("paged_attention", _paged_infer)
def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_table: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
                    num_heads: int, num_kv_heads: int, scale: float, window: int = 0,
                    softcap: float = 0.0, chunked: bool = False) -> np.ndarray:
    """Causal GQA of each token over its sequence's cached positions 0..positions[t].

    window W > 0: only positions j with p - W < j <= p (HF's sliding window, Mistral/Gemma);
    with `chunked`, j in the W-aligned chunk of p: floor(p / W) * W <= j <= p (Llama 4's chunked
    attention). softcap c > 0: scores become c * tanh(scores / c) before the softmax.
    """
    return _paged(q, k_cache, v_cache, block_table, seq_index, positions, num_heads, num_kv_heads, scale,
                  window, softcap, None, chunked)


def _paged_sinks_infer(q: TensorSpec, k_cache: TensorSpec, v_cache: TensorSpec, block_table: TensorSpec,
                       seq_index: TensorSpec, positions: TensorSpec, sinks: TensorSpec, num_heads: int,
                       num_kv_heads: int, scale: float, window: int = 0,
                       softcap: float = 0.0, chunked: bool = False) -> tuple[TensorSpec, ...]:
    out = _paged_infer(q, k_cache, v_cache, block_table, seq_index, positions, num_heads, num_kv_heads, scale,
                       window, softcap, chunked)
    require(sinks.dtype == "f32" and sinks.shape == (num_heads,), "paged_attention_sinks", (q, sinks),
            f"sinks must be f32 [num_heads] ({num_heads})")
    return out


@register_op("paged_attention_sinks", _paged_sinks_infer)
def paged_attention_sinks(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                          seq_index: np.ndarray, positions: np.ndarray, sinks: np.ndarray, num_heads: int,
                          num_kv_heads: int, scale: float, window: int = 0, softcap: float = 0.0,
                          chunked: bool = False) -> np.ndarray:
    """paged_attention with an attention sink per head (gpt-oss): a learned logit sinks[h] that
    joins head h's softmax denominator and weighs no value, so a row's weights sum to less than 1.
    The sink is a raw logit (not scaled, not capped), as transformers concatenates it."""
    return _paged(q, k_cache, v_cache, block_table, seq_index, positions, num_heads, num_kv_heads, scale,
                  window, softcap, np.asarray(sinks, np.float64), chunked)


def _paged(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
           seq_index: np.ndarray, positions: np.ndarray, num_heads: int, num_kv_heads: int, scale: float,
           window: int, softcap: float, sinks: np.ndarray | None, chunked: bool = False) -> np.ndarray:
    group = num_heads // num_kv_heads
    out = np.zeros_like(q, dtype=np.float32)  # padding rows (seq_index < 0) stay zero
    for seq in np.unique(seq_index[seq_index >= 0]):
        tokens = np.flatnonzero(seq_index == seq)
        per_chunk = max(1, SCORES_PER_CHUNK // (group * (int(positions[tokens].max()) + 1)))
        for chunk in np.split(tokens, range(per_chunk, len(tokens), per_chunk)):
            out[chunk] = _attend_sequence(q[chunk], positions[chunk], k_cache, v_cache, block_table[seq],
                                          num_heads, num_kv_heads, scale, window, softcap, sinks, chunked)
    return out


def _attend_sequence(q: np.ndarray, positions: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     blocks: np.ndarray, num_heads: int, num_kv_heads: int, scale: float, window: int,
                     softcap: float, sinks: np.ndarray | None, chunked: bool = False) -> np.ndarray:
    """Tokens q [T, heads * hd] of one sequence (block-table row `blocks`) at `positions`, each
    over the cached positions it sees -> [T, heads * hd]."""
    t, hd = q.shape[0], q.shape[1] // num_heads
    group = num_heads // num_kv_heads
    pos = np.arange(int(positions.max()) + 1)
    seen = pos <= positions[:, None]  # [T, L]
    if chunked:
        seen &= pos >= positions[:, None] // window * window
    elif window > 0:
        seen &= pos > positions[:, None] - window
    read = seen.any(axis=0)  # only positions some token sees: entries that left a window are NULL
    pos, seen = pos[read], seen[:, read]
    block_size = k_cache.shape[1]
    slots = blocks[pos // block_size] * block_size + pos % block_size
    keys, values = kv_format.read_rows(k_cache, slots), kv_format.read_rows(v_cache, slots)
    seen_rows = np.repeat(seen, group, axis=0)  # rows (token, query head of the group)
    out = np.empty((t, num_heads * hd), np.float32)
    for kvh in range(num_kv_heads):  # read by query heads kvh * group .. (kvh + 1) * group - 1
        kv_cols, q_cols = slice(kvh * hd, (kvh + 1) * hd), slice(kvh * group * hd, (kvh + 1) * group * hd)
        row_sinks = None if sinks is None else np.tile(sinks[kvh * group : (kvh + 1) * group], t)
        heads = _attend(q[:, q_cols].reshape(t * group, hd), keys[:, kv_cols], values[:, kv_cols],
                        seen_rows, scale, softcap, row_sinks)
        out[:, q_cols] = heads.reshape(t, group * hd)
    return out


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, seen: np.ndarray, scale: float,
            softcap: float, sinks: np.ndarray | None = None) -> np.ndarray:
    """Query rows q [R, hd] over context k/v [L, hd], row r seeing the positions where seen[r]:
    -> [R, hd], in float64. softcap c > 0 maps each score s to c * tanh(s / c) before the
    softmax (Gemma 2's attn_logit_softcapping); sinks [R] (float64) join each row's denominator."""
    s = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
    if softcap > 0.0:
        s = softcap * np.tanh(s / softcap)
    s = np.where(seen, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None])
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sinks[:, None] - top)
    return ((p / total) @ v.astype(np.float64)).astype(np.float32)


def _qkv_rope_kv_write_infer(qkv: TensorSpec, positions: TensorSpec, cos_sin: TensorSpec,
                             k_cache: TensorSpec, v_cache: TensorSpec, slots: TensorSpec,
                             num_heads: int, num_kv_heads: int, head_dim: int,
                             interleaved: bool = False) -> tuple[TensorSpec, ...]:
    specs = (qkv, positions, cos_sin, k_cache, v_cache, slots)
    name = "qkv_rope_kv_write"
    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    require(head_dim > 0 and num_kv_heads > 0 and num_heads % num_kv_heads == 0, name, specs,
            "num_heads must be a positive multiple of num_kv_heads")
    require(qkv.dtype == "f32" and len(qkv.shape) == 2 and qkv.shape[1] == q_width + 2 * kv_dim, name,
            specs, f"qkv must be f32 [T, (num_heads + 2 * num_kv_heads) * {head_dim}]")
    t = qkv.shape[0]
    _require_kv_format(k_cache, num_kv_heads, head_dim, name, specs)
    _rope_infer(TensorSpec((t, q_width), "f32"), positions, cos_sin, head_dim, interleaved)
    _kv_write_infer(k_cache, v_cache, TensorSpec((t, kv_dim), "f32"), TensorSpec((t, kv_dim), "f32"), slots)
    return (TensorSpec((t, q_width), "f32"),)


@register_op("qkv_rope_kv_write", _qkv_rope_kv_write_infer, inplace=(3, 4))
def qkv_rope_kv_write(qkv: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray,
                      k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, num_heads: int,
                      num_kv_heads: int, head_dim: int, interleaved: bool = False) -> np.ndarray:
    """Split stacked qkv, rope q and k, store rope(k) and v at their slots; returns rope(q)."""
    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    q = rope(qkv[:, :q_width], positions, cos_sin, head_dim, interleaved)
    k = rope(qkv[:, q_width : q_width + kv_dim], positions, cos_sin, head_dim, interleaved)
    kv_write(k_cache, v_cache, k, qkv[:, q_width + kv_dim :], slots)
    return q


def _qkv_norm_rope_kv_write_infer(qkv: TensorSpec, q_norm: TensorSpec, k_norm: TensorSpec,
                                  positions: TensorSpec, cos_sin: TensorSpec, k_cache: TensorSpec,
                                  v_cache: TensorSpec, slots: TensorSpec, eps: float, num_heads: int,
                                  num_kv_heads: int, head_dim: int, interleaved: bool = False,
                                  v_norm: bool = False) -> tuple[TensorSpec, ...]:
    out = _qkv_rope_kv_write_infer(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads,
                                   num_kv_heads, head_dim, interleaved)
    specs = (qkv, q_norm, k_norm)
    require(q_norm.dtype == k_norm.dtype == "f32" and q_norm.shape == k_norm.shape == (head_dim,),
            "qkv_norm_rope_kv_write", specs, f"q_norm and k_norm must be f32 [{head_dim}]")
    return out


@register_op("qkv_norm_rope_kv_write", _qkv_norm_rope_kv_write_infer, inplace=(5, 6))
def qkv_norm_rope_kv_write(qkv: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, positions: np.ndarray,
                           cos_sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
                           eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                           interleaved: bool = False, v_norm: bool = False) -> np.ndarray:
    """qkv_rope_kv_write after a per-head RMSNorm of q and k (QK-norm: Qwen3, Gemma 3); with
    `v_norm`, of each v head too, without a weight (Gemma 4)."""
    t = qkv.shape[0]
    q_width, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    q = rms_norm(qkv[:, :q_width].reshape(-1, head_dim), q_norm, eps).reshape(t, q_width)
    k = rms_norm(qkv[:, q_width : q_width + kv_dim].reshape(-1, head_dim), k_norm, eps).reshape(t, kv_dim)
    v = qkv[:, q_width + kv_dim :]
    if v_norm:
        v = rms_norm(v.reshape(-1, head_dim), np.ones(head_dim, np.float32), eps).reshape(t, kv_dim)
    normed = np.concatenate([q, k, v], axis=1)
    return qkv_rope_kv_write(normed, positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads,
                             head_dim, interleaved)


def _rms_norm_qkv_rope_kv_write_infer(x: TensorSpec, g: TensorSpec, w: TensorSpec, positions: TensorSpec,
                                      cos_sin: TensorSpec, k_cache: TensorSpec, v_cache: TensorSpec,
                                      slots: TensorSpec, eps: float, num_heads: int, num_kv_heads: int,
                                      head_dim: int, interleaved: bool = False) -> tuple[TensorSpec, ...]:
    (qkv,) = _rms_norm_matmul_infer(x, g, w, eps)
    return _qkv_rope_kv_write_infer(qkv, positions, cos_sin, k_cache, v_cache, slots, num_heads,
                                    num_kv_heads, head_dim, interleaved)


@register_op("rms_norm_qkv_rope_kv_write", _rms_norm_qkv_rope_kv_write_infer, inplace=(5, 6))
def rms_norm_qkv_rope_kv_write(x: np.ndarray, g: np.ndarray, w: np.ndarray, positions: np.ndarray,
                               cos_sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                               slots: np.ndarray, eps: float, num_heads: int, num_kv_heads: int,
                               head_dim: int, interleaved: bool = False) -> np.ndarray:
    """qkv_rope_kv_write(rms_norm_matmul(x, g, w, eps), ...): a pre-norm attention block's input."""
    return qkv_rope_kv_write(rms_norm_matmul(x, g, w, eps), positions, cos_sin, k_cache, v_cache, slots,
                             num_heads, num_kv_heads, head_dim, interleaved)


def _latent_kv_write_infer(kv_a: TensorSpec, w: TensorSpec, positions: TensorSpec, cos_sin: TensorSpec,
                           cache: TensorSpec, slots: TensorSpec, eps: float,
                           interleaved: bool = False) -> tuple[TensorSpec, ...]:
    specs = (kv_a, w, positions, cos_sin, cache, slots)
    name = "latent_kv_write"
    require(kv_a.dtype == w.dtype == "f32" and len(kv_a.shape) == 2 and len(w.shape) == 1
            and 0 < w.shape[0] < kv_a.shape[1], name, specs,
            "kv_a must be f32 [T, rank + rope] and the latent's norm weight f32 [rank]")
    rank, width = w.shape[0], kv_a.shape[1]
    require(cache.dtype in KV_DTYPES and len(cache.shape) == 3 and cache.shape[2] == width, name, specs,
            f"the cache must be [blocks, block_size, rank + rope = {width}] in {KV_DTYPES}")
    _require_kv_format(cache, 1, width, name, specs)
    k_rope = TensorSpec((kv_a.shape[0], width - rank), "f32")
    _rope_infer(k_rope, positions, cos_sin, width - rank, interleaved)
    require(cos_sin.shape[1] == width - rank, name, specs, f"cos_sin must rotate all {width - rank} rope dims")
    require(slots.dtype == "i32" and slots.shape == (kv_a.shape[0],), name, specs, "slots must be i32 [T]")
    return ()


@register_op("latent_kv_write", _latent_kv_write_infer, inplace=(4,))
def latent_kv_write(kv_a: np.ndarray, w: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray, cache: np.ndarray,
                    slots: np.ndarray, eps: float, interleaved: bool = False) -> None:
    """Multi-head latent attention's cache write: of each token's kv_a row [latent, k_rope] (as
    kv_a_proj_with_mqa makes it), the row [rope(k_rope), rms_norm(latent) * w] at its slot (< 0:
    padding), which is the layer's key and its value (vkrt/models/mla.py)."""
    rank = w.shape[0]
    row = np.concatenate([rope(kv_a[:, rank:], positions, cos_sin, kv_a.shape[1] - rank, interleaved),
                          rms_norm(kv_a[:, :rank], w, eps)], axis=1)
    stored = slots >= 0
    kv_format.write_rows(cache, slots[stored], row[stored])
