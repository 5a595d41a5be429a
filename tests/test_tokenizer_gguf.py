"""GGUF tokenizers and chat templates against transformers (fixtures by tools/make_tokenizer_fixtures.py)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from tests.conftest import FIXTURES
from tests.test_tokenizer import _spm_gguf
from vkrt import chat_template
from vkrt.errors import RequestError
from vkrt.tokenizer import IncrementalDetokenizer, Tokenizer

TOKENIZER_GOLDEN = json.loads((FIXTURES / "gemma3_270m_tokenizer.json").read_text(encoding="utf-8"))
TEMPLATES = FIXTURES / "chat_templates"
CHAT_GOLDEN = json.loads((TEMPLATES / "golden.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gemma(gemma3_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_path)


# ---- Gemma 3: SentencePiece vocabulary of 262k tokens, no space prefix -----------------------


def test_gemma_fixture_is_for_the_pulled_file(gemma3_path: Path) -> None:
    from vkrt.loader.pull import KNOWN_MODELS

    assert TOKENIZER_GOLDEN["meta"]["gguf_sha256"] == KNOWN_MODELS["gemma-3-270m"].sha256
    assert gemma3_path.stat().st_size == KNOWN_MODELS["gemma-3-270m"].size


@pytest.mark.parametrize("case", TOKENIZER_GOLDEN["cases"], ids=lambda c: repr(c["text"][:24]))
def test_gemma_ids_equal_transformers(gemma: Tokenizer, case: dict[str, Any]) -> None:
    assert gemma.encode(case["text"]) == case["ids"]
    assert gemma.encode(case["text"], add_special_tokens=False) == case["ids_no_special"]


@pytest.mark.parametrize("case", TOKENIZER_GOLDEN["cases"], ids=lambda c: repr(c["text"][:24]))
def test_gemma_decode_equals_transformers(gemma: Tokenizer, case: dict[str, Any]) -> None:
    ids = case["ids_no_special"]
    assert gemma.decode(ids) == case["decoded"]
    assert gemma.decode(ids, skip_special_tokens=False) == case["decoded_with_special"]


def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    meta = TOKENIZER_GOLDEN["meta"]
    assert gemma.vocab_size == meta["vocab_size"] == 262144
    assert gemma.bos_token_id == meta["bos_token_id"] and gemma.bos_token == "<bos>"
    assert gemma.eos_token_ids[0] == meta["eos_token_id"] and gemma.eos_token == "<eos>"
    end_of_turn = gemma.encode("<end_of_turn>", add_special_tokens=False)
    assert len(end_of_turn) == 1 and end_of_turn[0] in gemma.eos_token_ids  # generation stops on it


def test_gemma_round_trip_and_streaming(gemma: Tokenizer) -> None:
    # Lossless on text without special tokens: spaces (no prefix added), byte fallback, emoji.
    for case in TOKENIZER_GOLDEN["cases"]:
        if "<" not in case["text"] and "[" not in case["text"]:
            assert gemma.decode(case["ids_no_special"]) == case["text"]
            assert b"".join(gemma.token_bytes(i) for i in case["ids_no_special"]) == case["text"].encode()
    ids = gemma.encode("  two spaces, then 🙂👍🏽 and 東京\n\n", add_special_tokens=False)
    detok = IncrementalDetokenizer(gemma)
    assert "".join(detok.add(i) for i in ids) == gemma.decode(ids)


# ---- SentencePiece vocabularies of other families (synthetic GGUFs) --------------------------


def test_llama_spm_prefixes_the_text_once(tmp_path: Path) -> None:
    vocab = _spm_gguf(tmp_path / "llama.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "llama.gguf")
    # Metaspace with prepend_scheme "first" (transformers' LlamaTokenizer, legacy=False):
    # a space at the start of the text, none after a special token.
    assert tok.encode("hello</s>hello", add_special_tokens=False) == [
        vocab["▁hello"], 2, vocab["h"], vocab["e"], vocab["llo"]]
    assert tok.decode(tok.encode("hello hello")) == "hello hello"


def test_phi3_spm_prefixes_after_special_tokens(tmp_path: Path) -> None:
    vocab = _spm_gguf(tmp_path / "phi3.gguf", arch="phi3")
    tok = Tokenizer.from_gguf(tmp_path / "phi3.gguf")
    # transformers' phi3 builder: a Prepend normalizer, applied to each text run.
    assert tok.encode("hello</s>hello", add_special_tokens=False) == [vocab["▁hello"], 2, vocab["▁hello"]]


def test_gemma_spm_adds_no_prefix_and_merges_by_vocabulary_order(tmp_path: Path) -> None:
    vocab = _spm_gguf(tmp_path / "gemma3.gguf", arch="gemma3", add_space_prefix=False)
    tok = Tokenizer.from_gguf(tmp_path / "gemma3.gguf")
    assert tok.encode("hello", add_special_tokens=False) == [vocab["h"], vocab["e"], vocab["llo"]]
    assert tok.encode(" hello", add_special_tokens=False) == [vocab["▁hello"]]
    assert tok.decode([vocab["▁hello"]]) == " hello"


def test_spm_build_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vkrt import tokenizer as tokenizer_mod

    monkeypatch.setenv("VKRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_mod, "_SPM_CACHE_MIN_TOKENS", 0)
    vocab = _spm_gguf(tmp_path / "gemma3.gguf", arch="gemma3", add_space_prefix=False)
    expected = [vocab["▁hello"], vocab["▁hello"], vocab["▁"], vocab["<0xC3>"], vocab["<0xA9>"]]
    assert Tokenizer.from_gguf(tmp_path / "gemma3.gguf").encode(" hello hello é", False) == expected
    cached = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".json"

    def no_rebuild(*args: Any) -> Any:
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tokenizer_mod, "_sentencepiece_bpe", no_rebuild)
    assert Tokenizer.from_gguf(tmp_path / "gemma3.gguf").encode(" hello hello é", False) == expected
    monkeypatch.undo()
    monkeypatch.setenv("VKRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_mod, "_SPM_CACHE_MIN_TOKENS", 0)
    cached[0].write_text("{ damaged")
    assert Tokenizer.from_gguf(tmp_path / "gemma3.gguf").encode(" hello hello é", False) == expected
    assert json.loads(cached[0].read_text())["model"]["type"] == "BPE"  # rewritten whole


# ---- byte-level BPE pre-tokenizers by `tokenizer.ggml.pre` ------------------------------------


@pytest.mark.parametrize(("pre", "pieces"), [
    # Worked out by hand from each regex: llama3 groups digits by three, qwen2 and tekken
    # split them one by one, gpt-4o keeps a contraction on its word.
    ("llama-bpe", ["Hello", "ĠWorld", "'s", "Ġ", "123", "45"]),
    ("qwen2", ["Hello", "ĠWorld", "'s", "Ġ", "1", "2", "3", "4", "5"]),
    ("deepseek-r1-qwen", ["Hello", "ĠWorld", "'s", "Ġ", "1", "2", "3", "4", "5"]),
    ("tekken", ["Hello", "ĠWorld", "'s", "Ġ", "1", "2", "3", "4", "5"]),
    ("gpt-4o", ["Hello", "ĠWorld's", "Ġ", "123", "45"]),
    ("default", ["Hello", "ĠWorld", "'s", "Ġ12345"]),
    ("smollm", ["Hello", "ĠWorld", "'s", "Ġ", "1", "2", "3", "4", "5"]),
])
def test_pre_tokenizer_splits(pre: str, pieces: list[str]) -> None:
    from vkrt.tokenizer import PRE_TOKENIZERS

    split = PRE_TOKENIZERS[pre].build().pre_tokenize_str("Hello World's 12345")
    assert [piece for piece, _ in split] == pieces


# ---- chat templates rendered as transformers renders them ----------------------------------


def _template_tokenizer(template: str, bos: str | None, eos: str) -> Tokenizer:
    names = ["[UNK]", *([bos] if bos else []), eos]
    hf = HFTokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="[UNK]"))
    source = (TEMPLATES / template).read_text(encoding="utf-8")
    return Tokenizer(hf, bos_token_id=1 if bos else None, eos_token_ids=[len(names) - 1],
                     chat_template=source, byte_level=False)


class _RenderDay(datetime):
    """The day the golden renders were made on (gpt-oss's template writes today's date)."""

    @classmethod
    def now(cls, tz: Any = None) -> _RenderDay:
        return cls.fromisoformat(CHAT_GOLDEN["meta"]["date"])


@pytest.fixture
def render_day(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "datetime", _RenderDay)


@pytest.mark.parametrize("case", CHAT_GOLDEN["renders"], ids=lambda c: c["name"])
@pytest.mark.usefixtures("render_day")
def test_chat_template_renders_as_transformers(case: dict[str, Any]) -> None:
    tok = _template_tokenizer(case["template"], case["bos_token"], case["eos_token"])
    kwargs = dict(case["kwargs"])
    rendered = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                       tools=kwargs.pop("tools", None), **kwargs)
    assert rendered == case["rendered"]


@pytest.mark.usefixtures("render_day")
def test_harmony_reads_reasoning_content_as_thinking() -> None:
    """An OpenAI client sends an earlier call's thought as `reasoning_content`; gpt-oss's template
    reads `thinking`: the render is the one transformers made from `thinking`."""
    [case] = [c for c in CHAT_GOLDEN["renders"] if c["name"] == "gpt_oss_tools"]
    messages = [{**m, "reasoning_content": m.pop("thinking")} if "thinking" in m else m
                for m in (dict(m) for m in case["messages"])]
    assert any("reasoning_content" in m for m in messages)
    tok = _template_tokenizer(case["template"], case["bos_token"], case["eos_token"])
    assert tok.apply_chat_template(messages, tools=case["kwargs"]["tools"]) == case["rendered"]


@pytest.mark.parametrize("case", CHAT_GOLDEN["errors"], ids=lambda c: c["name"])
def test_chat_template_refusals(case: dict[str, Any]) -> None:
    tok = _template_tokenizer(case["template"], "<s>", "</s>")
    with pytest.raises(RequestError) as info:
        tok.apply_chat_template(case["messages"], add_generation_prompt=False)
    assert case["error"] in str(info.value)


def test_template_namespace_refuses_private_attributes() -> None:
    hf = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = Tokenizer(hf, bos_token_id=None, eos_token_ids=[], byte_level=False,
                    chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(RequestError, match="underscore"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_gemma_chat_prompt_tokenizes_to_single_control_tokens(gemma: Tokenizer) -> None:
    tok = _template_tokenizer("gemma3.jinja", "<bos>", "<eos>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = gemma.encode(rendered, add_special_tokens=False)  # the template writes <bos> itself
    assert ids[0] == gemma.bos_token_id and ids.count(gemma.bos_token_id) == 1
    pieces = [gemma.token_text(i) for i in ids]
    assert pieces[1] == "<start_of_turn>" and pieces.count("<start_of_turn>") == 2
    assert pieces.count("<end_of_turn>") == 1 and pieces[-2:] == ["model", "\n"]
