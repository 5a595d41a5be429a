"""Structured output: a request's grammar, compiled with llguidance, as a token mask per step.

`GuidedDecoding` (on SamplingParams) names the grammar; `GrammarCompiler` turns it into a
`Guide` (an llguidance matcher over the model's tokenizer) when the request is made, so a
bad or unsatisfiable grammar is a RequestError then, never mid-generation. Compiled matchers
are cached per spec: a request repeating a schema gets a copy of the cached one, in
microseconds, instead of a compile (tens of milliseconds for a nested schema). Each step the
engine asks every constrained request's guide for its mask row (u32 words, bit j % 32 of word
j // 32 allows token j: the sample_top_k op's mask operand; `StepMasks`, computed while the
device runs a replayed step), samples with it, and advances the guide with the chosen token.
When the grammar admits no further token the request stops. A speculating request's proposals
are cut where the grammar stops accepting them, and its verify step gets a mask per row: the
guide consumes the proposals to compute them and rolls them back (vkrt/engine/speculative.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from vkrt.engine.json_bounds import DEFAULT_MAX_DIGITS, any_object, bound_numbers
from vkrt.errors import RequestError, VkrtError
from vkrt.ops.sampling import ALL_ALLOWED, mask_words

if TYPE_CHECKING:
    from vkrt.engine.request import Request
    from vkrt.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GuidedKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
PARAM = "guided_decoding"
# Whitespace JSON may hold between tokens: llama.cpp's json-schema-to-grammar `space` rule (a
# space, or one or two newlines and up to 20 spaces or tabs). llguidance's default, any run
# of whitespace, let SmolLM2-135M fill max_tokens with tabs and newlines inside an object.
JSON_WHITESPACE = r"(?:\x20|\n{1,2}[\x20\t]{0,20})?"
# Compiled grammars kept per GrammarCompiler; a cached matcher holds its lexer tables (for a
# nested schema over a 49k vocabulary, well under a megabyte).
GRAMMAR_CACHE_SIZE = 64


@dataclass(frozen=True)
class GuidedDecoding:
    """The grammar one request's output must match.

    kind "json": `spec` is a JSON schema (dict or its JSON text); with strict=False keywords
    llguidance does not implement are ignored instead of rejected. "json_object": any JSON
    object (`spec` unused). "regex": `spec` is a regular expression (Rust regex syntax) the
    whole output matches. "choice": `spec` is a list of strings, the output is one of them.
    "grammar": `spec` is a Lark grammar (llguidance's dialect; GBNF is converted).
    "structural_tag": `spec` is vLLM's structural tag (dict or its JSON text): `{"structures":
    [{"begin", "schema", "end"}], "triggers": [...]}`, free text in which each structure, once
    its trigger is written, continues with JSON valid for its schema, then its end.

    `max_digits` bounds the JSON numbers of the schema kinds ("json", "json_object", the
    structural tag's schemas), as llama.cpp does, so that a small model's run-on `1111...`
    ends: an integer or number the schema leaves unbounded gets at most that many digits
    (a number at most min(max_digits, 10) after the point); None leaves them unbounded
    (vkrt/engine/json_bounds.py). Bounds the schema gives itself are kept.
    """

    kind: GuidedKind
    spec: Any = None
    strict: bool = True
    max_digits: int | None = DEFAULT_MAX_DIGITS

    def validate(self) -> None:
        """Raise RequestError for a malformed spec (the grammar itself is checked at compile)."""
        if self.kind not in KINDS:
            raise RequestError(f"{PARAM}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}", param=PARAM)
        if self.kind == "json" and not isinstance(self.spec, (dict, str, bool)):
            raise RequestError(f"{PARAM}: a json schema must be an object (or its JSON text)", param=PARAM)
        if self.kind in ("regex", "grammar") and not (isinstance(self.spec, str) and self.spec):
            raise RequestError(f"{PARAM}: a {self.kind} must be a non-empty string", param=PARAM)
        if self.kind == "choice" and not (
                isinstance(self.spec, (list, tuple)) and self.spec
                and all(isinstance(c, str) and c for c in self.spec)):
            raise RequestError(f"{PARAM}: choice must be a non-empty list of non-empty strings", param=PARAM)
        if self.kind == "structural_tag" and not isinstance(self.spec, (dict, str)):
            raise RequestError(f"{PARAM}: a structural tag must be an object (or its JSON text)", param=PARAM)
        if self.max_digits is not None and not (isinstance(self.max_digits, int) and 1 <= self.max_digits <= 18):
            raise RequestError(f"{PARAM}: max_digits must be None or 1..18, got {self.max_digits!r}", param=PARAM)

    def grammar(self) -> str:
        """The llguidance grammar definition of this spec."""
        import llguidance

        matcher = llguidance.LLMatcher
        options: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not self.strict}
        if self.kind == "json_object":
            schema = any_object(self.max_digits)
            return str(matcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
        if self.kind == "json":
            schema = json.loads(self.spec) if isinstance(self.spec, str) else self.spec
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            schema = bound_numbers(schema, self.max_digits)
            return str(matcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
        if self.kind == "regex":
            return str(matcher.grammar_from_regex(self.spec))
        if self.kind == "choice":
            return str(matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.spec)))
        if self.kind == "structural_tag":
            return _structural_tag_grammar(json.loads(self.spec) if isinstance(self.spec, str) else self.spec,
                                           self.max_digits)
        return str(llguidance.grammar_from("grammar", self.spec))  # Lark, or GBNF converted to Lark


def _structural_tag_grammar(tag: Any, max_digits: int | None) -> str:
    """vLLM's structural tag as llguidance's: each structure under the trigger its begin starts with."""
    import llguidance

    if not isinstance(tag, dict) or "format" in tag:
        raise ValueError('expected {"structures": [...], "triggers": [...]} (the "format" form is not supported)')
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("triggers must be a non-empty list of non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise ValueError("structures must be a non-empty list")
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not all(isinstance(structure.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"structures.{i} must have string begin and end")
        schema = structure.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"structures.{i}.schema must be a JSON schema object")
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures.{i}.begin {structure['begin']!r} starts with none of the triggers")
        schema = {**bound_numbers(schema, max_digits), "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar=schema,
                                         end=structure["end"]))
    # Triggers are text: a tokenizer's special tokens are not assumed to spell them.
    return str(llguidance.StructTag.to_grammar(tags, assume_special=False))


class Guide:
    """One request's grammar state: the mask of tokens allowed next, advanced per token."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-next-token bits into `row` (u32 [ceil(V / 32)], contiguous)."""
        assert row.dtype == np.uint32 and row.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def fill_masks(self, rows: np.ndarray, proposals: Sequence[int]) -> None:
        """A verify step's masks (speculative decoding): row 0 for the next token, row i + 1 for
        the token after proposals[i], each computed with the proposals before it consumed; the
        guide is back where it was afterwards. The proposals must be ones `valid_prefix` passed."""
        consumed = 0
        try:
            self.fill_mask(rows[0])
            for i in range(1, rows.shape[0]):
                if not self._matcher.consume_token(proposals[i - 1]):
                    raise ValueError(f"the grammar rejected proposal {proposals[i - 1]}: {self.error}")
                consumed += 1
                self.fill_mask(rows[i])
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here (the guide is unchanged)."""
        return int(self._matcher.validate_tokens(list(tokens))) if tokens else 0

    def advance(self, token_id: int) -> bool:
        """Consume the sampled token; False if the grammar rejects it (the matcher's error)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_complete(self) -> bool:
        """True when the grammar admits no further token (the output is a full match)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Compiles GuidedDecoding specs against one model's tokenizer (built once, on first use:
    llguidance's tokenizer takes ~1 s to index a 49k vocabulary). Thread-safe: requests are
    made, and their grammars compiled, on whatever thread makes them (the server's workers)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = mask_words(vocab_size)
        self.num_compiled = 0  # grammars actually compiled (cache misses)
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._cache_lock = threading.Lock()
        # spec key -> a compiled matcher that is never advanced, or the error message it gave
        self._cache: OrderedDict[tuple[str, str, bool, int | None], Any] = OrderedDict()

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise RequestError(f"{PARAM}: structured output needs the model's tokenizer, and this "
                                       "model was loaded without one", param=PARAM)
                import llguidance

                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        self.tokenizer.hf_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                except Exception as exc:  # llguidance raises plain ValueError/RuntimeError
                    raise VkrtError(f"llguidance could not index this model's tokenizer: {exc}") from exc
            return self._ll_tokenizer

    def compile(self, guided: GuidedDecoding) -> Guide:
        """A fresh Guide for one request (a copy of the cached matcher, compiled on a miss);
        RequestError naming the feature if the grammar is unsupported, malformed or unsatisfiable."""
        return Guide(self._pristine(guided).deep_copy())

    def _pristine(self, guided: GuidedDecoding) -> Any:
        guided.validate()
        key = _cache_key(guided)
        with self._cache_lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if entry is None:  # compiled outside the lock: two threads may both compile a new spec
            entry = self._build(guided)
            with self._cache_lock:
                self.num_compiled += 1
                self._cache[key] = entry
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise RequestError(entry, param=PARAM)
        return entry

    def _build(self, guided: GuidedDecoding) -> Any:
        """A compiled matcher, or the message of the RequestError the spec deserves."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        try:
            grammar = guided.grammar()
        except (ValueError, TypeError) as exc:
            return f"{PARAM}: invalid {guided.kind}: {exc}"
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"{PARAM}: unsupported or invalid {guided.kind}: {matcher.get_error()}"
        # The first mask builds the lexer's tables (milliseconds for a nested schema); built
        # here, off the engine thread, every copy shares them.
        Guide(matcher).fill_mask(np.empty(self.words, np.uint32))
        return matcher


def _cache_key(guided: GuidedDecoding) -> tuple[str, str, bool, int | None]:
    spec = guided.spec
    text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
    return guided.kind, text, guided.strict, guided.max_digits


class StepMasks:
    """The token masks of one step's sampled rows: u32 [len(requests), words], row i for
    requests[i], all ones where unconstrained. Computed once, when the runner calls it: while
    the device runs a replayed step (the grammar states after the previous tokens are known),
    otherwise before the step. A guide that fails leaves its row all ones and is named in
    `failed`; the engine aborts that request instead of using its token."""

    def __init__(self, requests: Sequence[Request], words: int) -> None:
        self.requests = requests
        self.words = words
        self.masks: np.ndarray | None = None
        self.failed: dict[int, str] = {}  # row -> what the guide raised
        self.seconds = 0.0  # host time computing them

    @classmethod
    def of(cls, requests: Sequence[Request], words: int) -> StepMasks | None:
        """None when no request is constrained (no mask exists at all)."""
        return cls(requests, words) if any(r.guide is not None for r in requests) else None

    def __call__(self) -> np.ndarray:
        start = time.perf_counter()
        masks = np.full((len(self.requests), self.words), ALL_ALLOWED, np.uint32)
        i = 0
        while i < len(self.requests):
            request = self.requests[i]
            rows = 1  # a verifying request has a row for its token and one after each proposal
            while i + rows < len(self.requests) and self.requests[i + rows] is request:
                rows += 1
            if request.guide is not None:
                try:
                    if rows == 1:
                        request.guide.fill_mask(masks[i])
                    else:
                        request.guide.fill_masks(masks[i:i + rows], request.spec_token_ids)
                except Exception as exc:  # llguidance raises plain ValueError/RuntimeError
                    for row in range(i, i + rows):
                        self.failed[row] = f"{type(exc).__name__}: {exc}"
                    masks[i:i + rows] = ALL_ALLOWED
            i += rows
        self.masks = masks
        self.seconds = time.perf_counter() - start
        return masks
