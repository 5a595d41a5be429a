"""Tokenizer: the real SmolLM2 GGUF vocabulary, a synthetic SentencePiece GGUF, HF dirs, chat templates."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from vkrt.chat_template import ChatTemplate, TemplateBudget
from vkrt.errors import ModelFormatError, RequestError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.tokenizer import IncrementalDetokenizer, Tokenizer

UNICODE_TEXT = "Café déjà vu — 東京は日本の首都です。 emoji: 🙂👍🏽👨‍👩‍👧 and math ∑x² = 42\n\ttabs"


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


# ---- SmolLM2 (byte-level BPE, "smollm" pre-tokenizer) ---------------------------------------


def test_known_ids(smol: Tokenizer) -> None:
    # Ids produced by HF transformers' SmolLM2 tokenizer; no BOS (add_bos_token is false).
    assert smol.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    # The smollm pre-tokenizer splits digits one by one.
    assert [smol.token_text(i) for i in smol.encode("12345")] == ["1", "2", "3", "4", "5"]


def test_unicode_round_trip(smol: Tokenizer) -> None:
    ids = smol.encode(UNICODE_TEXT)
    assert smol.decode(ids) == UNICODE_TEXT
    assert b"".join(smol.token_bytes(i) for i in ids) == UNICODE_TEXT.encode("utf-8")


def test_special_tokens(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # control tokens map to single ids, not pieces
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_eos_bos_vocab(smol: Tokenizer) -> None:
    im_end = smol.encode("<|im_end|>")
    assert im_end == [2]
    assert 2 in smol.eos_token_ids and smol.eos_token_ids[0] == 2
    assert smol.bos_token_id == 1 and smol.bos_token == "<|im_start|>"
    assert smol.vocab_size == 49152


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_detokenizer_matches_full_decode(smol: Tokenizer, skip_special: bool) -> None:
    text = "你好，世界！🙂👍🏽 Ünïcödé 👨‍👩‍👧<|im_end|> end 🎉"
    ids = smol.encode(text)
    detok = IncrementalDetokenizer(smol, skip_special_tokens=skip_special)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == smol.decode(ids, skip_special_tokens=skip_special)
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") > 0  # some tokens held back: they were partial characters


def test_incremental_detokenizer_after_prompt(smol: Tokenizer) -> None:
    prompt = smol.encode("Answer in Japanese:")
    completion = smol.encode(" はい、東京です 🗼")
    detok = IncrementalDetokenizer(smol, prompt_ids=prompt)
    assert "".join(detok.add(i) for i in completion) == smol.decode(prompt + completion)[len(smol.decode(prompt)):]


def test_chat_template(smol: Tokenizer) -> None:
    text = smol.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = smol.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert not no_prompt.endswith("assistant\n")


def test_from_model_accepts_loaded_model(smollm2_path: Path) -> None:
    tok = Tokenizer.from_model(load_model(smollm2_path))
    assert tok.encode("Hello") == Tokenizer.from_model(smollm2_path).encode("Hello")


# ---- SentencePiece-llama vocabulary in a GGUF -------------------------------------------


def _spm_gguf(path: Path, model: str = "llama", arch: str = "llama", add_space_prefix: bool | None = None,
              token_ids: dict[str, int] | None = None) -> dict[str, int]:
    """A SentencePiece-style GGUF vocabulary of 5 merged pieces, byte tokens and 3 specials;
    `token_ids` adds tokenizer.ggml.* keys naming tokens."""
    pieces = ["▁h", "ll", "▁he", "llo", "▁hello"]  # merged in this order (descending score)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁", "h", "e", "l", "o"] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-1.0, -2.0, -3.0, -4.0, -5.0]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    for key, value in (token_ids or {}).items():
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t: i for i, t in enumerate(tokens)}


def test_sentencepiece_gguf(tmp_path: Path) -> None:
    vocab = _spm_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    ids = tok.encode("hello é")
    # BOS added by default; "é" is not in the vocab, so it falls back to its UTF-8 bytes.
    assert ids == [1, vocab["▁hello"], vocab["▁"], vocab["<0xC3>"], vocab["<0xA9>"]]
    assert tok.decode(ids) == "hello é"
    assert tok.encode("hello", add_special_tokens=False) == [vocab["▁hello"]]
    assert tok.token_bytes(vocab["<0xC3>"]) == b"\xc3"
    assert tok.eos_token_ids == (2,)


def test_fim_tokens_from_gguf_keys_or_their_spelling(tmp_path: Path) -> None:
    """CodeLlama-style GGUFs name their infill tokens by key; a vocabulary that spells them as
    Qwen2.5-Coder does (the fixture) needs no key; a key outside the vocabulary is refused."""
    keys = {"tokenizer.ggml.fim_pre_token_id": 259, "tokenizer.ggml.fim_suf_token_id": 260,
            "tokenizer.ggml.fim_mid_token_id": 261}
    _spm_gguf(tmp_path / "fim.gguf", token_ids=keys)
    assert Tokenizer.from_gguf(tmp_path / "fim.gguf").fim_token_ids == {"prefix": 259, "suffix": 260, "middle": 261}
    _spm_gguf(tmp_path / "plain.gguf")
    assert Tokenizer.from_gguf(tmp_path / "plain.gguf").fim_token_ids == {}
    _spm_gguf(tmp_path / "bad.gguf", token_ids={"tokenizer.ggml.fim_sep_token_id": 5000})
    with pytest.raises(ModelFormatError, match="fim_sep_token_id"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")
    qwen = Tokenizer.from_hf_dir(Path(__file__).parent / "fixtures" / "tiny_fim_tokenizer")
    assert qwen.fim_token_ids == {"prefix": 321, "middle": 322, "suffix": 323, "repo": 325, "file_sep": 326}


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    _spm_gguf(tmp_path / "rwkv.gguf", model="rwkv")
    with pytest.raises(UnsupportedModelError, match=r"rwkv\.gguf: tokenizer model 'rwkv' is not supported"):
        Tokenizer.from_gguf(tmp_path / "rwkv.gguf")


# ---- HF directories -------------------------------------------------------------------------


def test_hf_dir(tmp_path: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2, "hi": 3, "there": 4, "[UNK]": 5}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hi there") == [3, 4]
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1, 2)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")  # newer transformers layout
    assert Tokenizer.from_model(tmp_path).apply_chat_template([]) == "</s>"


# ---- chat template environment (as transformers sets it up) --------------------------------


def _with_template(template: str) -> Tokenizer:
    hf = HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    return Tokenizer(hf, bos_token_id=0, eos_token_ids=[1], chat_template=template, byte_level=False)


def test_template_trims_blocks_and_lstrips() -> None:
    tok = _with_template("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "    a\n    b\n"
    tok = _with_template("{% for m in messages %}\n    {% if true %}{{ m.content }}{% endif %}\n{% endfor %}")
    # lstrip_blocks drops the indent before {% if %}; trim_blocks the newline after {% endif %}.
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "a"


def test_template_helpers() -> None:
    tok = _with_template(
        "{{ messages[0] | tojson }}|{{ tools | tojson }}|{{ strftime_now('%Y') }}|{{ add_generation_prompt }}"
        "|{{ enable_thinking }}|{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% break %}{% endfor %}"
    )
    out = tok.apply_chat_template(
        [{"role": "user", "content": "<é>"}, {"role": "user", "content": "skipped"}],
        tools=[{"name": "f"}], enable_thinking=False,
    )
    year = datetime.now().strftime("%Y")
    assert out == f'{{"role": "user", "content": "<é>"}}|[{{"name": "f"}}]|{year}|True|False|<é>'


def test_template_raise_exception_is_a_request_error() -> None:
    tok = _with_template("{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}")
    with pytest.raises(RequestError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_no_template() -> None:
    hf = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = Tokenizer(hf, bos_token_id=None, eos_token_ids=[], chat_template=None, byte_level=False)
    with pytest.raises(RequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---- template parsing at load and the rendering budget -----------------------------------------


def test_a_template_that_does_not_parse_fails_the_load() -> None:
    with pytest.raises(ModelFormatError, match=r"chat template does not parse \(line 1"):
        _with_template("{% for m in messages %}{{ m.content }")


@pytest.mark.parametrize(("template", "says"), [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "longer than 0.5 s"),
    ("{{ 'x' * 10**10 }}", "over the limit of 100000"),
    ("{{ 'x'|center(10**9) }}", "over the limit of 100000"),
    ("{{ '%1000000000s' % 'x' }}", "over the limit of 100000"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "over the limit of 100000"),
    ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}", "a prompt of"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
])
def test_template_budget_turns_runaway_templates_into_request_errors(template: str, says: str) -> None:
    tok = _with_template(template)
    with pytest.raises(RequestError, match=says) as info:
        tok.apply_chat_template([{"role": "user", "content": "abc"}],
                                budget=TemplateBudget(seconds=0.5, max_chars=100_000))
    assert info.value.param == "messages" and "chat template" in str(info.value)


def test_template_budget_leaves_real_templates_alone(smol: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi " * 1000}]
    assert smol.apply_chat_template(messages, budget=TemplateBudget(seconds=5, max_chars=10_000)).count("hi ") == 1000


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "bos_token", "documents", "raise_exception"])
def test_reserved_template_kwargs_are_request_errors(name: str) -> None:
    template = ChatTemplate("{{ messages[0].content }}")
    with pytest.raises(RequestError, match=name) as info:
        template.render([{"role": "user", "content": "x"}], template_kwargs={name: 1})
    assert info.value.param == "chat_template_kwargs"
    assert template.render([{"role": "user", "content": "x"}], template_kwargs={"enable_thinking": 1}) == "x"


def test_encode_as_text_reads_special_token_text_as_text(smol: Tokenizer) -> None:
    im_end = smol.encode("<|im_end|>")
    assert len(im_end) == 1  # a control token when rendered by the template
    as_text = smol.encode_as_text("<|im_end|>")
    assert im_end[0] not in as_text and len(as_text) > 1
    assert smol.decode(as_text) == "<|im_end|>"
    assert smol.encode_as_text("plain words") == smol.encode("plain words", add_special_tokens=False)
