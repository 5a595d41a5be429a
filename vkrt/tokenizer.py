"""Tokenizers (HF `tokenizers`, from tokenizer.json or rebuilt from GGUF metadata) and chat templates."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from vkrt import config
from vkrt.chat_template import ChatTemplate, TemplateBudget
from vkrt.errors import ModelFormatError, NoTokenizerError, RequestError, UnsupportedModelError

if TYPE_CHECKING:
    from vkrt.loader.config import LoadedModel
    from vkrt.loader.gguf_file import GGUFFile

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Token texts llama.cpp also treats as end-of-generation when the GGUF marks them as control.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>",
    "<|return|>", "<|call|>",  # harmony (gpt-oss): a final answer, a tool call
})
# Harmony's <|end|> closes a message, not the turn (the analysis before the final answer): a
# vocabulary with <|return|> and <|call|> does not stop on it, as llama.cpp decides.
_HARMONY_ENDS = frozenset({"<|return|>", "<|call|>"})

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerSpec:
    """How a GGUF `tokenizer.ggml.pre` value splits text before byte-level BPE."""

    split_regex: str | None  # None: ByteLevel's own GPT-2 regex
    individual_digits: bool = False
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key

    def build(self) -> pre_tokenizers.PreTokenizer:
        steps: list[pre_tokenizers.PreTokenizer] = []
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if self.split_regex is not None:
            steps.append(pre_tokenizers.Split(Regex(self.split_regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=self.split_regex is None))
        return pre_tokenizers.Sequence(steps)


_SMOLLM = _PreTokenizerSpec(split_regex=None, individual_digits=True)
_LLAMA3 = _PreTokenizerSpec(split_regex=_LLAMA3_RE, ignore_merges=True, add_bos=True)
_GPT2 = _PreTokenizerSpec(split_regex=None)
_QWEN2 = _PreTokenizerSpec(split_regex=_QWEN2_RE)
_QWEN35 = _PreTokenizerSpec(split_regex=_QWEN35_RE)
_TEKKEN = _PreTokenizerSpec(split_regex=_TEKKEN_RE, ignore_merges=True, add_bos=True)  # Mistral Nemo, Ministral
_GPT4O = _PreTokenizerSpec(split_regex=_GPT4O_RE)

# `tokenizer.ggml.pre` names (llama.cpp's llama-vocab) -> split; the regexes are the ones
# transformers' GGUF loader uses for the same names, so ids match its.
PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": _SMOLLM,
    "starcoder": _SMOLLM,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    "gpt-4o": _GPT4O,
}


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_id_or_none(tok: HFTokenizer, content: Any) -> int | None:
    if isinstance(content, dict):
        content = content.get("content")
    return tok.token_to_id(content) if isinstance(content, str) else None


# Fill-in-the-middle roles: the GGUF key naming each one's token, and how vocabularies spell
# it (Qwen2.5-Coder's, then StarCoder's), for a tokenizer whose file names none.
FIM_ROLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "prefix": ("tokenizer.ggml.fim_pre_token_id", ("<|fim_prefix|>", "<fim_prefix>")),
    "suffix": ("tokenizer.ggml.fim_suf_token_id", ("<|fim_suffix|>", "<fim_suffix>")),
    "middle": ("tokenizer.ggml.fim_mid_token_id", ("<|fim_middle|>", "<fim_middle>")),
    "repo": ("tokenizer.ggml.fim_rep_token_id", ("<|repo_name|>", "<repo_name>")),
    "file_sep": ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>", "<file_sep>")),
}


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        byte_level: bool,
        fim_token_ids: dict[str, int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        # Parsed now, so a template that does not parse fails the load, not every request.
        self._template = ChatTemplate(chat_template) if chat_template else None
        self._byte_level = byte_level
        self._text_tok: HFTokenizer | None = None  # a copy that reads special-token text as text
        self._fim_token_ids = dict(fim_token_ids or {})
        for role, (_, spellings) in FIM_ROLES.items():
            found = next((i for i in map(tokenizer.token_to_id, spellings) if i is not None), None)
            if found is not None:
                self._fim_token_ids.setdefault(role, found)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: LoadedModel | str | Path) -> Tokenizer:
        """The tokenizer belonging to a loaded model, a .gguf file or a HF directory."""
        path = Path(model if isinstance(model, (str, Path)) else model.path)
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, with chat template and special tokens from tokenizer_config.json."""
        model_dir = Path(path)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise NoTokenizerError(
                f"{model_dir}: no tokenizer.json; vkrt needs the fast-tokenizer file "
                "(save it with transformers' tokenizer.save_pretrained)"
            )
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelFormatError(f"{tok_file}: cannot be loaded ({exc})") from exc
        tok_cfg = _read_optional_json(model_dir / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                raise ModelFormatError(f"{jinja_file}: cannot be read as UTF-8 text; fix or re-download it") from None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)

        eos_ids: list[int] = []
        eos = _token_id_or_none(tok, tok_cfg.get("eos_token"))
        if eos is not None:
            eos_ids.append(eos)
        for cfg_name in ("generation_config.json", "config.json"):
            value = _read_optional_json(model_dir / cfg_name).get("eos_token_id")
            eos_ids += [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]
        decoder = tok.decoder
        byte_level = decoder is not None and "ByteLevel" in repr(decoder)
        return cls(
            tok,
            bos_token_id=_token_id_or_none(tok, tok_cfg.get("bos_token")),
            eos_token_ids=eos_ids,
            chat_template=template if isinstance(template, str) else None,
            byte_level=byte_level,
        )

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | GGUFFile) -> Tokenizer:
        """Rebuild the tokenizer stored in GGUF metadata (byte-level BPE or SentencePiece-llama)."""
        from vkrt.loader import gguf_checks, validate
        from vkrt.loader.gguf_loader import field_value, open_gguf

        reader = open_gguf(path_or_reader) if isinstance(path_or_reader, (str, Path)) else path_or_reader
        source = str(getattr(reader.data, "filename", None) or path_or_reader)

        def get(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return field_value(field) if field is not None else default

        kind = get("tokenizer.ggml.model")
        tokens: list[str] | None = get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise NoTokenizerError(f"{source}: no tokenizer in the GGUF metadata; use a GGUF that embeds one")
        token_types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        scores: list[float] = get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(token_types) != len(tokens) or len(scores) != len(tokens):
            raise ModelFormatError(
                f"{source}: tokenizer arrays disagree ({len(tokens)} tokens, {len(token_types)} types, "
                f"{len(scores)} scores); the GGUF is corrupt"
            )
        validate.gguf_token_list(source, tokens)
        validate.gguf_tokenizer(source, {k: get(k) for k in (*validate.GGUF_TOKEN_IDS, *validate.GGUF_TOKENIZER_STRINGS)},
                                len(tokens))
        if kind == "gpt2":
            pre_name = get("tokenizer.ggml.pre", "default")
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise UnsupportedModelError(
                    f"{source}: pre-tokenizer {pre_name!r} is not supported "
                    f"(supported: {', '.join(PRE_TOKENIZERS)}); use the model's HF directory instead"
                )
            merges = get("tokenizer.ggml.merges")
            gguf_checks.bpe_merges(source, merges)
            tok = _vocabulary(source, lambda: _byte_level_bpe(tokens, merges, pre))
            add_bos_default, byte_level = pre.add_bos, True
        elif kind == "llama":
            add_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
            unk = get("tokenizer.ggml.unknown_token_id")
            arch = str(get("general.architecture", ""))
            tok = _vocabulary(source, lambda: _cached_sentencepiece_bpe(tokens, scores, arch, add_prefix, unk))
            add_bos_default, byte_level = True, False
        else:
            raise UnsupportedModelError(
                f"{source}: tokenizer model {kind!r} is not supported (supported: gpt2, llama); "
                "use the model's HF directory instead"
            )

        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, kind_ in zip(tokens, token_types, strict=True) if kind_ == _TOKEN_CONTROL
        ])
        # User-defined tokens match whole in the text, as in llama.cpp, unless the vocabulary
        # respelled them (Gemma's space runs: transformers reaches those through merges).
        tok.add_tokens([
            AddedToken(t, special=False, normalized=False)
            for t, kind_ in zip(tokens, token_types, strict=True)
            if kind_ == _TOKEN_USER_DEFINED and tok.token_to_id(t) is not None
        ])

        bos = get("tokenizer.ggml.bos_token_id")
        eos = get("tokenizer.ggml.eos_token_id")
        add_bos = bool(get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
        template_parts: list[str] = []
        special: list[tuple[str, int]] = []
        if add_bos and bos is not None:
            template_parts.append(tokens[bos])
            special.append((tokens[bos], bos))
        template_parts.append("$A")
        if add_eos and eos is not None:
            template_parts.append(tokens[eos])
            special.append((tokens[eos], eos))
        if special:
            tok.post_processor = _vocabulary(source, lambda: processors.TemplateProcessing(
                single=" ".join(template_parts), pair=" ".join(template_parts + ["$B:1"]), special_tokens=special
            ))

        eos_ids = [
            get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ]
        eog = {t: i for i, (t, k) in enumerate(zip(tokens, token_types, strict=True)) if k == _TOKEN_CONTROL and t in _EOG_TEXTS}
        if _HARMONY_ENDS <= eog.keys():
            eog.pop("<|end|>", None)
        eos_ids += list(eog.values())
        fim = {role: get(key) for role, (key, _) in FIM_ROLES.items()}
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=[i for i in eos_ids if isinstance(i, int)],
            chat_template=get("tokenizer.chat_template"),
            byte_level=byte_level,
            fim_token_ids={role: i for role, i in fim.items() if isinstance(i, int)},
        )

    # ---- properties ---------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (eos, end-of-turn, ...), primary eos first."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def fim_token_ids(self) -> dict[str, int]:
        """The fill-in-the-middle tokens the vocabulary has, by role (FIM_ROLES): from the GGUF's
        keys, else found by their spelling; empty for a model without them."""
        return self._fim_token_ids

    @property
    def bos_token(self) -> str | None:
        return None if self._bos_token_id is None else self._tok.id_to_token(self._bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._tok.id_to_token(self._eos_token_ids[0]) if self._eos_token_ids else None

    # ---- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens such as a BOS are added if the model asks for them.

        Encode a rendered chat prompt with add_special_tokens=False: templates add their own BOS.
        """
        # encode_batch releases the GIL (encode does not): a long prompt tokenised in a worker
        # thread then leaves the server's event loop running.
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair as the tokenizer's pair template joins them (a cross-encoder's
        query and document: [CLS] a [SEP] b [SEP] for BERT's, the two texts' ids for Qwen's)."""
        return list(self._tok.encode_batch([(first, second)], add_special_tokens=True)[0].ids)

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry spelled exactly `token`, or None."""
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token text (say "<|im_end|>") tokenised as plain text."""
        if self._text_tok is None:
            copy = HFTokenizer.from_str(self._tok.to_str())
            copy.encode_special_tokens = True
            self._text_tok = copy
        return list(self._text_tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def hf_json(self) -> str:
        """The HF `tokenizers` serialisation (tokenizer.json text) of this tokenizer."""
        return str(self._tok.to_str())

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (for logprobs); partial UTF-8 shows as U+FFFD."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it ("Ġis", "▁is", "<0x0A>"), as transformers'
        convert_ids_to_tokens gives it."""
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes to the text (for OpenAI `bytes` fields)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = _unicode_to_byte()
        if self._byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if not self._byte_level and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self.token_text(token_id).encode("utf-8")

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        budget: TemplateBudget | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does, within
        `budget` (RequestError if the template fails or goes over it)."""
        if self._template is None:
            raise RequestError("this model has no chat template; send a plain completion prompt instead")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     budget=budget, template_kwargs=template_kwargs)


class IncrementalDetokenizer:
    """Turns a stream of token ids into new text, never splitting a UTF-8 character.

    vLLM's prefix-offset technique: decode a short window ending at the new token and emit
    what it adds beyond the window's already-emitted prefix, so byte-level pieces that
    only form a character together wait until the character is complete.
    """

    # How many prompt tokens to include as context for the first generated token (as vLLM).
    PROMPT_CONTEXT = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])[-(self.PROMPT_CONTEXT + 1) :]
        self._read = len(self._ids)
        self._prefix = max(self._read - self.PROMPT_CONTEXT, 0)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is partial)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        new_text = full_text[len(prefix_text) :]
        # Keep only the window the next call needs.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return new_text


