"""POST /v1/completions: one or several prompts in, `n` choices each, text out (SSE or whole)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vkrt.engine.config import ALL_LOGPROBS, SamplingParams
from vkrt.errors import RequestError
from vkrt.server.beam_search import beam_results, check_beam_request
from vkrt.server.choices import (
    CandidateSet,
    best_by_logprob,
    merged_updates,
    open_candidates,
    run_all,
    start_candidates,
)
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.generation import Result, ServerState
from vkrt.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    logprobs_text_length,
    prompt_logprobs_json,
)
from vkrt.server.middleware import request_id_of
from vkrt.server.prompts import check_request_text, completion_prompts, is_small
from vkrt.server.protocol import CompletionRequest
from vkrt.server.responses import (
    check_model,
    combined_usage,
    event_stream,
    log_request,
    new_response_id,
    now_s,
    sse,
)
from vkrt.server.sampling import check_unsupported, field_error, sampling_params
from vkrt.tokenizer import Tokenizer


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    check_request_text(body, state.config.max_prompt_chars)
    prompts = await state.run_cpu(completion_prompts, engine, body, state.config.max_prompt_chars,
                                  inline=is_small(body))
    params = _candidate_params(body, state.config.max_digits())
    response_id = new_response_id("cmpl")
    base: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": now_s(),
                            "model": state.model_name}
    if body.use_beam_search:
        return await _beam_completion(state, body, raw, prompts, params, base, arrival)
    per_prompt = body.best_of or body.n
    try:  # off the loop: a constrained request compiles its grammar here (a big schema takes long)
        opened = await open_candidates(state, response_id, prompts, [params] * len(prompts), per_prompt)
    except RequestError as exc:
        raise field_error(exc, body, "prompt") from exc
    echo_texts = [_echo_text(engine, ids, text) if body.echo else "" for ids, text in prompts]
    candidates = start_candidates(state, response_id, opened, arrival)
    for ids, text in prompts:
        log_request(state, response_id, request_id_of(raw.state), text, ids, params)

    if body.stream:
        return event_stream(_stream(state, candidates, body, base, echo_texts), candidates)

    groups = await run_all(candidates.groups, raw)
    tokenizer = engine.tokenizer
    choices = []
    for p, results in enumerate(groups):
        chosen = best_by_logprob(results, body.n) if per_prompt > body.n else results
        for k, result in enumerate(chosen):
            choices.append(_choice(tokenizer, body, p * body.n + k, result, echo_texts[p]))
    return JSONResponse({**base, "choices": choices, "usage": combined_usage(groups), "system_fingerprint": None})


async def _beam_completion(state: ServerState, body: CompletionRequest, raw: Request,
                           prompts: list[tuple[list[int], str | None]], params: SamplingParams,
                           base: dict[str, Any], arrival: float) -> Response:
    """Each prompt's n best beams, as choices p * n + k (vkrt/server/beam_search.py)."""
    check_beam_request(body)
    groups = []
    for ids, text in prompts:
        log_request(state, base["id"], request_id_of(raw.state), text, ids, params)
        try:
            groups.append(await beam_results(state, base["id"], ids, body, params, arrival, raw))
        except RequestError as exc:
            raise field_error(exc, body, "prompt") from exc
    tokenizer = state.require_engine().tokenizer
    choices = [_choice(tokenizer, body, p * body.n + k, result, "")
               for p, results in enumerate(groups) for k, result in enumerate(results)]
    return JSONResponse({**base, "choices": choices, "usage": combined_usage(groups), "system_fingerprint": None})


def _candidate_params(body: CompletionRequest, max_digits: int | None) -> SamplingParams:
    params = sampling_params(body, max_digits)
    changes: dict[str, Any] = {}
    if body.best_of is not None and body.best_of > body.n and params.logprobs is None:
        changes["logprobs"] = 0  # ranking by cumulative logprob needs each sampled token's
    if body.echo and body.logprobs is not None and params.prompt_logprobs != ALL_LOGPROBS:
        changes["prompt_logprobs"] = max(body.logprobs, params.prompt_logprobs or 0)
    return dataclasses.replace(params, **changes) if changes else params


