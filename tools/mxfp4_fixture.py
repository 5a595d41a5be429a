"""tiny_gpt_oss_mxfp4_gguf, for tools/family_fixtures.py: tiny_gpt_oss_gguf (llama.cpp's converter's
f32 file) with its expert stacks quantized to MXFP4 by the `gguf` package, as llama.cpp stores
gpt-oss's experts (the converter writes MXFP4 only from checkpoints already in it). The golden is
transformers' forward of tiny_gpt_oss with each expert weight replaced by its MXFP4 values
(dequantized exactly), so the quantization is the only change and the reference stays HF's.
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
