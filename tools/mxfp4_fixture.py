"""The MXFP4 gpt-oss fixtures, for tools/family_fixtures.py.

tiny_gpt_oss_mxfp4_gguf: tiny_gpt_oss_gguf (llama.cpp's converter's f32 file) with its expert
stacks quantized to MXFP4 by the `gguf` package, as llama.cpp stores gpt-oss's experts (the
converter writes MXFP4 only from checkpoints already in it). The golden is transformers' forward
of tiny_gpt_oss with each expert weight replaced by its MXFP4 values (dequantized exactly), so the
quantization is the only change and the reference stays HF's.

tiny_gpt_oss_mxfp4: the same MXFP4 values as a Hugging Face checkpoint in the layout gpt-oss is
released in (`quantization_config` {"quant_method": "mxfp4"}, each expert stack as `*_blocks`
codes beside `*_scales` exponents, everything else tiny_gpt_oss's). The tool checks that
transformers' own MXFP4 decoder gives the GGUF's values from it, and the golden is transformers
loading that directory (dequantized to f32 on the CPU) and running it.

Alone, from the committed fixtures (tiny_gpt_oss and tiny_gpt_oss_mxfp4_gguf):

    .venv-tools/bin/python tools/mxfp4_fixture.py
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

FIXTURE = "tiny_gpt_oss_mxfp4_gguf"


def make_mxfp4_gguf(fixtures: Path, model: Any, prompts: list[list[int]], golden_for: Any, sha256_file: Any) -> None:
    import gguf
    import torch

    t0 = time.time()
    out_dir = fixtures / FIXTURE
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    reader = gguf.GGUFReader(fixtures / "tiny_gpt_oss_gguf" / "model.gguf")
    writer = gguf.GGUFWriter(str(out_dir / "model.gguf"), str(reader.fields["general.architecture"].contents()))
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer's own
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, f.contents(), f.types[0], f.types[-1] if array else None)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    experts: dict[str, np.ndarray] = {}  # tensor name -> its MXFP4 values, [E, out, in]
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith("_exps.weight"):
            blocks = gguf.quants.quantize(data, mxfp4)
            experts[t.name] = gguf.quants.dequantize(blocks, mxfp4)
            writer.add_tensor(t.name, blocks, raw_dtype=mxfp4)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            e = layer.mlp.experts  # gate_up_proj [E, hidden, 2F] (gate columns even), down_proj [E, F, hidden]
            for j, part in enumerate(("gate", "up")):
                e.gate_up_proj[:, :, j::2] = torch.from_numpy(experts[f"blk.{i}.ffn_{part}_exps.weight"]).transpose(1, 2)
            e.down_proj.copy_(torch.from_numpy(experts[f"blk.{i}.ffn_down_exps.weight"]).transpose(1, 2))
    gold = golden_for(model, FIXTURE, "mxfp4", {
        "family": "GptOss",
        "model_file": "model.gguf",
        "description": "tiny_gpt_oss_gguf with its expert stacks quantized to MXFP4 (the gguf package's "
                       "quantizer); golden = transformers' tiny_gpt_oss with those MXFP4 values as its expert weights",
        "tie_word_embeddings": False,
        "rope_scaling": model.config.rope_parameters,
        "model_sha256": sha256_file(out_dir / "model.gguf"),
    }, prompts)
    (out_dir / "golden.json").write_text(json.dumps(gold, separators=(",", ":")) + "\n")
    print(f"{FIXTURE}: {time.time() - t0:.1f}s", flush=True)


HF_FIXTURE = "tiny_gpt_oss_mxfp4"
QUANTIZATION_CONFIG = {"quant_method": "mxfp4",
                       "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"]}


def hf_halves(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's MXFP4 rows (uint8 [..., G * 17]: an exponent, then 16 bytes with element i in
    the low nibble of byte i and element i + 16 in its high one) as gpt-oss's checkpoint halves:
    codes [..., G, 16] with elements 2i and 2i + 1 in byte i's low and high nibble, exponents [..., G]."""
    blocks = rows.reshape(rows.shape[:-1] + (-1, 17))
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., G, 32] in element order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed), np.ascontiguousarray(blocks[..., 0])


def make_mxfp4_hf(fixtures: Path, prompts: list[list[int]], golden_for: Any, sha256_file: Any) -> None:
    import gguf
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    t0 = time.time()
    out_dir = fixtures / HF_FIXTURE
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    config = json.loads((fixtures / "tiny_gpt_oss" / "config.json").read_text())
    tensors = load_file(fixtures / "tiny_gpt_oss" / "model.safetensors")
    reader = gguf.GGUFReader(fixtures / FIXTURE / "model.gguf")
    raw = {t.name: np.asarray(t.data) for t in reader.tensors if t.name.endswith("_exps.weight")}
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate, up = raw[f"blk.{i}.ffn_gate_exps.weight"], raw[f"blk.{i}.ffn_up_exps.weight"]  # [E, F, H*17/32]
        fused = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.uint8)
        fused[:, 0::2], fused[:, 1::2] = gate, up  # gpt-oss interleaves gate and up rows
        for name, rows in (("gate_up_proj", fused), ("down_proj", raw[f"blk.{i}.ffn_down_exps.weight"])):
            blocks, scales = hf_halves(rows)
            # transformers' decoder must give the values the GGUF fixture's golden ran with
            mine = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            values = gguf.quants.dequantize(rows, mxfp4)  # [E, out, in]
            if not np.array_equal(mine.numpy(), values.transpose(0, 2, 1)):
                raise SystemExit(f"{HF_FIXTURE}: {p}{name}: transformers decodes other values than the GGUF's")
            del tensors[p + name]
            tensors[p + name + "_blocks"], tensors[p + name + "_scales"] = blocks, scales
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG},
                                                    indent=2) + "\n")
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    gold = golden_for(model, HF_FIXTURE, "mxfp4", {
        "family": "GptOss",
        "description": "tiny_gpt_oss_mxfp4_gguf's MXFP4 expert values as a Hugging Face checkpoint in gpt-oss's "
                       "released layout (*_blocks / *_scales, quantization_config mxfp4); golden = transformers "
                       "loading this directory (dequantized to f32) and running it",
        "tie_word_embeddings": False,
        "rope_scaling": config.get("rope_parameters"),
        "model_sha256": sha256_file(out_dir / "model.safetensors"),
    }, prompts)
    (out_dir / "golden.json").write_text(json.dumps(gold, separators=(",", ":")) + "\n")
    print(f"{HF_FIXTURE}: {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_fixtures import golden_for, sha256_file

    root = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    prompts = [case["input_ids"] for case in json.loads((root / FIXTURE / "golden.json").read_text())["cases"]]
    make_mxfp4_hf(root, prompts, golden_for, sha256_file)
