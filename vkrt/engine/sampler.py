"""Host (numpy) sampler over a step's logits rows.

Order, as vLLM v1: min_tokens masking and logit_bias, then penalties (repetition over prompt
+ output with HF semantics, presence/frequency over output, OpenAI semantics); greedy rows
take the argmax of that; the others divide by temperature, then min-p, top-k and top-p
filter, and one uniform draw from the request's own generator picks a token by inverse CDF.
Logprobs are those of the raw model distribution (vLLM's default `raw_logprobs`).

Every row is processed on its own 1-D slice, so a row's result never depends on the batch.
A device sampler can replace this class: the engine only calls `sample`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vkrt.engine.config import SamplingParams
from vkrt.engine.request import Logprob, Request, TokenLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def token_logprobs(logits_row: np.ndarray, token_id: int, num_top: int,
                   scored_ids: Sequence[int] | None = None) -> TokenLogprobs:
    """Logprob and rank of `token_id`, the `num_top` most likely tokens, and `scored_ids`."""
    lp = log_softmax(logits_row)

    def entry(tid: int, rank: int | None = None) -> Logprob:
        value = float(lp[tid])
        return Logprob(int(tid), value, rank if rank is not None else int((lp > value).sum()) + 1)

    top: list[Logprob] = []
    if num_top > 0:
        num_top = min(num_top, lp.shape[0])
        candidates = np.argpartition(-lp, num_top - 1)[:num_top]
        order = candidates[np.lexsort((candidates, -lp[candidates]))]  # by logprob, then id
        top = [entry(int(t), rank) for rank, t in enumerate(order, start=1)]
    scored = [entry(int(t)) for t in scored_ids or ()]
    return TokenLogprobs(entry(token_id), top, scored)


def is_plain_greedy(request: Request) -> bool:
    """True when the next token is the raw logits' argmax: no processor or logprob is needed,
    so the argmax may be taken on the device and only ids read back."""
    p = request.params
    return (p.greedy and p.logprobs is None and p.logprob_token_ids is None and not p.logit_bias
            and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
            and request.num_output_tokens >= p.min_tokens)


def apply_penalties_and_bias(row: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                             output_ids: Sequence[int], eos_token_ids: Sequence[int]) -> np.ndarray:
    """The logits a request's sampling sees (float64 copy), before temperature."""
    x = row.astype(np.float64)
    vocab = x.shape[0]
    if len(output_ids) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        banned = [t for t in banned if 0 <= t < vocab]
        x[banned] = -np.inf
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        np.add.at(x, ids, np.fromiter(params.logit_bias.values(), dtype=np.float64))
    if params.repetition_penalty != 1.0:
        # HF RepetitionPenaltyLogitsProcessor: seen tokens' positive logits / p, negative * p.
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < vocab)]
        values = x[seen]
        x[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab]
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return x


def filter_distribution(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, min-p, top-k and top-p (unnormalised; >= 1 token kept)."""
    x = x / params.temperature
    probs = np.exp(x - x.max())
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    if params.top_k > 0 and params.top_k < probs.shape[0]:
        kth = np.partition(probs, -params.top_k)[-params.top_k]
        probs[probs < kth] = 0.0  # ties at the k-th value are all kept
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        cumulative = np.cumsum(sorted_probs) / sorted_probs.sum()
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = np.concatenate([[False], cumulative[:-1] >= params.top_p])
        probs[order[drop]] = 0.0
    return probs


class Sampler:
    """Batched host sampler: one row of logits per request that samples this step."""

    def sample(self, logits: np.ndarray, requests: Sequence[Request]) -> SamplerOutput:
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for row, request in zip(logits, requests, strict=True):
            params = request.params
            x = apply_penalties_and_bias(row, params, request.prompt_token_ids,
                                         request.output_token_ids, request.eos_token_ids)
            if params.greedy:
                token = int(np.argmax(x))
            else:
                probs = filter_distribution(x, params)
                kept = np.flatnonzero(probs)
                cdf = np.cumsum(probs[kept])
                u = request.generator.random() * cdf[-1]
                token = int(kept[min(np.searchsorted(cdf, u, side="right"), kept.shape[0] - 1)])
            token_ids.append(token)
            if request.logprobs is None:
                logprobs.append(None)
            else:
                logprobs.append(token_logprobs(row, token, params.logprobs or 0, params.logprob_token_ids))
        return SamplerOutput(token_ids, logprobs)
