#!/usr/bin/env python3
"""A tiny byte-level BPE tokenizer with Qwen2.5-Coder's fill-in-the-middle tokens, and the
prompt ids POST /infill must build from it, computed with Hugging Face transformers.

vkrt's /infill test serves this tokenizer (no model: a fake engine stands behind it) and
demands these ids. Run from the git-ignored tools venv (see tools/make_fixtures.py):

    .venv-tools/bin/python tools/make_fim_fixture.py      # about 2 s

Outputs, in tests/fixtures/tiny_fim_tokenizer/:

    tokenizer.json, tokenizer_config.json   a 320-entry vocabulary trained on a few lines of
                                            code, then the special tokens, spelled and ordered
                                            as Qwen2.5-Coder's (after the vocabulary)
    golden.json                             per case, /infill's request fields and the prompt
                                            ids: each text piece encoded by transformers'
                                            tokenizer on its own (special-token text as text),
                                            the FIM ids from its vocabulary, laid out as
                                            llama-server lays out an infill prompt
"""

from __future__ import annotations

import argparse
from typing import Any

from make_fixtures import FIXTURES, write_json

OUT = FIXTURES / "tiny_fim_tokenizer"
VOCAB_SIZE = 320
# Qwen2.5-Coder's special tokens, in its order (its ids 151643, 151659..151664 are far apart;
# here they follow the trained vocabulary in the same order).
SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
            "<|repo_name|>", "<|file_sep|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nfrom pathlib import Path\n\nprint(Path(os.getcwd()).name)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = y[i] * 2; }\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]
CASES: list[dict[str, Any]] = [
    {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n"},
    {"input_prefix": "def fibonacci(n):\n", "input_suffix": "    return fibonacci(n - 1)\n", "prompt": "    if n"},
    {"input_prefix": "x = 1\n", "input_suffix": "", "input_extra": [
        {"filename": "utils.py", "text": "def helper():\n    return 42\n"},
        {"text": "import os\n"}]},
    # Special-token text in the code is text, not a control token.
    {"input_prefix": "s = '<|fim_suffix|>'\n", "input_suffix": "t = 2\n"},
]


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)
    return tok


def layout(tok: Any, case: dict[str, Any]) -> list[int]:
    """llama-server's infill prompt: the repository and its files, then prefix, suffix, middle."""

    def text(piece: str) -> list[int]:
        return list(tok(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    special = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    ids = [special["<|repo_name|>"], *text("myproject\n")]
    for chunk in case.get("input_extra", []):
        ids += [special["<|file_sep|>"], *text(chunk.get("filename", "tmp") + "\n"), *text(chunk["text"])]
    ids += [special["<|file_sep|>"], *text("filename\n")]
    ids += [special["<|fim_prefix|>"], *text(case["input_prefix"]), *text(case.get("prompt", ""))]
    ids += [special["<|fim_suffix|>"], *text(case["input_suffix"]), special["<|fim_middle|>"]]
    return ids


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    import transformers

    OUT.mkdir(exist_ok=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    fast.save_pretrained(OUT)
    for extra in ("special_tokens_map.json", "chat_template.jinja"):  # not read by vkrt; keep the fixture small
        (OUT / extra).unlink(missing_ok=True)
    reloaded = transformers.AutoTokenizer.from_pretrained(OUT)
    cases = [{"request": case, "prompt_ids": layout(reloaded, case)} for case in CASES]
    write_json(OUT / "golden.json", {"meta": {"transformers": transformers.__version__,
                                              "vocab_size": len(reloaded)}, "cases": cases})
    print(f"wrote {OUT} ({sum(p.stat().st_size for p in OUT.iterdir())} bytes)")


if __name__ == "__main__":
    main()
