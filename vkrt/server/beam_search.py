"""Beam search as vLLM's OpenAI server runs it (`use_beam_search: true`), above the engine.

Each step asks the engine for one token of every live beam, as its own request whose prompt is
the original prompt plus the beam's tokens, with the top 2 * width alternatives' logprobs. The
prefix cache makes the shared part free: a beam's full blocks (the prompt's, and those its parent
already wrote) are hits, so a step computes only the tokens past the last full block. KV blocks
are not forked between beams; sharing goes through the cache.

Semantics are vLLM's: a beam's score is its cumulative logprob of the raw model distribution
divided by len ** length_penalty, where len counts the prompt and the generated tokens but not a
final EOS; an alternative that is EOS (or a stop token id) finishes a beam, the others are grown
and the `width` best kept; after max_tokens steps (or, with early_stopping, once `width` beams
have finished) the best of finished and live beams are returned. Sampling knobs (temperature,
top_p, top_k, penalties, seed) do not apply: the scores are the model's log-probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request

from vkrt.engine.config import MAX_LOGPROBS, SamplingParams
from vkrt.engine.request import Logprob
from vkrt.server.choices import run_all, start_candidates
from vkrt.server.engine_client import EngineClient
from vkrt.server.errors import APIError
from vkrt.server.generation import Candidate, Result, ServerState
from vkrt.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# Each step asks for 2 * width alternatives per beam (so `width` survive even if half are EOS).
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# len ** length_penalty must stay a float for any context length (1e7 ** 40 overflows).
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamSearchParams:
    width: int
    num_returned: int  # the best this many of the final beams are returned (n)
    max_tokens: int
    length_penalty: float
    early_stopping: bool
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop_token_ids
    include_stop_token: bool  # include_stop_str_in_output: a finished beam keeps its EOS token


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]  # generated so far (a kept EOS included)
    cum_logprob: float
    stop_reason: int | None = None  # the EOS or stop token id that finished it (None: still live)
    kept_stop_token: bool = False


def beam_score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's: cumulative logprob / len ** length_penalty, len with the prompt, without a final EOS."""
    length = prompt_len + len(beam.token_ids) - (1 if beam.kept_stop_token else 0)
    return beam.cum_logprob / (length ** length_penalty)


# The top alternatives (2 * width, best first) for the next token of each beam given.
Expand = Callable[[list[Beam]], Awaitable[list[list[Logprob]]]]


async def search(prompt_len: int, params: BeamSearchParams, expand: Expand) -> list[Beam]:
    """The `num_returned` best beams, best first."""
    def score(beam: Beam) -> float:
        return beam_score(beam, prompt_len, params.length_penalty)

    live = [Beam((), 0.0)]
    finished: list[Beam] = []
    for _ in range(params.max_tokens):
        grown: list[Beam] = []
        for beam, alternatives in zip(live, await expand(live), strict=True):
            for alt in alternatives:
                cum_logprob = beam.cum_logprob + alt.logprob
                if alt.token_id in params.stop_token_ids:
                    keep = params.include_stop_token
                    tokens = beam.token_ids + (alt.token_id,) if keep else beam.token_ids
                    finished.append(Beam(tokens, cum_logprob, alt.token_id, keep))
                else:
                    grown.append(Beam(beam.token_ids + (alt.token_id,), cum_logprob))
        live = sorted(grown, key=score, reverse=True)[:params.width]
        if not live or (params.early_stopping and len(finished) >= params.width):
            break
    return sorted(finished + live, key=score, reverse=True)[:params.num_returned]


