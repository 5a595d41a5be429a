"""Several engine requests behind one response: n choices per prompt, best_of, several prompts.

Every choice is its own engine request with n=1. Choice k of prompt p is candidate
p * per_prompt + k. With a request `seed`, candidate j samples with seed (seed + j) mod 2**63,
so each choice is reproducible and its siblings differ; without one, the engine draws a seed
per request. A prompt's first candidate starts alone; its siblings start once it has produced
its first token, when its full prompt blocks are in the prefix cache, so they reuse those
blocks instead of computing them again (the last prompt token is always computed).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from starlette.requests import Request

from vkrt.engine.config import SamplingParams
from vkrt.server.generation import (
    Candidate,
    Generation,
    Result,
    ServerState,
    Update,
    consume_watching,
)
from vkrt.server.prompts import INLINE_PROMPT_SIZE

_SEED_MODULUS = 2**63


def choice_seed(seed: int | None, candidate: int) -> int | None:
    """The seed of candidate `candidate` of a request seeded with `seed` (None: unseeded)."""
    return None if seed is None else (seed + candidate) % _SEED_MODULUS


class CandidateSet:
    """The generations of one response, grouped by prompt; `release` frees every admission place."""

    def __init__(self, request_id: str, groups: list[list[Generation]]) -> None:
        self.request_id = request_id
        self.groups = groups

    def release(self) -> None:
        release_all(self.groups)

    def generation(self, candidate: int) -> Generation:
        per_prompt = len(self.groups[0])
        return self.groups[candidate // per_prompt][candidate % per_prompt]


async def open_candidates(state: ServerState, response_id: str, prompts: list[tuple[list[int], str | None]],
                          params: list[SamplingParams], per_prompt: int) -> list[list[Candidate]]:
    """`per_prompt` engine requests for each prompt, made (validated, grammars compiled) on the
    worker pool; RequestError, before anything runs, for the first the engine refuses."""
    engine = state.require_engine()

    def make() -> list[list[Candidate]]:
        groups: list[list[Candidate]] = []
        for p, ((prompt_ids, prompt_text), prompt_params) in enumerate(zip(prompts, params, strict=True)):
            group: list[Candidate] = []
            for k in range(per_prompt):
                candidate = p * per_prompt + k
                request_id = response_id if candidate == 0 else f"{response_id}-{candidate}"
                choice_params = dataclasses.replace(prompt_params, seed=choice_seed(prompt_params.seed, candidate))
                outputs = engine.generate(prompt_ids, choice_params, request_id, prompt_text=prompt_text)
                group.append(Candidate(request_id, prompt_ids, choice_params, outputs))
            groups.append(group)
        return groups

    # A grammar may take long to compile; without one, making a few short requests is cheap.
    small = (all(p.guided_decoding is None for p in params)
             and per_prompt * sum(len(ids) for ids, _ in prompts) <= INLINE_PROMPT_SIZE)
    return await state.run_cpu(make, inline=small)


def start_candidates(state: ServerState, response_id: str, opened: list[list[Candidate]],
                     arrival: float) -> CandidateSet:
    """An admitted generation for every candidate (429 when they do not all fit). A candidate
    never started queued nothing on the engine, so one refused here needs no abort."""
    groups: list[list[Generation]] = []
    try:
        for candidates in opened:
            group: list[Generation] = []
            groups.append(group)  # before it fills: a 429 midway releases the places already taken
            for candidate in candidates:
                group.append(Generation(state, candidate, arrival))
    except BaseException:
        release_all(groups)
        raise
    for group in groups:
        state.metrics.observe_choices(len(group))
    return CandidateSet(response_id, groups)


def release_all(groups: list[list[Generation]]) -> None:
    for group in groups:
        for generation in group:
            generation.release()


async def merged_updates(groups: list[list[Generation]]) -> AsyncIterator[tuple[int, Update]]:
    """(candidate number, update) of every generation as updates come; leaving early aborts all."""
    queue: asyncio.Queue[tuple[int, Update | BaseException | None]] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []

    async def pump(candidate: int, generation: Generation, followers: list[tuple[int, Generation]]) -> None:
        try:
            async for update in generation.updates():
                if followers:
                    start(followers)
                    followers = []
                queue.put_nowait((candidate, update))
            start(followers)  # a leader that finished without an update still lets them run
        except asyncio.CancelledError:  # the consumer stopped: followers never start
            raise
        except Exception as exc:  # handed to the consumer, which raises it and stops the rest
            queue.put_nowait((candidate, exc))
        queue.put_nowait((candidate, None))

    def start(members: list[tuple[int, Generation]], followers: list[tuple[int, Generation]] | None = None) -> None:
        for candidate, generation in members:
            tasks.append(asyncio.ensure_future(pump(candidate, generation, followers or [])))

    candidate = 0
    for group in groups:
        numbered = list(enumerate(group, start=candidate))
        candidate += len(group)
        start(numbered[:1], numbered[1:])
    remaining = candidate
    try:
        while remaining:
            number, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield number, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        release_all(groups)


async def run_all(groups: list[list[Generation]], raw_request: Request | None) -> list[list[Result]]:
    """Generate every candidate to the end; abort all if the HTTP client disconnects first."""
    try:
        await consume_watching(merged_updates(groups), raw_request)
        return [[generation.result for generation in group] for group in groups]
    finally:
        release_all(groups)


def best_by_logprob(results: list[Result], n: int) -> list[Result]:
    """The `n` candidates with the highest cumulative logprob of their tokens, best first."""
    def score(result: Result) -> float:
        return sum(position.token.logprob for position in result.logprobs or [])
    return sorted(results, key=score, reverse=True)[:n]
