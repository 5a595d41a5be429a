#!/usr/bin/env python3
"""gpt-oss's tokenizer (o200k_harmony) as Hugging Face builds it: token ids of a set of strings,
for vkrt's GGUF tokenizer with `tokenizer.ggml.pre` "gpt-4o" (tests/test_tokenizer_o200k.py).

No gpt-oss checkpoint is at hand offline, but its vocabulary is OpenAI's o200k_base, which the
`bpe-openai` package ships (`bpe_openai/data/o200k_base.tiktoken.gz`; its sha256 is checked
against tiktoken's published one), and gpt-oss's tokenizer.json is what transformers'
TikTokenConverter makes of it: o200k's split pattern, merges derived from the ranks, the
harmony special tokens after the ranks. This script builds that tokenizer with transformers,
checks it against bpe-openai's own encoder on text without special tokens, and writes
tests/fixtures/o200k_tokenizer.json: the special tokens, digests of the vocabulary and of the
merges (so the test's GGUF is the one llama.cpp's converter would write from that
tokenizer.json), and each string's ids and decode.

    .venv-tools/bin/pip install bpe-openai
    .venv-tools/bin/python tools/make_o200k_fixture.py
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import time

from make_fixtures import FIXTURES, versions, write_json
from make_tokenizer_fixtures import TOKENIZER_STRINGS

# tiktoken's published digest of o200k_base.tiktoken (tiktoken_ext/openai_public.py)
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k's split pattern (tiktoken's pat_str for o200k_base and o200k_harmony)
PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# gpt-oss's special tokens (o200k_harmony): ids 199998..201087 after the 199998 ranks
NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
         200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
         200018: "<|endofprompt|>"}
SPECIAL = [NAMED.get(i, f"<|reserved_{i}|>") for i in range(199998, 201088)]
HARMONY_STRINGS = [
    "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>user<|message|>Hi there!<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Greet back.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>',
    "I'm sure they'll say it's THEIR'S, we'VE done it: O'Neil's CamelCase HTTPServer iPhone",
    "e\u0301 combining acute, Hangul \u1100\u1161, Devanagari \u0915\u093f, Thai \u0e01\u0e34",
]


def ranks() -> tuple[dict[bytes, int], str]:
    """o200k_base's ranks from bpe-openai's copy of the file, and the file's sha256."""
    raw = gzip.decompress(importlib.resources.files("bpe_openai.data").joinpath("o200k_base.tiktoken.gz").read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != O200K_SHA256:
        raise SystemExit(f"o200k_base.tiktoken has sha256 {digest}, not tiktoken's {O200K_SHA256}")
    table = {}
    for line in raw.splitlines():
        token, rank = line.split()
        table[base64.b64decode(token)] = int(rank)
    return table, digest


def main() -> None:
    import bpe_openai
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    t0 = time.time()
    table, digest = ranks()

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return table

    converter = Converter(vocab_file="o200k_base", pattern=PATTERN, extra_special_tokens=SPECIAL)
    vocab, merges = converter.extract_vocab_merges_from_model("o200k_base")
    hf = PreTrainedTokenizerFast(tokenizer_object=converter.converted())
    assert hf.convert_tokens_to_ids("<|start|>") == 200006 and len(hf) == 201088
    reference = bpe_openai.get_encoding("o200k_base")
    cases = []
    for text in [*TOKENIZER_STRINGS, *HARMONY_STRINGS]:
        ids = hf.encode(text, add_special_tokens=False)
        if "<|" not in text and ids != reference.encode_ordinary(text):
            raise SystemExit(f"transformers and bpe-openai disagree on {text!r}")
        cases.append({"text": text, "ids": ids, "decoded": hf.decode(ids),
                      "decoded_skip_special": hf.decode(ids, skip_special_tokens=True)})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    write_json(FIXTURES / "o200k_tokenizer.json", {
        "meta": {
            "generator": "tools/make_o200k_fixture.py",
            "what": "gpt-oss's tokenizer as transformers' TikTokenConverter builds it from o200k_base "
                    "(o200k's pattern, merges from the ranks, ignore_merges, the harmony special tokens)",
            "o200k_base_sha256": digest,
            "tokens_sha256": hashlib.sha256("\n".join(tokens).encode()).hexdigest(),
            "merges_sha256": hashlib.sha256("\n".join(f"{a} {b}" for a, b in merges).encode()).hexdigest(),
            "num_merges": len(merges),
            "special_tokens": SPECIAL,
            "first_special_id": 199998,
            "versions": versions(),
        },
        "cases": cases,
    })
    print(f"o200k_tokenizer.json: {len(cases)} strings, {len(merges)} merges, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