def check_beam_request(body: SamplingFields) -> None:
    """400 for what beam search cannot honour, instead of ignoring it."""
    width = beam_width(body)
    if width > MAX_BEAM_WIDTH:
        param = "best_of" if isinstance(body, CompletionRequest) and body.best_of is not None else "n"
        raise APIError(400, f"{param}: the beam width of use_beam_search must be at most {MAX_BEAM_WIDTH}, "
                       f"got {width}", param=param, code="invalid_value")
    refused = {
        "stream": body.stream,
        "response_format": body.response_format is not None and body.response_format.type != "text",
        "structured_outputs": body.structured_outputs is not None,
        "json_schema": body.json_schema is not None,
        "grammar": body.grammar is not None,
        "stop": bool(body.stop),
        "logprobs": _asks_logprobs(body),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "echo": isinstance(body, CompletionRequest) and body.echo,
        "tool_choice": isinstance(body, ChatCompletionRequest) and body.tool_choice not in (None, "auto", "none"),
    }
    for param, given in refused.items():
        if given:
            what = ("streaming: the best beams are known only at the end" if param == "stream"
                    else f"{param}: beam search ranks the model's own log-probabilities and does not apply it")
            raise APIError(400, f"use_beam_search cannot be combined with {what}", param=param, code="invalid_value")
    if not (math.isfinite(body.length_penalty) and abs(body.length_penalty) <= MAX_LENGTH_PENALTY):
        raise APIError(400, f"length_penalty of use_beam_search must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                       f"got {body.length_penalty}", param="length_penalty", code="invalid_value")


def _asks_logprobs(body: SamplingFields) -> bool:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs
    return isinstance(body, CompletionRequest) and body.logprobs is not None


def beam_width(body: SamplingFields) -> int:
    """n, or best_of on /v1/completions (vLLM's old spelling of the width)."""
    if isinstance(body, CompletionRequest) and body.best_of is not None:
        return body.best_of
    return body.n


def beam_params(body: SamplingFields, sampling: SamplingParams, engine: EngineClient, prompt_len: int) -> BeamSearchParams:
    room = engine.max_model_len - prompt_len
    max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
    eos = () if sampling.ignore_eos else _eos_token_ids(engine)
    # At least one step: with no room left the engine refuses the prompt, in its own words.
    return BeamSearchParams(width=beam_width(body), num_returned=body.n, max_tokens=max(max_tokens, 1),
                            length_penalty=body.length_penalty, early_stopping=body.early_stopping,
                            stop_token_ids=frozenset(eos) | frozenset(sampling.stop_token_ids),
                            include_stop_token=sampling.include_stop_str_in_output)


def _eos_token_ids(engine: EngineClient) -> Sequence[int]:
    tokenizer = engine.tokenizer
    return tokenizer.eos_token_ids if tokenizer is not None else engine.model_config.eos_token_ids


async def beam_results(state: ServerState, response_id: str, prompt_ids: list[int], body: SamplingFields,
                       sampling: SamplingParams, arrival: float, raw: Request | None) -> list[Result]:
    """Run beam search for one prompt; the returned beams as Results, best first."""
    engine = state.require_engine()
    sampling.validate(engine.model_config.vocab_size)  # the steps' own params are not the client's
    params = beam_params(body, sampling, engine, len(prompt_ids))
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.width, ignore_eos=True,
                                 skip_special_tokens=sampling.skip_special_tokens, speculative=False)
    steps = 0
    cached_tokens: list[int] = []

    async def expand(beams: list[Beam]) -> list[list[Logprob]]:
        nonlocal steps
        steps += 1

        def make() -> list[list[Candidate]]:
            groups = []
            for k, beam in enumerate(beams):
                request_id = f"{response_id}-beam{steps}-{k}"
                ids = prompt_ids + list(beam.token_ids)
                outputs = engine.generate(ids, step_params, request_id)
                groups.append([Candidate(request_id, ids, step_params, outputs)])
            return groups

        opened = await state.run_cpu(make)
        groups = await run_all(start_candidates(state, response_id, opened, arrival).groups, raw)
        if not cached_tokens:
            cached_tokens.append(groups[0][0].num_cached_tokens)
        return [_alternatives(group[0]) for group in groups]

    best = await search(len(prompt_ids), params, expand)
    tokenizer = engine.tokenizer
    results = []
    for beam in best:
        text_ids = beam.token_ids[:-1] if beam.kept_stop_token else beam.token_ids
        text = tokenizer.decode(text_ids, sampling.skip_special_tokens) if tokenizer is not None else ""
        results.append(Result(prompt_token_ids=list(prompt_ids), pieces=[text], token_ids=list(beam.token_ids),
                              finish_reason="length" if beam.stop_reason is None else "stop",
                              stop_reason=beam.stop_reason, num_cached_tokens=cached_tokens[0]))
    return results


def _alternatives(result: Result) -> list[Logprob]:
    if result.finish_reason == "error" or not result.logprobs:
        raise APIError(500, f"beam search: a step failed: {result.error or 'no logprobs came back'}",
                       code="generation_failed")
    return result.logprobs[0].top

