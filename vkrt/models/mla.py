"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4 MoE Lite) with its up-projections absorbed.

Per token the cache holds one row [k_rope, c_kv]: the key's rope part every head shares (roped)
and the normed latent c_kv of kv_lora_rank, instead of every head's key and value. Head h's key
is [W_uk_h c_kv, k_rope] and its value W_uv_h c_kv, so with q_h = [q_nope, q_rope]

    q_h . k_h = (W_uk_h^T q_nope) . c_kv + q_rope . k_rope    and    sum_j p_j v_j = W_uv_h sum_j p_j c_kv_j:

attention runs as MQA with one KV head of head_dim rope + kv_lora over the cached rows
themselves, the query [q_rope, W_uk_h^T q_nope] and the value the same row (llama.cpp's absorbed
form). One per-head matmul (`absorbed_query`, an identity on the rope dims) makes the queries;
another (`absorbed_value`, zero on the rope dims, which the value row also carries) takes each
head's latent output up to v_head_dim before o_proj. Both are expert matmuls with head h as
expert h. Prefill runs the same form, so a token's bits do not depend on its step's shape.
"""

from __future__ import annotations

import numpy as np


def absorbed_query(w_uk_t: np.ndarray, rope: int) -> np.ndarray:
    """[H, rope + kv_lora, nope + rope] from W_uk^T [H, kv_lora, nope]: per head, rows that copy q's
    rope dims (q is [nope, rope] per head), then W_uk^T over its nope dims."""
    heads, rank, nope = w_uk_t.shape
    out = np.zeros((heads, rope + rank, nope + rope), np.float32)
    out[:, :rope, nope:] = np.eye(rope, dtype=np.float32)
    out[:, rope:, :nope] = w_uk_t
    return out


def absorbed_value(w_uv: np.ndarray, rope: int) -> np.ndarray:
    """[H, v, rope + kv_lora] from W_uv [H, v, kv_lora]: zero over the cached row's rope dims."""
    heads, v, rank = w_uv.shape
    out = np.zeros((heads, v, rope + rank), np.float32)
    out[:, :, rope:] = w_uv
    return out
