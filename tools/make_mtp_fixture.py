"""The multi-token-prediction (MTP) fixtures: tiny checkpoints with the MTP heads Qwen3.5,
Qwen3-Next, GLM-4.5 and DeepSeek-V3 ship, and goldens for them composed from transformers' own
modules.

transformers loads these checkpoints but drops the heads (`_keys_to_ignore_on_load_unexpected`):
it has no MTP forward. So the golden is composed here from transformers' pieces, in the form
vLLM serves these heads in. For position i, with the target model's final-norm hidden state h_i
and the token after it:

    x_i = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])
    y_i = the head's decoder layer(x_i)  (the family's attention layer, causal over the positions)
    logits_i = head(norm(y_i))           -> a guess for t_{i+2}

and a further guess runs the head again at position i + 1 on its own guess and its own state.
Qwen's form (`mtp.*`: fc, pre_fc_norm_embedding / _hidden, norm, layers.0; vLLM's
qwen3_next_mtp) continues from norm(y_i) and uses the target's LM head. DeepSeek-V3's and
GLM-4.5's (layer `num_hidden_layers`: eh_proj, enorm, hnorm, shared_head.norm / .head, and a
copy of embed_tokens; vLLM's deepseek_mtp / glm4_moe_mtp) zero the embedding at position 0,
continue from y_i, and use shared_head.head: a copy of lm_head as released checkpoints have it
(tiny_glm4_moe_mtp), or a head of its own (tiny_deepseek_v3_mtp, so both paths are tested).
The norms are the family's RMSNorm, the layer its decoder layer class, the embedding the target's.
The head's weights are random (seeded, normal 0.1; norms 0.1 around their initial value); the
rest of the checkpoint is the committed base fixture's, unchanged, so transformers' logits for
the target equal the base fixture's (checked).

The `*_mtp_gguf` fixtures are those checkpoints through llama.cpp's own converter, its MTP layer
written as llama.cpp writes it (a block after the main ones with `nextn.*` tensors,
`nextn_predict_layers`); their golden is the HF fixture's. DeepSeek-V3 has none: the converter
wrote its file without the MTP layer.

From the committed base fixtures, in the tools venv (the converter as tools/family_fixtures.py
finds it):

    .venv-tools/bin/python tools/make_mtp_fixture.py
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
# fixture -> (base fixture, transformers model module, its class prefix, form)
MTP_FIXTURES = {
    "tiny_qwen3_5_mtp": ("tiny_qwen3_5", "qwen3_5", "Qwen3_5", "qwen"),
    "tiny_qwen3_next_mtp": ("tiny_qwen3_next", "qwen3_next", "Qwen3Next", "qwen"),
    "tiny_glm4_moe_mtp": ("tiny_glm4_moe", "glm4_moe", "Glm4Moe", "deepseek"),
    "tiny_deepseek_v3_mtp": ("tiny_deepseek_v3", "deepseek_v3", "DeepseekV3", "deepseek own head"),
}
# Converted to GGUF by llama.cpp's converter with their MTP layer.
CONVERTED = ("tiny_qwen3_5_mtp", "tiny_qwen3_next_mtp", "tiny_glm4_moe_mtp")
SEED = 20261207
PROMPT = [(37 * i + 11) % 256 for i in range(24)]
GUESSES = 3  # the chained guesses after the prompt


def sig6(x: float) -> float:
    return float(f"{x:.6g}")


def main() -> None:
    for name, (base, module, prefix, form) in MTP_FIXTURES.items():
        t0 = time.time()
        make(name, base, module, prefix, form, np.random.default_rng(SEED + len(name)))
        if name in CONVERTED:
            convert(name)
        print(f"{name}: {time.time() - t0:.1f}s")


def convert(name: str) -> None:
    """`name` through llama.cpp's converter (f32, MTP layer kept) as `<name>_gguf/model.gguf`,
    with the HF fixture's golden."""
    import subprocess
    import sys

    from family_fixtures import _CONVERT, _llamacpp_dir

    out_dir = FIXTURES / f"{name}_gguf"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", _CONVERT, str(_llamacpp_dir()), str(FIXTURES / name), "--outfile",
                    str(out_dir / "model.gguf"), "--outtype", "f32"], check=True, capture_output=True)
    golden = json.loads((FIXTURES / name / "mtp_golden.json").read_text())
    golden["description"] = f"{name} through llama.cpp's convert_hf_to_gguf.py (f32, MTP kept); golden = the HF fixture's"
    (out_dir / "mtp_golden.json").write_text(json.dumps(golden) + "\n")