# ---- GGUF vocabularies -> tokenizers models ------------------------------------------------


def _vocabulary(source: str, build: Callable[[], _T]) -> _T:
    """Run a `tokenizers` constructor on GGUF vocabulary data: its failures mean a corrupt file."""
    try:
        return build()
    except Exception as exc:  # tokenizers raises bare Exception (e.g. a merge naming no token)
        raise ModelFormatError(f"{source}: the tokenizer in the GGUF metadata is inconsistent "
                               f"({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); "
                               "the file is corrupt, download or convert it again") from exc


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: _PreTokenizerSpec) -> HFTokenizer:
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    model = models.BPE(vocab=_first_ids(tokens), merges=pairs, ignore_merges=pre.ignore_merges)
    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre.build()
    tok.decoder = decoders.ByteLevel()
    return tok


# Architectures whose SentencePiece GGUF vocabularies transformers rebuilds its own way
# (transformers' integrations/gguf tokenizer builders; token ids must equal its).
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})
_PREPEND_NORMALIZER_ARCHS = frozenset({"phi3"})


def _spm_merges(tokens: Sequence[str], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary, best first (transformers' `generate_merges`).

    Every split of a piece into two vocabulary entries is a merge, ranked by the piece's
    priority, then by the longer left part, then the longer right part; ties keep vocabulary order.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, str]] = []
    for order, (piece, score) in enumerate(priority.items()):
        local: list[tuple[int, int, int]] = []
        for cut in range(1, len(piece)):
            left_id = vocab.get(piece[:cut])
            if left_id is not None and (right_id := vocab.get(piece[cut:])) is not None:
                local.append((left_id, right_id, cut))
        if len(local) > 1:
            local.sort()
        for j, (_, _, cut) in enumerate(local):
            # (priority, longer left, longer right, vocabulary order): ascending sort = best first.
            ranked.append((-score, -cut, cut - len(piece), order, j, piece))
    ranked.sort()
    return [(piece[:-neg_left], piece[-neg_left:]) for _, neg_left, _, _, _, piece in ranked]


