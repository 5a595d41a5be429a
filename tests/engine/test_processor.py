"""The engine's edge: a request is validated, and its grammar compiled, once, when it is
made; the context-length rules hold for every caller; nothing bad is ever queued."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from engine_fakes import VOCAB

from vkrt.engine import LLM, GuidedDecoding, SamplingParams
from vkrt.engine.guided import GrammarCompiler
from vkrt.engine.processor import RequestProcessor
from vkrt.errors import RequestError

CONTEXT = 1024


def processor(seed: int = 0) -> RequestProcessor:
    return RequestProcessor(VOCAB, CONTEXT, (256,), GrammarCompiler(None, VOCAB, (256,)), seed=seed)


def refusal(prompt: list[int], **params: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        processor().make_request("r", prompt, SamplingParams(**params))
    assert info.value.status == 400
    return info.value


def test_max_tokens_past_the_context_is_refused_with_the_context_code() -> None:
    error = refusal([1], max_tokens=5000)
    assert error.param == "max_tokens" and "max_tokens" in str(error) and str(CONTEXT) in str(error)
    assert error.code == "context_length_exceeded"
    # The prompt counts: 1000 + 25 > 1024 is refused, 1000 + 24 fits exactly.
    error = refusal([1] * 1000, max_tokens=25)
    assert error.param == "max_tokens" and error.code == "context_length_exceeded" and "1025" in str(error)
    assert processor().make_request("r", [1] * 1000, SamplingParams(max_tokens=24)).num_prompt_tokens == 1000


def test_a_prompt_must_leave_room_for_one_token() -> None:
    error = refusal([1] * CONTEXT, max_tokens=None)
    assert error.param == "prompt" and error.code == "context_length_exceeded" and "context length" in str(error)
    # One token shorter leaves exactly one to generate; None means "until the context is full".
    for max_tokens in (1, None):
        processor().make_request("r", [1] * (CONTEXT - 1), SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(("prompt", "params", "param", "says"), [
    ([], {}, "prompt", "empty"),
    ([1, VOCAB], {}, "prompt", "vocabulary"),
    ([1], {"max_tokens": 0}, "max_tokens", ">= 1"),
    ([1], {"logit_bias": {VOCAB: 1.0}}, "logit_bias", "vocabulary"),
    ([1], {"guided_decoding": GuidedDecoding("regex", "")}, "guided_decoding", "non-empty"),
])
def test_bad_requests_name_their_parameter(prompt: list[int], params: dict[str, Any], param: str,
                                           says: str) -> None:
    error = refusal(prompt, **params)
    assert error.param == param and says in str(error) and error.code is None


def test_a_refused_request_draws_no_seed() -> None:
    """Unseeded requests take the engine's seeds in order; one refused in between takes none,
    so the requests after it sample as they would have."""
    plain = SamplingParams(max_tokens=4)
    alone = processor(seed=7)
    expected = [alone.make_request(str(i), [1], plain).generator.random() for i in range(2)]
    mixed = processor(seed=7)
    first = mixed.make_request("a", [1], plain).generator.random()
    with pytest.raises(RequestError):
        mixed.make_request("bad", [1], SamplingParams(max_tokens=0))
    assert [first, mixed.make_request("b", [1], plain).generator.random()] == expected


def test_the_grammar_compiles_once_per_request(make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm()
    grammars = llm.engine.grammars
    calls: list[GuidedDecoding] = []
    compile_ = grammars.compile

    def counting(guided: GuidedDecoding) -> Any:
        calls.append(guided)
        return compile_(guided)

    monkeypatch.setattr(grammars, "compile", counting)
    guided = GuidedDecoding("regex", "ok!")
    outputs = llm.generate(["a", "b"], SamplingParams(max_tokens=8, guided_decoding=guided))
    assert [o.text for o in outputs] == ["ok!", "ok!"]
    assert calls == [guided, guided]  # one compile (or cache copy) per request, none again on add


def test_the_offline_llm_keeps_the_context_rule_and_runs_none_to_the_end(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(max_model_len=32)
    with pytest.raises(RequestError) as info:
        llm.generate(["ok", "fine"], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=29)])  # 4 + 29 > 32
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    assert not llm.engine.has_unfinished()  # the good first prompt was not queued either
    out = llm.generate("ok", SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"  # 2 prompt + 30 = the context
