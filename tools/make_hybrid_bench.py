"""Write synthetic hybrid / dense benchmark models as Hugging Face directories (random f16 weights).

    python tools/make_hybrid_bench.py --out build/hybrid_bench [--layers 12] [--hidden 1024]

hybrid/ is a Qwen3.5 (`Qwen3_5ForCausalLM`): gated delta nets in three of every four layers (8 key
heads of 128, 16 value heads of 128, conv kernel 4), gated attention with partial rotary in the
fourth (8 query heads of 128, 2 KV heads), a SwiGLU MLP of 3 x hidden. dense/ is a Qwen3
(`Qwen3ForCausalLM`) of the same hidden size and attention shape in every layer, its MLP widened
so that both hold the same weight bytes (printed). mamba2/ is a Granite 4 hybrid
(`GraniteMoeHybridForCausalLM`, no experts): Mamba2 in three of every four layers (2 x hidden
inner channels in heads of 64, one group, state size 128, conv kernel 4, as Granite 4.0-H's),
attention of the same shape in the fourth, a SwiGLU MLP of 3 x hidden. The weights are random (normal, std 0.02; norms
at 1), so the text is noise; they exist to time a hybrid's decode step and prefill against a
dense model's, and each recurrent mixer's prefill kernels, with `vkrt bench --model DIR`. No tokenizer: vkrt's bench feeds token ids.
Needs only numpy and safetensors (the runtime's own dependencies).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB, HEADS, KV_HEADS, HEAD_DIM = 8192, 8, 2, 128
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 8, 16, 128, 128, 4
MAMBA_HEAD_DIM, MAMBA_STATE = 64, 128


def _common(hidden: int, layers: int, ffn: int) -> dict:
    return {"vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2}


def _attention(rng: np.random.Generator, p: str, hidden: int, gated: bool) -> dict[str, np.ndarray]:
    q_rows = HEADS * HEAD_DIM * (2 if gated else 1)  # Qwen3.5's q_proj holds a gate per head beside q
    return {p + "self_attn.q_proj.weight": _w(rng, q_rows, hidden),
            p + "self_attn.k_proj.weight": _w(rng, KV_HEADS * HEAD_DIM, hidden),
            p + "self_attn.v_proj.weight": _w(rng, KV_HEADS * HEAD_DIM, hidden),
            p + "self_attn.o_proj.weight": _w(rng, hidden, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": _norm(HEAD_DIM, gated), p + "self_attn.k_norm.weight": _norm(HEAD_DIM, gated)}


def _delta_net(rng: np.random.Generator, p: str, hidden: int) -> dict[str, np.ndarray]:
    channels = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
    return {p + "linear_attn.in_proj_qkv.weight": _w(rng, channels, hidden),
            p + "linear_attn.in_proj_z.weight": _w(rng, V_HEADS * V_DIM, hidden),
            p + "linear_attn.in_proj_b.weight": _w(rng, V_HEADS, hidden),
            p + "linear_attn.in_proj_a.weight": _w(rng, V_HEADS, hidden),
            p + "linear_attn.conv1d.weight": _w(rng, channels, 1, CONV),
            p + "linear_attn.A_log": np.log(rng.uniform(1, 16, V_HEADS)).astype(np.float16),
            p + "linear_attn.dt_bias": np.ones(V_HEADS, np.float16),
            p + "linear_attn.norm.weight": np.ones(V_DIM, np.float16),
            p + "linear_attn.out_proj.weight": _w(rng, hidden, V_HEADS * V_DIM)}


def _mamba2(rng: np.random.Generator, p: str, hidden: int) -> dict[str, np.ndarray]:
    inner = 2 * hidden
    heads, channels = inner // MAMBA_HEAD_DIM, inner + 2 * MAMBA_STATE
    return {p + "mamba.in_proj.weight": _w(rng, inner + channels + heads, hidden),
            p + "mamba.conv1d.weight": _w(rng, channels, 1, CONV), p + "mamba.conv1d.bias": np.zeros(channels, np.float16),
            p + "mamba.A_log": np.log(rng.uniform(1, 16, heads)).astype(np.float16),
            p + "mamba.D": np.ones(heads, np.float16), p + "mamba.dt_bias": np.ones(heads, np.float16),
            p + "mamba.norm.weight": np.ones(inner, np.float16),
            p + "mamba.out_proj.weight": _w(rng, hidden, inner)}


def _granite_mlp(rng: np.random.Generator, p: str, hidden: int, ffn: int) -> dict[str, np.ndarray]:
    return {p + "shared_mlp.input_linear.weight": _w(rng, 2 * ffn, hidden),
            p + "shared_mlp.output_linear.weight": _w(rng, hidden, ffn),
            p + "input_layernorm.weight": _norm(hidden, False), p + "post_attention_layernorm.weight": _norm(hidden, False)}


def _mlp(rng: np.random.Generator, p: str, hidden: int, ffn: int, offset: bool) -> dict[str, np.ndarray]:
    return {p + "mlp.gate_proj.weight": _w(rng, ffn, hidden), p + "mlp.up_proj.weight": _w(rng, ffn, hidden),
            p + "mlp.down_proj.weight": _w(rng, hidden, ffn),
            p + "input_layernorm.weight": _norm(hidden, offset), p + "post_attention_layernorm.weight": _norm(hidden, offset)}


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)


def _norm(n: int, offset: bool) -> np.ndarray:
    return np.zeros(n, np.float16) if offset else np.ones(n, np.float16)  # Qwen3.5 stores w of (1 + w)


def _write(out: Path, config: dict, tensors: dict[str, np.ndarray]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(tensors, str(out / "model.safetensors"))
    return sum(t.nbytes for t in tensors.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/hybrid_bench"))
    ap.add_argument("--layers", type=int, default=12, help="a multiple of 4 (every 4th layer is attention)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hidden, layers, rng = args.hidden, args.layers, np.random.default_rng(args.seed)
    ffn = 3 * hidden
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    hybrid = {"model.embed_tokens.weight": _w(rng, VOCAB, hidden), "model.norm.weight": _norm(hidden, True)}
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        hybrid |= _attention(rng, p, hidden, True) if kind == "full_attention" else _delta_net(rng, p, hidden)
        hybrid |= _mlp(rng, p, hidden, ffn, True)
    hybrid_config = {**_common(hidden, layers, ffn), "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                     "layer_types": kinds, "linear_num_key_heads": K_HEADS, "linear_num_value_heads": V_HEADS,
                     "linear_key_head_dim": K_DIM, "linear_value_head_dim": V_DIM, "linear_conv_kernel_dim": CONV,
                     "hidden_act": "silu", "partial_rotary_factor": 0.25,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    hybrid_bytes = _write(args.out / "hybrid", hybrid_config, hybrid)
    # The dense model: Qwen3 attention in every layer, its MLP as wide as makes the bytes equal.
    attention_bytes = 2 * hidden * (HEADS + 2 * KV_HEADS + HEADS) * HEAD_DIM
    per_layer = (hybrid_bytes - 2 * VOCAB * hidden) / layers - attention_bytes
    dense_ffn = int(per_layer / (2 * 3 * hidden)) // 128 * 128
    dense = {"model.embed_tokens.weight": _w(rng, VOCAB, hidden), "model.norm.weight": _norm(hidden, False)}
    for i in range(layers):
        p = f"model.layers.{i}."
        dense |= _attention(rng, p, hidden, False) | _mlp(rng, p, hidden, dense_ffn, False)
    dense_config = {**_common(hidden, layers, dense_ffn), "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                    "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    dense_bytes = _write(args.out / "dense", dense_config, dense)
    mamba = {"model.embed_tokens.weight": _w(rng, VOCAB, hidden), "model.norm.weight": _norm(hidden, False)}
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        if kind == "full_attention":  # Granite's attention has no q / k norms
            mamba |= {k: w for k, w in _attention(rng, p, hidden, False).items() if not k.endswith("_norm.weight")}
        else:
            mamba |= _mamba2(rng, p, hidden)
        mamba |= _granite_mlp(rng, p, hidden, ffn)
    mamba_config = {**_common(hidden, layers, ffn), "architectures": ["GraniteMoeHybridForCausalLM"],
                    "model_type": "granitemoehybrid", "layer_types": kinds, "hidden_act": "silu",
                    "shared_intermediate_size": ffn, "num_local_experts": 0, "num_experts_per_tok": 0,
                    "mamba_n_heads": 2 * hidden // MAMBA_HEAD_DIM, "mamba_d_head": MAMBA_HEAD_DIM,
                    "mamba_n_groups": 1, "mamba_d_state": MAMBA_STATE, "mamba_d_conv": CONV, "mamba_expand": 2,
                    "mamba_conv_bias": True, "mamba_proj_bias": False, "position_embedding_type": "rope",
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}, "embedding_multiplier": 1.0,
                    "attention_multiplier": HEAD_DIM ** -0.5, "residual_multiplier": 1.0, "logits_scaling": 1.0}
    mamba_bytes = _write(args.out / "mamba2", mamba_config, mamba)
    print(f"{args.out / 'hybrid'}: {hybrid_bytes / 2**20:.1f} MiB of weights ({layers} layers, "
          f"{kinds.count('linear_attention')} delta nets)")
    print(f"{args.out / 'dense'}: {dense_bytes / 2**20:.1f} MiB of weights (FFN {dense_ffn})")
    print(f"{args.out / 'mamba2'}: {mamba_bytes / 2**20:.1f} MiB of weights ({layers} layers, "
          f"{kinds.count('linear_attention')} Mamba2)")


if __name__ == "__main__":
    main()
