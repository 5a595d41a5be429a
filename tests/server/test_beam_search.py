"""Beam search (`use_beam_search`): the search's rules on scripted distributions, its wiring and
errors on the fake engine, and the beams of tiny_llama equal to HF transformers' generate(num_beams)
goldens (tools/make_beam_goldens.py) through the openai client."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import FIXTURES
from tests.server.conftest import Live
from tests.server.live_model import LiveModel, live_model
from vkrt.engine.request import Logprob
from vkrt.server.beam_search import MAX_BEAM_WIDTH, Beam, BeamSearchParams, beam_score, search

EOS = 0
GOLDEN = json.loads((FIXTURES / "tiny_llama_beam.json").read_text())
GREEDY = json.loads((FIXTURES / "tiny_llama" / "golden.json").read_text())


def scripted(table: dict[tuple[int, ...], dict[int, float]]) -> Any:
    """An expand over a scripted model: each prefix's next-token probabilities (best first)."""
    async def expand(beams: list[Beam]) -> list[list[Logprob]]:
        out = []
        for beam in beams:
            probs = table[beam.token_ids]
            ranked = sorted(probs.items(), key=lambda item: -item[1])
            out.append([Logprob(token, math.log(p), rank) for rank, (token, p) in enumerate(ranked, 1)])
        return out
    return expand


def params(width: int, max_tokens: int, length_penalty: float = 1.0, early_stopping: bool = False,
           num_returned: int | None = None) -> BeamSearchParams:
    return BeamSearchParams(width, num_returned or width, max_tokens, length_penalty, early_stopping,
                            frozenset({EOS}), include_stop_token=False)


# Token 1 is likeliest first and EOS likely after it; only 2 -> 3 -> 8 stays likely after that.
TABLE = {(): {1: 0.5, 2: 0.4, EOS: 0.1},
         (1,): {EOS: 0.8, 4: 0.1, 5: 0.1}, (2,): {3: 0.9, 4: 0.05, EOS: 0.05},
         (1, 4): {6: 0.5, 7: 0.5}, (1, 5): {6: 0.5, 7: 0.5},
         (2, 3): {8: 0.9, 9: 0.1}, (2, 4): {8: 0.5, 9: 0.5}}


def run(prompt_len: int, p: BeamSearchParams) -> list[Beam]:
    return asyncio.run(search(prompt_len, p, scripted(TABLE)))


def test_eos_finishes_a_beam_and_the_length_penalty_ranks_finished_against_live() -> None:
    # Cumulative: log(.5 * .8) = -0.92 for the finished (1,), log(.4 * .9 * .9) = -1.13 for (2, 3, 8).
    unpenalised = run(1, params(2, 3, length_penalty=0.0))
    assert [(b.token_ids, b.stop_reason) for b in unpenalised] == [((1,), EOS), ((2, 3, 8), None)]
    # Penalised over 1 + 1 tokens (the EOS not counted) and 1 + 3: -0.46 against -0.28.
    penalised = run(1, params(2, 3, length_penalty=1.0))
    assert [b.token_ids for b in penalised] == [(2, 3, 8), (1,)]
    assert beam_score(penalised[1], 1, 1.0) == pytest.approx(math.log(0.4) / 2)
    # vLLM counts the prompt: after 100 prompt tokens the lengths are alike and (1,) wins again.
    assert [b.token_ids for b in run(100, params(2, 3, length_penalty=1.0))] == [(1,), (2, 3, 8)]


def test_width_one_is_greedy_and_early_stopping_ends_at_width_finished() -> None:
    [greedy] = run(1, params(1, 3))
    assert greedy.token_ids == (1,) and greedy.stop_reason == EOS  # 1 then EOS, the argmax path
    # After two steps three beams have finished ((), (1,), (2,)): early stopping ends the search there.
    assert [b.token_ids for b in run(1, params(2, 3, early_stopping=True))] == [(2, 3), (1,)]
    assert [b.token_ids for b in run(1, params(2, 3))] == [(2, 3, 8), (1,)]


def test_a_kept_stop_token_is_not_counted_in_the_length() -> None:
    kept = BeamSearchParams(2, 2, 3, 1.0, False, frozenset({EOS}), include_stop_token=True)
    best = asyncio.run(search(1, kept, scripted(TABLE)))
    finished = next(b for b in best if b.stop_reason == EOS)
    assert finished.token_ids == (1, EOS) and finished.kept_stop_token
    assert beam_score(finished, 1, 1.0) == pytest.approx(math.log(0.5 * 0.8) / 2)


@pytest.mark.parametrize(("body", "param"), [
    ({"stream": True}, "stream"),
    ({"n": MAX_BEAM_WIDTH + 1}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stop": ["x"]}, "stop"),
    ({"length_penalty": 1e308}, "length_penalty"),
])
def test_chat_refuses_what_beam_search_cannot_honour(fake: Live, body: dict[str, Any], param: str) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "max_tokens": 3, **body}
    response = fake.client.post("/v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "beam" in error["message"]


def test_completions_refuse_a_width_over_the_cap_and_echo(fake: Live) -> None:
    base = {"prompt": "hi", "use_beam_search": True, "max_tokens": 2}
    wide = fake.client.post("/v1/completions", json={**base, "best_of": MAX_BEAM_WIDTH + 1})
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "best_of"
    echo = fake.client.post("/v1/completions", json={**base, "echo": True})
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
    bad_tokens = fake.client.post("/v1/completions", json={**base, "max_tokens": 0})
    assert bad_tokens.status_code == 400 and bad_tokens.json()["error"]["param"] == "max_tokens"


def test_chat_beam_search_answers_choices(fake: Live) -> None:
    # The fake engine's top token is always 'a' (its first output letter), logprob -0.25.
    response = fake.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "max_tokens": 4,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["message"]["content"] == "aaaa" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == [ord("a")] * 4
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def tiny() -> Iterator[LiveModel]:
    with live_model(FIXTURES / "tiny_llama", max_model_len=64, max_num_seqs=8) as server:
        yield server


def _beams(tiny: LiveModel, prompt: list[int], width: int, n: int, max_tokens: int,
           **extra: Any) -> list[Any]:
    async def call() -> Any:
        client = tiny.async_client()
        return await client.completions.create(
            model="smollm2", prompt=prompt, n=n, best_of=width, max_tokens=max_tokens,
            extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True, **extra})
    return asyncio.run(call()).choices


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"{c['prompt_ids']}-w{c['num_beams']}")
def test_beams_equal_transformers_generate(tiny: LiveModel, case: dict[str, Any]) -> None:
    eos = case["eos_token_id"]
    extra = {"length_penalty": case["length_penalty"]} | ({"stop_token_ids": [eos]} if eos is not None else {})
    choices = _beams(tiny, case["prompt_ids"], case["num_beams"], case["num_return_sequences"],
                     case["max_new_tokens"], **extra)
    got = [(choice.token_ids, choice.finish_reason) for choice in choices]
    # HF's finished sequences end with their EOS; vkrt leaves it out (include_stop_str_in_output=false).
    want = [(seq[:-1], "stop") if eos is not None and seq[-1] == eos else (seq, "length")
            for seq in case["sequences"]]
    assert got == want
    assert [choice.index for choice in choices] == list(range(len(want)))


def test_width_one_equals_greedy(tiny: LiveModel) -> None:
    case = GREEDY["cases"][0]
    [choice] = _beams(tiny, case["input_ids"], 1, 1, len(case["greedy_ids"]))
    assert choice.token_ids == case["greedy_ids"]
