#!/usr/bin/env python3
"""Tiny embedding and reranker fixtures with goldens from Hugging Face transformers (torch, CPU).

Run from the tools venv (see tools/make_fixtures.py), from the repository root:

    .venv-tools/bin/python tools/make_pooling_fixtures.py

Writes two HF directories under tests/fixtures/, each with a word-level tokenizer.json:

    tiny_qwen3_embed/   Qwen3-Embedding's shape: Qwen3 with tied embeddings, saved as its base
                        model (tensor names without "model.", no LM head) as the released
                        checkpoints are, with sentence-transformers' modules.json, last-token
                        Pooling and Normalize. pooling_golden.json: transformers' last hidden
                        state (after the final norm) pooled last / mean / cls, and the yes/no
                        scores Qwen3-Reranker's documented prompt gives with the same weights.
    tiny_qwen3_seqcls/  Qwen3ForSequenceClassification with one label; pooling_golden.json:
                        sigmoid of its logit for query + document pairs (the pair encoding).

The goldens are not named golden.json: the logits-golden tests take every such file for theirs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SEED = 4321
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=1e6,
              attention_bias=False)
SPECIAL = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]

# Qwen3-Reranker's prompt, as its model card writes it: system + user turns, an empty thought,
# and the answer's first token scored as yes against no.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

TEXTS = ["the capital of france is paris", "a cat sat on the mat", "what is the capital of france",
         "gravity pulls objects toward the earth"]
QUERY = "what is the capital of france"
DOCUMENTS = ["the capital of france is paris", "a cat sat on the mat", "gravity pulls objects toward the earth"]


def make_tokenizer() -> Tokenizer:
    """A word-level tokenizer over every word the goldens use (the rest of the 256 ids filler words)."""
    words: list[str] = []
    pre = pre_tokenizers.Whitespace()
    for text in [*TEXTS, RERANK_PREFIX, RERANK_SUFFIX, RERANK_INSTRUCTION, "<Instruct>: <Query>: <Document>: yes no"]:
        for piece, _ in pre.pre_tokenize_str(text):
            if piece not in words and piece not in SPECIAL:
                words.append(piece)
    vocab = SPECIAL + words + [f"w{i}" for i in range(256 - len(SPECIAL) - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre
    tokenizer.add_special_tokens(SPECIAL)
    return tokenizer


def rerank_ids(tokenizer: Tokenizer, query: str, document: str) -> list[int]:
    body = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return [*tokenizer.encode(RERANK_PREFIX).ids, *tokenizer.encode(body).ids, *tokenizer.encode(RERANK_SUFFIX).ids]


def _dir(name: str) -> Path:
    out = ROOT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def _rounded(values: torch.Tensor) -> list[float]:
    return [float(f"{v:.7g}") for v in values.detach().double().tolist()]


def make_embed(tokenizer: Tokenizer) -> None:
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, tie_word_embeddings=True)).eval()
    out = _dir("tiny_qwen3_embed")
    model.model.save_pretrained(out)  # the base model's names, as Qwen3-Embedding ships them
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": CONFIG["hidden_size"], "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": True, "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    (out / "2_Normalize").mkdir()
    embeddings = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer.encode(text).ids
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
            embeddings.append({"text": text, "ids": ids, "last": _rounded(hidden[-1]),
                               "mean": _rounded(hidden.mean(0)), "cls": _rounded(hidden[0])})
        yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
        scores = []
        for document in DOCUMENTS:
            ids = rerank_ids(tokenizer, QUERY, document)
            last = model(torch.tensor([ids])).logits[0, -1]
            scores.append(float(torch.softmax(torch.stack([last[no], last[yes]]), 0)[1]))
    golden = {"generator": "tools/make_pooling_fixtures.py", "seed": SEED, "note": "pooled states are not normalised",
              "embeddings": embeddings, "rerank": {"query": QUERY, "documents": DOCUMENTS, "yes_no_scores": scores}}
    (out / "pooling_golden.json").write_text(json.dumps(golden, indent=1) + "\n")


def make_seqcls(tokenizer: Tokenizer) -> None:
    torch.manual_seed(SEED + 1)
    model = Qwen3ForSequenceClassification(Qwen3Config(**CONFIG, tie_word_embeddings=False, num_labels=1)).eval()
    out = _dir("tiny_qwen3_seqcls")
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    with torch.no_grad():
        scores = [float(torch.sigmoid(model(torch.tensor([tokenizer.encode(QUERY, document).ids])).logits[0, 0]))
                  for document in DOCUMENTS]
    golden = {"generator": "tools/make_pooling_fixtures.py", "seed": SEED + 1, "query": QUERY, "documents": DOCUMENTS,
              "scores": scores}
    (out / "pooling_golden.json").write_text(json.dumps(golden, indent=1) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    np.random.seed(SEED)
    tokenizer = make_tokenizer()
    make_embed(tokenizer)
    make_seqcls(tokenizer)


if __name__ == "__main__":
    main()
