"""Write a synthetic MoE / dense benchmark pair as GGUF files (random weights).

    python tools/make_moe_bench.py --out build/moe_bench [--quant q4_k|q8_0|q4_0|f16|f32] [--layers 8]

moe.gguf is a Qwen3-MoE (architecture `qwen3moe`): hidden 1024, 8 layers, 32 experts, 4 chosen
per token, expert FFN 512. dense.gguf is a Qwen3 (`qwen3`) with the same attention and a dense
FFN of 4 x 512 = 2048, so both run the same number of weights per token (the MoE adds only its
1024 x 32 router). The matrices are quantized (Q4_K by default, by `quantize_q4_k` below; the
others by the gguf package); norms and the router stay F32. The weights are random (normal,
std 0.02), so the text is noise; the pair exists to time the MoE decode step and prefill
against the dense one with `vkrt bench --model FILE` and `tools/bench_peers.py --model FILE`.
Both files embed a small byte-level BPE vocabulary (tools/synthetic_model.py's `vocabulary`), because llama.cpp
loads no GGUF without one; vkrt's bench feeds token ids and does not need it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_model import add_vocabulary  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 16, 4, 64, 8192
EXPERTS, TOP_K, EXPERT_FFN = 32, 4, 512
QUANTS = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q8_0": gguf.GGMLQuantizationType.Q8_0,
          "q4_0": gguf.GGMLQuantizationType.Q4_0, "f16": gguf.GGMLQuantizationType.F16}


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K blocks of f32 rows (K a multiple of 256): the gguf package has no Q4_K encoder.

    Per 32-value sub-block j, an affine 4-bit grid: value = d * sc_j * q - dmin * m_j, q in
    0..15, with sc_j and m_j 6-bit multiples of the super-block's f16 d and dmin. Plain
    rounding, no search for the best grid (enough for random benchmark weights). The byte
    layout is ggml's block_q4_K: d, dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes
    of nibbles (sub-blocks 2c and 2c + 1 share bytes 32c..32c + 31, low then high nibble).
    """
    rows = values.shape[0]
    x = values.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)
    step = np.maximum((x.max(axis=2) - lo) / 15.0, 1e-12)
    d = (step.max(axis=1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(step / np.where(d32 > 0, d32, 1.0)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / np.where(dmin32 > 0, dmin32, 1.0)), 0, 63).astype(np.uint8)
    scale = (d32 * sc)[:, :, None]
    q = np.clip(np.rint((x + (dmin32 * mn)[:, :, None]) / scale), 0, 15).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, nibbles],
                            axis=1)
    return blocks.reshape(rows, -1)


def _writer(path: Path, arch: str, layers: int, ffn: int) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    add_vocabulary(w, VOCAB)
    return w


def _add(w: gguf.GGUFWriter, name: str, value: np.ndarray, quant: str) -> None:
    if value.ndim == 1 or quant == "f32":
        w.add_tensor(name, value.astype(np.float32))
    elif quant == "f16":
        w.add_tensor(name, value.astype(np.float16))
    elif quant == "q4_k":
        shape = value.shape
        w.add_tensor(name, quantize_q4_k(value.reshape(-1, shape[-1])).reshape(*shape[:-1], -1),
                     raw_dtype=QUANTS[quant])
    else:
        w.add_tensor(name, quantize(value, QUANTS[quant]), raw_dtype=QUANTS[quant])


def _write(path: Path, arch: str, layers: int, quant: str, rng: np.random.Generator) -> None:
    moe = arch == "qwen3moe"
    w = _writer(path, arch, layers, EXPERT_FFN if moe else TOP_K * EXPERT_FFN)
    if moe:
        w.add_expert_feed_forward_length(EXPERT_FFN)
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(TOP_K)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    _add(w, "token_embd.weight", rand(VOCAB, HIDDEN), quant)
    _add(w, "output_norm.weight", np.ones(HIDDEN, np.float32), quant)
    _add(w, "output.weight", rand(VOCAB, HIDDEN), quant)
    for i in range(layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            _add(w, p + name + ".weight", np.ones(HIDDEN, np.float32), quant)
        for name in ("attn_q_norm", "attn_k_norm"):
            _add(w, p + name + ".weight", np.ones(HEAD_DIM, np.float32), quant)
        _add(w, p + "attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN), quant)
        _add(w, p + "attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), quant)
        _add(w, p + "attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), quant)
        _add(w, p + "attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM), quant)
        if moe:
            w.add_tensor(p + "ffn_gate_inp.weight", rand(EXPERTS, HIDDEN))  # the router stays F32
            _add(w, p + "ffn_gate_exps.weight", rand(EXPERTS, EXPERT_FFN, HIDDEN), quant)
            _add(w, p + "ffn_up_exps.weight", rand(EXPERTS, EXPERT_FFN, HIDDEN), quant)
            _add(w, p + "ffn_down_exps.weight", rand(EXPERTS, HIDDEN, EXPERT_FFN), quant)
        else:
            _add(w, p + "ffn_gate.weight", rand(TOP_K * EXPERT_FFN, HIDDEN), quant)
            _add(w, p + "ffn_up.weight", rand(TOP_K * EXPERT_FFN, HIDDEN), quant)
            _add(w, p + "ffn_down.weight", rand(HIDDEN, TOP_K * EXPERT_FFN), quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/moe_bench"))
    parser.add_argument("--quant", choices=sorted(QUANTS) + ["f32"], default="q4_k")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for arch, name in (("qwen3moe", "moe.gguf"), ("qwen3", "dense.gguf")):
        _write(args.out / name, arch, args.layers, args.quant, np.random.default_rng(args.seed))
        print(args.out / name)


if __name__ == "__main__":
    main()
