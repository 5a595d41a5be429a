"""Structured output through the engine: the default SmolLM2 on Vulkan, constrained by JSON
schemas, regexes, choices and grammars, stays valid for the constraint whatever it samples;
the constrained decode step stays one replayed submit with no drain and reads back only ids;
bad grammars are RequestErrors when the request is added."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vkrt.engine import LLM, GuidedDecoding, SamplingParams
from vkrt.engine.guided import Guide
from vkrt.engine.request import Request
from vkrt.engine.sampler import Sampler
from vkrt.errors import RequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24},  # optional
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {  # nested objects, an array of objects, enums, bounded numbers
    "type": "object",
    "properties": {
        "customer": PERSON,
        "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["A1", "B2", "C3"]},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number", "minimum": 0.5, "maximum": 99.5},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["customer", "items", "status"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4}


def violations(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """What in `value` breaks `schema` (the subset of JSON Schema the tests use)."""
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    kind = schema.get("type")
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kind is not None and not checks[kind](value):
        return [*errors, f"{path}: {value!r} is not {kind}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30):
            errors.append(f"{path}: length {len(value)} outside the bounds")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30):
            errors.append(f"{path}: {len(value)} items outside the bounds")
        for i, item in enumerate(value):
            errors += violations(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{path}: missing {key}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += violations(item, properties[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected {key}")
    return errors


def test_the_checker_catches_violations() -> None:
    good = {"customer": {"name": "Ann", "age": 30}, "items": [{"sku": "A1", "quantity": 2}], "status": "new"}
    assert violations(good, ORDER) == []
    bad = {"customer": {"name": "", "age": 130, "x": 1}, "items": [], "status": "lost", "express": 1}
    assert len(violations(bad, ORDER)) == 6


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> LLM:
    return LLM(smollm2_path, device="vulkan", max_model_len=512, max_num_seqs=8)


def chat(llm: LLM, content: str) -> str:
    assert llm.tokenizer is not None
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def json_params(schema: dict[str, Any], seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 200, "seed": seed, "guided_decoding": GuidedDecoding("json", schema), **kw})


# Device sampling (greedy, top-k) and host sampling (top_k off, logprobs, penalties).
SAMPLING = [
    {"temperature": 0.0}, {"temperature": 0.9, "top_k": 40}, {"temperature": 1.0},
    {"temperature": 0.7, "logprobs": 2}, {"temperature": 0.8, "top_k": 20, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("schema", [PERSON, ORDER, TAGS], ids=["person", "order", "tags"])
def test_json_schemas_parse_and_validate(llm: LLM, vk_default: Any, schema: dict[str, Any]) -> None:
    prompt = chat(llm, "Reply in JSON: " + json.dumps(schema))
    params = [json_params(schema, seed, **kw) for seed, kw in enumerate(SAMPLING)]
    for output, p in zip(llm.generate([prompt] * len(params), params), params, strict=True):
        assert output.finish_reason == "stop", (p, output.text)
        value = json.loads(output.text)
        assert violations(value, schema) == [], output.text
        if p.logprobs is not None:  # the raw model's logprobs, one entry per token
            assert output.outputs[0].logprobs is not None
            assert len(output.outputs[0].logprobs) == len(output.token_ids)


def test_json_object(llm: LLM, vk_default: Any) -> None:
    params = [SamplingParams(max_tokens=200, seed=seed, temperature=0.8, top_k=30,
                             guided_decoding=GuidedDecoding("json_object")) for seed in range(4)]
    for output in llm.generate([chat(llm, "Describe a cat.")] * 4, params):
        assert output.finish_reason == "stop", output.text
        assert isinstance(json.loads(output.text), dict)


def test_regex_over_many_seeds(llm: LLM, vk_default: Any) -> None:
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9] [A-Z][a-z]{1,8}"
    params = [SamplingParams(max_tokens=40, seed=seed, temperature=1.2, top_k=50 if seed % 2 else 0,
                             guided_decoding=GuidedDecoding("regex", pattern)) for seed in range(16)]
    outputs = llm.generate([chat(llm, "When and where?")] * len(params), params)
    for output in outputs:
        assert output.finish_reason == "stop"
        assert re.fullmatch(pattern, output.text), output.text
    assert len({o.text for o in outputs}) > 1  # the seeds really do sample


def test_choice_over_many_seeds(llm: LLM, vk_default: Any) -> None:
    choices = ["positive", "negative", "neutral", "mixed feelings"]
    params = [SamplingParams(max_tokens=20, seed=seed, temperature=1.5, top_k=64 if seed % 2 else 0,
                             guided_decoding=GuidedDecoding("choice", choices)) for seed in range(16)]
    outputs = llm.generate([chat(llm, "Sentiment of: I love rain.")] * len(params), params)
    for output in outputs:
        assert output.finish_reason == "stop"
        assert output.text in choices


def test_lark_grammar(llm: LLM, vk_default: Any) -> None:
    grammar = 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[1-9][0-9]?/'
    params = [SamplingParams(max_tokens=40, seed=seed, temperature=1.0, top_k=40,
                             guided_decoding=GuidedDecoding("grammar", grammar)) for seed in range(4)]
    for output in llm.generate([chat(llm, "Add some numbers.")] * 4, params):
        if output.finish_reason == "stop":
            assert re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)*\)", output.text), output.text
        else:  # a long list of numbers: cut by max_tokens, still a prefix of the language
            assert output.finish_reason == "length"
            assert re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)*,?", output.text), output.text


def test_max_tokens_cuts_with_length(llm: LLM, vk_default: Any) -> None:
    outputs = llm.generate([chat(llm, "An order, please.")] * 2,
                           [json_params(ORDER, 0, temperature=0.0, max_tokens=6),
                            json_params(ORDER, 1, temperature=1.0, max_tokens=6)])
    for output in outputs:
        assert output.finish_reason == "length"
        assert len(output.token_ids) == 6
        assert output.text.lstrip().startswith("{")


def test_constrained_decode_stays_one_replayed_submit(smollm2_path: Path, vk_default: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(smollm2_path, device="vulkan", max_model_len=512, max_num_seqs=4)
    mask_seconds: list[float] = []
    llm.engine.stats_listeners.append(lambda s: mask_seconds.append(s.mask_seconds) if s.mask_seconds else None)
    counters = llm.engine.model.backend.counters
    in_flight: list[int] = []  # per llguidance mask: submits not yet waited for
    fill_mask = Guide.fill_mask

    def noting(guide: Guide, row: np.ndarray) -> None:
        in_flight.append(counters.submits - counters.fence_waits)
        fill_mask(guide, row)

    monkeypatch.setattr(Guide, "fill_mask", noting)
    params = [json_params(PERSON, 0, temperature=0.0), json_params(PERSON, 1, temperature=0.8, top_k=40),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]  # one unconstrained row
    outputs = llm.generate([chat(llm, "A person as JSON.")] * 3, params)
    for output in outputs[:2]:
        assert violations(json.loads(output.text), PERSON) == []
    stats = llm.stats()
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= 10
    assert worst["submits"] == 1 and worst["drains"] == 0
    # Only ids come back: less than one row of logits (49152 float32) per step.
    assert worst["bytes_down"] < llm.engine.vocab_size * 4
    assert stats["last_step"]["replayed"]
    assert len(mask_seconds) >= 10
    # Every decode step's masks were computed after its submit, while the device ran it; only
    # the compile's first mask and the prefill's two (an eager step submits after its masks)
    # were computed with nothing in flight.
    assert worst["host_overlaps"] == 1
    assert in_flight.count(1) >= 20 and in_flight.count(0) <= 3


def test_eager_steps_apply_the_mask_too(smollm2_path: Path, vk_default: Any) -> None:
    llm = LLM(smollm2_path, device="vulkan", max_model_len=256, max_num_seqs=2, enable_replay=False)
    params = [SamplingParams(max_tokens=12, seed=seed, temperature=1.0, top_k=40,
                             guided_decoding=GuidedDecoding("regex", r"[A-Z]{3}[0-9]{3}")) for seed in range(2)]
    for output in llm.generate([chat(llm, "A code?")] * 2, params):
        assert re.fullmatch(r"[A-Z]{3}[0-9]{3}", output.text), output.text
    assert llm.stats()["decode_counters_max"]["drains"] == 0


@pytest.mark.parametrize("guided, feature", [
    (GuidedDecoding("json", {"type": "foo"}), "Invalid type"),
    (GuidedDecoding("json", {"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
    (GuidedDecoding("json", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
    (GuidedDecoding("json", {"type": "string", "format": "no-such-format"}), "format"),
    (GuidedDecoding("json", "{not json"), "invalid json"),
    (GuidedDecoding("regex", "(unclosed"), "unclosed"),
    (GuidedDecoding("choice", []), "choice"),
    (GuidedDecoding("grammar", "start: undefined_rule"), "undefined_rule"),
    (GuidedDecoding("xml", "<a/>"), "kind"),  # type: ignore[arg-type]
], ids=["type", "unsatisfiable", "ref", "format", "not-json", "regex", "choice", "lark", "kind"])
def test_bad_grammars_are_request_errors(llm: LLM, guided: GuidedDecoding, feature: str) -> None:
    params = SamplingParams(max_tokens=4, guided_decoding=guided)
    with pytest.raises(RequestError, match=re.escape(feature)) as info:
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert info.value.param == "guided_decoding"
    assert not llm.engine.has_unfinished()
    good = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, guided_decoding=GuidedDecoding("regex", "ok")))
    assert good[0].text == "ok"


class _Allowing:
    """A stand-in guide: the sampler only needs to know the row is constrained."""


def test_host_sampler_draws_only_allowed_tokens(rng: np.random.Generator) -> None:
    vocab = 1000
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    allowed = np.zeros((3, vocab), bool)
    allowed[:, [5, 300, 999]] = True
    padded = np.concatenate([allowed, np.zeros((3, 24), bool)], axis=1)  # to whole u32 words
    masks = np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=40),
             SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2)]
    for seed in range(30):
        requests = [Request(str(i), [1, 2], p, generator_seed=seed) for i, p in enumerate(kinds)]
        for r in requests:
            r.guide = _Allowing()  # type: ignore[assignment]
        out = Sampler().sample(logits, requests, masks)
        assert all(allowed[i, t] for i, t in enumerate(out.token_ids))
        assert out.token_ids[0] == [5, 300, 999][int(np.argmax(logits[0, [5, 300, 999]]))]


def test_compiled_grammars_are_cached_per_spec(smollm2_path: Path) -> None:
    """A spec seen before is not compiled again (key order of a schema does not matter), each
    request still gets its own matcher state, and a bad spec fails the same way every time."""
    from vkrt.engine.guided import GrammarCompiler
    from vkrt.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path)
    compiler = GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    first = compiler.compile(GuidedDecoding("json", schema))
    reordered = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    second = compiler.compile(GuidedDecoding("json", reordered))
    assert compiler.num_compiled == 1
    compiler.compile(GuidedDecoding("json", schema, strict=False))
    assert compiler.num_compiled == 2  # strictness changes the grammar
    # Independent states: advancing one guide leaves the other at the start.
    [brace] = tokenizer.encode("{", add_special_tokens=False)
    assert first.advance(brace)
    fresh, advanced = np.zeros(compiler.words, np.uint32), np.zeros(compiler.words, np.uint32)
    second.fill_mask(fresh)
    first.fill_mask(advanced)
    assert not np.array_equal(fresh, advanced)
    assert fresh[brace // 32] >> (brace % 32) & 1
    bad = GuidedDecoding("json", {"type": "string", "minLength": 5, "maxLength": 2})
    messages = []
    for _ in range(2):
        with pytest.raises(RequestError) as caught:
            compiler.compile(bad)
        messages.append(str(caught.value))
    assert messages[0] == messages[1] and "minLength" in messages[0]
    assert compiler.num_compiled == 3


def test_structural_tag_constrains_only_what_follows_a_trigger(smollm2_path: Path) -> None:
    """vLLM's structural tag: free text, but once a structure's begin is written its JSON must
    be valid for the schema and end with the structure's end."""
    from vkrt.engine.guided import GrammarCompiler
    from vkrt.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path)
    compiler = GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)
    tag = {"triggers": ["<function="], "structures": [{
        "begin": "<function=get_weather>", "end": "</function>",
        "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]}

    def accepts(text: str) -> bool:
        guide = compiler.compile(GuidedDecoding("structural_tag", tag))
        return all(guide.advance(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts("Any text at all, even {braces}.")
    assert accepts('Sure. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert not accepts('Sure. <function=get_weather>{"town": 1}')
    assert not accepts("<function=get_time>{}")
    with pytest.raises(RequestError, match="starts with none of the triggers"):
        compiler.compile(GuidedDecoding("structural_tag", {**tag, "triggers": ["<tool"]}))
