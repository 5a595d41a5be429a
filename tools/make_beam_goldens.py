"""Beam-search goldens for tiny_llama from Hugging Face transformers' generate(num_beams=...).

Writes tests/fixtures/tiny_llama_beam.json: per case the prompt ids, the search settings and
the sequences HF returns, best first (generated ids only; a finished one ends with its EOS).

vkrt serves beam search with vLLM's semantics, which differ from HF's in two places: vLLM's
length penalty counts the prompt (HF's counts only generated tokens, EOS included), and vLLM
keeps every EOS-finished candidate of a step (HF only those ranked within the top num_beams).
The cases are chosen where both agree: no EOS within the horizon (every beam has the same length,
so the penalty cannot reorder them), or length_penalty 0 with an EOS that does finish beams. The
script checks that agreement itself: each case is also run through a plain full-recompute beam
search with vLLM's rules, and a case whose result differs from HF's is refused, not written.

Run with the tools venv (torch, transformers):
    python tools/make_beam_goldens.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_llama"
OUT = ROOT / "tests" / "fixtures" / "tiny_llama_beam.json"

# (prompt, num_beams, num_return_sequences, length_penalty, max_new_tokens, eos token or None)
CASES = [
    ([7, 3, 9], 3, 3, 1.0, 6, None),
    ([1, 42, 17], 4, 2, 0.5, 5, None),
    ([100, 5], 2, 2, 2.0, 7, None),
    ([7, 3, 9], 3, 2, 0.0, 6, "likely"),  # the EOS is a token the search meets (see likely_token)
    ([100, 5], 3, 3, 0.0, 6, "likely"),
    ([9], 4, 2, 0.0, 5, "likely"),
]


def log_softmax_last(model, ids: list[int]):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def vllm_rules_search(model, prompt: list[int], width: int, num_returned: int, length_penalty: float,
                      max_new: int, eos: int | None) -> list[list[int]]:
    """vLLM's beam search, full recompute per beam: top 2 * width alternatives of each beam, EOS
    ones finished, the `width` best kept by cumulative logprob / len ** length_penalty (len with the
    prompt, without a final EOS). Finished sequences keep their EOS here, as HF returns them."""
    def score(beam: tuple[list[int], float, bool]) -> float:
        tokens, cum, ended = beam
        return cum / ((len(prompt) + len(tokens) - (1 if ended else 0)) ** length_penalty)

    live: list[tuple[list[int], float, bool]] = [([], 0.0, False)]
    finished: list[tuple[list[int], float, bool]] = []
    for _ in range(max_new):
        grown = []
        for tokens, cum, _ended in live:
            logprobs = log_softmax_last(model, prompt + tokens)
            top = logprobs.topk(2 * width)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if tid == eos:
                    finished.append((tokens + [tid], cum + lp, True))
                else:
                    grown.append((tokens + [tid], cum + lp, False))
        live = sorted(grown, key=score, reverse=True)[:width]
    return [tokens for tokens, _, _ in sorted(finished + live, key=score, reverse=True)[:num_returned]]


def likely_token(model, prompt: list[int]) -> int:
    """A token the search will meet: the greedy continuation's third token."""
    ids = list(prompt)
    for _ in range(3):
        ids.append(int(log_softmax_last(model, ids).argmax()))
    return ids[-1]


def hf_beam_search(model, prompt: list[int], width: int, num_returned: int, length_penalty: float,
                   max_new: int, eos: int | None) -> list[list[int]]:
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, num_beams=width, num_return_sequences=num_returned,
                              length_penalty=length_penalty, max_new_tokens=max_new, early_stopping=False,
                              eos_token_id=eos, pad_token_id=0 if eos != 0 else 1, bos_token_id=None)
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    sequences = []
    for row in out[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]  # what follows the EOS is padding
        sequences.append(row)
    return sequences


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # The config's EOS (2) would merge into every generate(); each case names its own, or none.
    model.generation_config.eos_token_id = None
    cases = []
    for prompt, width, num_returned, length_penalty, max_new, eos_spec in CASES:
        eos = likely_token(model, prompt) if eos_spec == "likely" else None
        hf = hf_beam_search(model, prompt, width, num_returned, length_penalty, max_new, eos)
        rules = vllm_rules_search(model, prompt, width, num_returned, length_penalty, max_new, eos)
        if hf != rules:
            raise SystemExit(f"case {prompt} width {width}: HF {hf} != vLLM rules {rules}; pick another case")
        if eos is not None and not any(seq[-1] == eos for seq in hf):
            raise SystemExit(f"case {prompt}: no returned beam ends with EOS {eos}; the case tests nothing")
        cases.append({"prompt_ids": prompt, "num_beams": width, "num_return_sequences": num_returned,
                      "length_penalty": length_penalty, "max_new_tokens": max_new, "eos_token_id": eos,
                      "sequences": hf})
        print(f"{prompt} width {width}: {hf}", flush=True)
    meta = {"fixture": "tiny_llama", "generator": "tools/make_beam_goldens.py",
            "note": "HF generate(num_beams, num_return_sequences, length_penalty, early_stopping=False), "
                    "do_sample=False, f32; sequences best first, generated ids only, a finished one ends "
                    "with its EOS; each case also equals a full-recompute search with vLLM's rules",
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__}}
    OUT.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
