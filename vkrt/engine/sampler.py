"""Host (numpy) sampler over a step's logits rows.

Order, as vLLM v1: allowed_token_ids, min_tokens masking and logit_bias, then penalties (repetition over prompt
+ output with HF semantics, presence/frequency over output, OpenAI semantics); greedy rows
take the argmax of that; the others divide by temperature, then min-p, top-k and top-p
filter, and one uniform draw from the request's own generator picks a token by inverse CDF.
Logprobs are those of the raw model distribution (vLLM's default `raw_logprobs`).

A request with 1 <= top_k <= MAX_TOP_K and nothing else to apply (`is_device_samplable`)
is sampled by the sample_top_k op's spec instead (vkrt/ops/sampling.py), from the same one
draw per token: on the host here, or on the device when every row of a step qualifies
(`sample_inputs`), so its tokens do not depend on which path, or batch, sampled them.

Under structured output a row also has a token mask (vkrt/engine/guided.py): the tokens it
disallows read as -inf before anything above, on either path; logprobs stay the raw model's.

Every row is processed on its own 1-D slice, so a row's result never depends on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vkrt.engine.config import SamplingParams
from vkrt.engine.request import Logprob, Request, TokenLogprobs
from vkrt.ops.sampling import MAX_TOP_K, NONFINITE, allowed_tokens, sample_params, sample_row


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


def _raw_logits_suffice(request: Request) -> bool:
    """No logits processor applies and no logprob is asked for."""
    p = request.params
    return (p.logprobs is None and p.logprob_token_ids is None and not p.logit_bias and p.allowed_token_ids is None
            and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
            and request.num_output_tokens >= p.min_tokens)


def is_plain_greedy(request: Request) -> bool:
    """True when the next token is the raw logits' argmax: no processor or logprob is needed,
    so the argmax may be taken on the device and only ids read back."""
    return request.params.greedy and _raw_logits_suffice(request)


def is_device_samplable(request: Request) -> bool:
    """True when the next token is sample_top_k of the raw logits (temperature > 0 and
    1 <= top_k <= MAX_TOP_K, nothing else to apply), so a shader may draw it."""
    p = request.params
    return not p.greedy and 1 <= p.top_k <= MAX_TOP_K and _raw_logits_suffice(request)


def draw_uniform(request: Request) -> np.float32:
    """The request's one draw for its next sampled token, in [0, 1) as float32 (sample_top_k
    clamps the rare rounding up to 1)."""
    return np.float32(request.generator.random())


@dataclass
class SampleInputs:
    """sample_top_k operands for one step's rows: params [R, 4] and uniforms [R], float32
    (the token masks come separately: the runner has them computed during the step)."""

    params: np.ndarray
    uniforms: np.ndarray


GREEDY_PARAMS = sample_params(temperature=1.0, top_k=1)  # top_k=1 is the argmax


def sample_inputs(requests: Sequence[Request], num_rows: int) -> SampleInputs | None:
    """sample_top_k operands for logits rows 0..num_rows-1, row i sampling requests[i]
    (plain greedy ones as top_k=1; rows past the requests, unused, too), drawing each sampled
    request's uniform; None, drawing nothing, if any request needs the host."""
    if not all(is_plain_greedy(r) or is_device_samplable(r) for r in requests):
        return None
    params = np.tile(GREEDY_PARAMS, (num_rows, 1))
    uniforms = np.zeros(num_rows, np.float32)
    for i, request in enumerate(requests):
        if not request.params.greedy:
            params[i] = _op_params(request.params)
            uniforms[i] = draw_uniform(request)
    return SampleInputs(params, uniforms)


def _op_params(params: SamplingParams) -> np.ndarray:
    """The sample_top_k params row of a request that samples (temperature > 0)."""
    return sample_params(params.temperature, params.top_p, params.min_p, params.top_k)


def apply_penalties_and_bias(row: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                             output_ids: Sequence[int], eos_token_ids: Sequence[int]) -> np.ndarray:
    """The logits a request's sampling sees (float64 copy), before temperature."""
    x = row.astype(np.float64)
    vocab = x.shape[0]
    if params.allowed_token_ids is not None:
        allowed = np.full(vocab, -np.inf)
        allowed[params.allowed_token_ids] = 0.0
        x += allowed
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


def sampling_distribution(row: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                          output_ids: Sequence[int], eos_token_ids: Sequence[int]) -> np.ndarray:
    """The normalised distribution (float64) a request with temperature > 0 draws its next token
    from, given its tokens so far: what a draft's proposal and the target's verify row compare."""
    probs = filter_distribution(apply_penalties_and_bias(row, params, prompt_ids, output_ids, eos_token_ids), params)
    return probs / probs.sum()


class Sampler:
    """Batched host sampler: one row of logits per request that samples this step."""

    def sample(self, logits: np.ndarray, requests: Sequence[Request],
               masks: np.ndarray | None = None) -> SamplerOutput:
        """One token per row; masks[i] (u32 words) restricts row i (None: no row is constrained).
        A row whose best allowed logit is not finite gets NONFINITE, as on the device."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for i, (raw, request) in enumerate(zip(logits, requests, strict=True)):
            params = request.params
            row = raw
            if masks is not None and request.guide is not None:
                row = np.where(allowed_tokens(masks[i], raw.shape[0]), raw, np.float32(-np.inf))
            if not np.isfinite(row.max()):  # NaN or +inf in it, or nothing allowed above -inf
                token_ids.append(NONFINITE)
                logprobs.append(None)
                continue
            x = apply_penalties_and_bias(row, params, request.prompt_token_ids,
                                         request.output_token_ids, request.eos_token_ids)
            if params.greedy:
                token = int(np.argmax(x))
            elif is_device_samplable(request):
                token = sample_row(row, _op_params(params), draw_uniform(request))
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
                logprobs.append(token_logprobs(raw, token, params.logprobs or 0, params.logprob_token_ids))
        return SamplerOutput(token_ids, logprobs)
