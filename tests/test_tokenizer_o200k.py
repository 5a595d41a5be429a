"""gpt-oss's tokenizer (o200k_harmony) read from GGUF metadata: the ids transformers gives
(tests/fixtures/o200k_tokenizer.json, by tools/make_o200k_fixture.py).

No gpt-oss GGUF is at hand offline, so the test writes the tokenizer part of one, as llama.cpp's
converter writes it from gpt-oss's tokenizer.json: o200k_base's ranks (the file the
`bpe-openai` package ships, checked by its sha256) as byte-level token strings, the merges
transformers' TikTokenConverter derives from the ranks (checked by their digest against the
ones transformers made), the harmony special tokens as control tokens, `tokenizer.ggml.pre`
"gpt-4o".
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import json
from typing import Any

import gguf
import pytest

from tests.conftest import FIXTURES
from vkrt.tokenizer import Tokenizer, _unicode_to_byte

GOLDEN = json.loads((FIXTURES / "o200k_tokenizer.json").read_text(encoding="utf-8"))
META = GOLDEN["meta"]


def _ranks() -> dict[bytes, int]:
    raw = gzip.decompress(importlib.resources.files("bpe_openai.data").joinpath("o200k_base.tiktoken.gz").read_bytes())
    assert hashlib.sha256(raw).hexdigest() == META["o200k_base_sha256"]
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in raw.splitlines())}


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges a tiktoken vocabulary implies, ordered as TikTokenConverter orders them: every
    split of a token into two tokens, by the token's rank, then by the parts' ranks."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in merges]


@pytest.fixture(scope="module")
def o200k(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    ranks = _ranks()
    to_text = {b: c for c, b in _unicode_to_byte().items()}

    def text(raw: bytes) -> str:
        return "".join(to_text[b] for b in raw)

    tokens = [text(raw) for raw, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    merges = [f"{text(a)} {text(b)}" for a, b in _merges(ranks)]
    assert hashlib.sha256("\n".join(tokens).encode()).hexdigest() == META["tokens_sha256"]
    assert hashlib.sha256("\n".join(merges).encode()).hexdigest() == META["merges_sha256"]
    assert len(tokens) == META["first_special_id"]
    special = META["special_tokens"]
    path = tmp_path_factory.mktemp("o200k") / "tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens + special)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(special))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) + special.index("<|startoftext|>"))
    writer.add_eos_token_id(len(tokens) + special.index("<|return|>"))
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_gguf(path)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: repr(c["text"][:24]))
def test_o200k_ids_equal_transformers(o200k: Tokenizer, case: dict[str, Any]) -> None:
    assert o200k.encode(case["text"], add_special_tokens=False) == case["ids"]
    assert o200k.encode(case["text"]) == case["ids"]  # gpt-oss adds no BOS


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: repr(c["text"][:24]))
def test_o200k_decode_equals_transformers(o200k: Tokenizer, case: dict[str, Any]) -> None:
    assert o200k.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
    assert o200k.decode(case["ids"]) == case["decoded_skip_special"]


def test_harmony_ends_generation_on_return_and_call_not_end(o200k: Tokenizer) -> None:
    """<|end|> closes a harmony message (the analysis before the final answer), so it must not
    stop generation; <|return|> and <|call|> do, and <|endoftext|> (as llama.cpp has it)."""
    ids = {name: o200k.token_id(name) for name in ("<|return|>", "<|call|>", "<|end|>", "<|endoftext|>")}
    assert set(o200k.eos_token_ids) == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    assert o200k.vocab_size == 201088 and ids["<|end|>"] == 200007


def test_harmony_markers_encode_whole(o200k: Tokenizer) -> None:
    """A harmony conversation as text: each <|start|> is one token, and the ids decode back."""
    text = next(c["text"] for c in GOLDEN["cases"] if c["text"].startswith("<|start|>system"))
    ids = o200k.encode(text, add_special_tokens=False)
    assert ids.count(o200k.token_id("<|start|>")) == 4 and o200k.decode(ids, skip_special_tokens=False) == text