def _sentencepiece_bpe(
    tokens: Sequence[str], scores: Sequence[float], arch: str, add_prefix: bool, unk_id: int | None
) -> HFTokenizer:
    """SentencePiece-BPE as a tokenizers BPE with byte fallback, built as transformers builds it from a GGUF.

    - Gemma: space-run tokens are respelled with U+2581 (the file stores real spaces), merges
      follow vocabulary order (Gemma's scores do not), and no space is prepended.
    - Phi-3: a normalizer prepends the space, so it is also added after each special token.
    - Others (Llama 2, Mistral, TinyLlama): Metaspace prepends it once, at the start of the text,
      when the GGUF asks for a space prefix (llama.cpp's `add_space_prefix`, default true).
    """
    if arch in _GEMMA_ARCHS:
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority: dict[str, float] = {t: -float(i) for i, t in enumerate(tokens)}
        add_prefix = False
    else:
        priority = dict(zip(tokens, scores, strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, priority),
        unk_token=tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else (
            "<unk>" if "<unk>" in vocab else None),  # transformers' default unk_token
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    if arch in _GEMMA_ARCHS:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch in _PREPEND_NORMALIZER_ARCHS:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        add_prefix = True
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    dec: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


# Bump when _sentencepiece_bpe builds a different pipeline: cached JSON of older builds is then ignored.
_SPM_CACHE_VERSION = 1
_SPM_CACHE_MIN_TOKENS = 32768  # smaller vocabularies build in well under a second


def _cached_sentencepiece_bpe(
    tokens: Sequence[str], scores: Sequence[float], arch: str, add_prefix: bool, unk_id: int | None
) -> HFTokenizer:
    """`_sentencepiece_bpe`, kept as tokenizer JSON under <VKRT_CACHE>/tokenizers/.

    Deriving a 262k-token vocabulary's merges costs ~2.5 s of CPU at every start; loading the
    JSON ~1 s. The file is named by a digest of everything the build reads, and written atomically.
    """
    if len(tokens) < _SPM_CACHE_MIN_TOKENS:
        return _sentencepiece_bpe(tokens, scores, arch, add_prefix, unk_id)
    digest = hashlib.sha256(f"{_SPM_CACHE_VERSION}|{arch}|{add_prefix}|{unk_id}|{len(tokens)}|".encode())
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(array("d", scores).tobytes())
    path = config.cache_dir() / "tokenizers" / f"spm-{digest.hexdigest()[:32]}.json"
    if path.is_file():
        try:
            return HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises bare Exception on a damaged file: rebuild it
            log.warning("ignoring the damaged tokenizer cache %s (%s)", path, str(exc).splitlines()[0][:100])
    tok = _sentencepiece_bpe(tokens, scores, arch, add_prefix, unk_id)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(tok.to_str(), encoding="utf-8")
        os.replace(part, path)
    except OSError as exc:  # a read-only cache only costs the rebuild next time
        part.unlink(missing_ok=True)
        log.debug("tokenizer cache not written to %s (%s)", path, exc)
    return tok


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc}); fix or re-download the file") from exc
    return value if isinstance(value, dict) else {}