def _echo_text(engine: EngineClient, prompt_ids: list[int], prompt_text: str | None) -> str:
    if prompt_text is not None:
        return prompt_text
    # token ids, already checked against the vocabulary by the engine when it made the request
    return require_tokenizer(engine, "prompt").decode(prompt_ids)


def _prompt_part(tokenizer: Tokenizer | None, body: CompletionRequest, result: Result) -> dict[str, Any]:
    """The echoed prompt's logprobs, cut to the `logprobs` alternatives asked for."""
    assert body.logprobs is not None
    positions = result.prompt_logprobs or [None] * len(result.prompt_token_ids)
    cut = [None if p is None else dataclasses.replace(p, top=p.top[:body.logprobs]) for p in positions]
    return echo_logprobs(tokenizer, result.prompt_token_ids, cut, body.return_tokens_as_token_ids)


def _choice(tokenizer: Tokenizer | None, body: CompletionRequest, index: int, result: Result,
            echo_text: str) -> dict[str, Any]:
    logprobs = None
    if body.logprobs is not None and result.logprobs is not None:
        if body.echo:
            prompt_part = _prompt_part(tokenizer, body, result)
            output_part = completion_logprobs(tokenizer, result.logprobs, logprobs_text_length(prompt_part),
                                              body.return_tokens_as_token_ids)
            logprobs = joined_logprobs(prompt_part, output_part)
        else:
            logprobs = completion_logprobs(tokenizer, result.logprobs, 0, body.return_tokens_as_token_ids)
    choice = {"index": index, "text": echo_text + result.text, "logprobs": logprobs,
              "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
    if body.prompt_logprobs is not None and result.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer, result.prompt_logprobs)
    if body.return_token_ids:  # vLLM's: both inside the choice
        choice["prompt_token_ids"] = result.prompt_token_ids
        choice["token_ids"] = result.token_ids
    return choice


async def _stream(state: ServerState, candidates: CandidateSet, body: CompletionRequest,
                  base: dict[str, Any], echo_texts: list[str]) -> AsyncIterator[bytes]:
    """Chunks of every choice as they come, each with its index (streaming has best_of == n)."""
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    tokenizer = state.require_engine().tokenizer
    groups = candidates.groups
    num_candidates = sum(len(group) for group in groups)
    offsets = [0] * num_candidates
    started = [False] * num_candidates
    first = [True] * num_candidates  # no chunk of this choice sent yet

    def current_usage() -> dict[str, Any]:
        return combined_usage([[generation.result for generation in group] for group in groups])

    def chunk(index: int, text: str, logprobs: Any, finish_reason: str | None,
              token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if body.return_token_ids:  # as vLLM streams them: the prompt's in a choice's first chunk
            if first[index]:
                first[index] = False
                choice["prompt_token_ids"] = candidates.generation(index).result.prompt_token_ids
            choice["token_ids"] = token_ids or []
        payload = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = current_usage() if continuous_usage else None
        return sse(payload)

    async for index, update in merged_updates(groups):
        if not started[index]:
            started[index] = True
            if body.echo:  # the prompt's logprobs arrive with the first update
                prompt_part = None
                if body.logprobs is not None:
                    prompt_part = _prompt_part(tokenizer, body, candidates.generation(index).result)
                    offsets[index] = logprobs_text_length(prompt_part)
                yield chunk(index, echo_texts[index // body.n], prompt_part, None)
        logprobs = None
        if update.logprobs is not None and body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, update.logprobs, offsets[index], body.return_tokens_as_token_ids)
            offsets[index] += logprobs_text_length(logprobs)
        yield chunk(index, update.text, logprobs, update.finish_reason, update.token_ids)
    if include_usage:
        yield sse({**base, "choices": [], "usage": current_usage()})