def checkpoint_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' fused expert stacks (gate_up_proj [E, 2F, H], down_proj [E, H, F]) as the
    released checkpoints and save_pretrained store them: one gate, up and down weight per expert."""
    out: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if key.endswith(".experts.gate_up_proj"):
            stem, f = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :f])
                out[f"{stem}{e}.up_proj.weight"] = np.ascontiguousarray(value[e, f:])
        elif key.endswith(".experts.down_proj"):
            stem = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            out[key] = value
    return out


def make(name: str, base: str, module: str, prefix: str, form: str, rng: np.random.Generator) -> None:
    import importlib

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    out_dir = FIXTURES / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    cfg = json.loads((FIXTURES / base / "config.json").read_text())
    hidden = cfg["hidden_size"]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    target = AutoModelForCausalLM.from_pretrained(FIXTURES / base, dtype=torch.float32).eval()
    text_config = target.config

    # The head: one attention layer of the family, built by transformers so its parameter names
    # are the checkpoint's; its weights random.
    qwen = form == "qwen"
    layers = cfg["num_hidden_layers"]
    if qwen:
        layer_config = type(text_config)(**{**text_config.to_dict(), "num_hidden_layers": 1,
                                            "layer_types": ["full_attention"]})
    else:  # the layer after the main ones, configured as they are (a sparse one)
        layer_config = type(text_config)(**{**text_config.to_dict(), "num_hidden_layers": layers + 1})
    layer_config._attn_implementation = "eager"
    layer = getattr(modeling, f"{prefix}DecoderLayer")(layer_config, 0 if qwen else layers).eval()
    norm_class = getattr(modeling, f"{prefix}RMSNorm")
    names = (("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc") if qwen
             else ("enorm", "hnorm", "shared_head.norm", "eh_proj"))
    norm_e, norm_h, norm_out = (norm_class(hidden, eps=cfg["rms_norm_eps"]) for _ in range(3))
    fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    own_head = torch.nn.Linear(hidden, cfg["vocab_size"], bias=False)
    head: dict[str, torch.Tensor] = {f"{names[3]}.weight": fc.weight}
    head.update({f"{key}.weight": n.weight for key, n in zip(names[:3], (norm_e, norm_h, norm_out), strict=True)})
    layer_prefix = "layers.0." if qwen else ""
    head.update({f"{layer_prefix}{key}": p for key, p in layer.state_dict(keep_vars=True).items()})
    with torch.no_grad():
        for key, p in head.items():
            noise = torch.from_numpy(rng.normal(0.0, 0.1, p.shape).astype(np.float32))
            if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
                p.add_(noise)  # around the family's initial value: 0 for (1 + w) norms, 1 for plain w
            elif p.dim() >= 2 or key.endswith(("e_score_correction_bias", ".bias")):
                p.copy_(noise)
        own_head.weight.copy_(torch.from_numpy(rng.normal(0.0, 0.1, own_head.weight.shape).astype(np.float32)))

    tensors = load_file(FIXTURES / base / "model.safetensors")
    if qwen:
        extra = {f"mtp.{key}": p for key, p in head.items()}
        cfg["mtp_num_hidden_layers"] = 1
    else:
        extra = {f"model.layers.{layers}.{key}": p for key, p in head.items()}
        extra[f"model.layers.{layers}.embed_tokens.weight"] = torch.from_numpy(tensors["model.embed_tokens.weight"])
        extra[f"model.layers.{layers}.shared_head.head.weight"] = (
            own_head.weight if form.endswith("own head") else torch.from_numpy(tensors["lm_head.weight"]))
        cfg["num_nextn_predict_layers"] = 1
    tensors.update(checkpoint_names({key: p.detach().numpy().astype(np.float32) for key, p in extra.items()}))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # transformers loads the checkpoint and ignores the head: the target is the base fixture's.
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        base_logits = target(ids).logits
        out = loaded.model(ids)
        logits = loaded.lm_head(out.last_hidden_state)
    assert torch.equal(base_logits, logits), "the MTP tensors changed the target's forward"
    target_hidden = out.last_hidden_state[0]  # [n, hidden], after the final norm
    next_token = int(logits[0, -1].argmax())

    rotary = loaded.model.rotary_emb
    embed = loaded.model.embed_tokens
    lm_head = own_head if form.endswith("own head") else loaded.lm_head

    def mtp(tokens: list[int], hiddens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over positions 0 .. len(tokens) - 1 (no cache: causal over all of them):
        its logits and the state a further guess continues from, per position."""
        n = len(tokens)
        positions = torch.arange(n)[None]
        e = embed(torch.tensor([tokens]))
        if not qwen:
            e = torch.where(positions[..., None] == 0, torch.zeros_like(e), e)
        x = fc(torch.cat([norm_e(e), norm_h(hiddens[None])], dim=-1))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        position_embeddings = rotary(x, positions)
        y = layer(x, position_embeddings=position_embeddings, attention_mask=mask, position_ids=positions)
        normed = norm_out(y)[0]
        return lm_head(normed), normed if qwen else y[0]

    with torch.no_grad():
        # Positions 0 .. n - 1: the target's hidden states beside the tokens after them (the last
        # one the target's greedy next token).
        tokens = PROMPT[1:] + [next_token]
        hiddens = target_hidden
        head_logits, normed = mtp(tokens, hiddens)
        guesses: list[int] = []
        chain_logits: list[list[float]] = []
        for _ in range(GUESSES):
            guess = int(head_logits[-1].argmax())
            guesses.append(guess)
            chain_logits.append([sig6(v) for v in head_logits[-1].tolist()])
            tokens = tokens + [guess]
            hiddens = torch.cat([hiddens, normed[-1:]])
            head_logits, normed = mtp(tokens, hiddens)
        first_logits, _ = mtp(PROMPT[1:] + [next_token], target_hidden)

    import transformers

    golden: dict[str, Any] = {
        "fixture": name,
        "description": (f"{base}'s checkpoint with a random MTP head ({'mtp.*' if qwen else 'layer ' + str(layers)}, "
                        f"{form} form); head logits composed from transformers' modules as "
                        "tools/make_mtp_fixture.py says"),
        "source": f"transformers {transformers.__version__}, torch {torch.__version__}, f32, CPU",
        "prompt_ids": PROMPT,
        "next_token": next_token,
        # Row i: the head at position i (target hidden h_i, token t_{i+1}); argmax per row, and
        # every logit of the first, a middle and the last row.
        "head_argmax": [int(v) for v in first_logits.argmax(-1).tolist()],
        "head_logits_rows": {str(r): [sig6(v) for v in first_logits[r].tolist()]
                             for r in (0, len(PROMPT) // 2, len(PROMPT) - 1)},
        "target_hidden_last": [sig6(v) for v in target_hidden[-1].tolist()],
        # The chain after the prompt: guess j + 1 from the head at position n - 1 + j.
        "guesses": guesses,
        "guess_logits": chain_logits,
    }
    (out_dir / "mtp_golden.json").write_text(json.dumps(golden) + "\n")


if __name__ == "__main__":
    main()
