"""What the pooling routes share: how the served model embeds and scores, and running a
request's prompts together (each one a pooling request of the engine, admitted with the
generation requests, so several prompts share prefill steps and no generation waits for them).

Scoring models: a sequence-classification head of one label (`*ForSequenceClassification`,
a `score` linear on the last token's state: its sigmoid), or, with `--reranker yes-no`, a causal
LM reranker in Qwen3-Reranker's format (its documented prompt; the score is the softmax of the
"yes" logit against "no" at the last position, as vLLM computes it). A model whose name says it is a
Qwen3-Reranker is taken as one without the flag, as llama.cpp's converter recognises it; so is a
GGUF of pooling type rank whose two-row head is labelled yes and no (the converter's Qwen3-Reranker:
the same prompt, its head the LM head's yes and no rows).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import numpy as np

from vkrt.engine.pooling import PoolingParams, PoolingResult
from vkrt.errors import RequestError, VkrtError
from vkrt.server.engine_client import EngineClient, require_tokenizer
from vkrt.server.errors import APIError
from vkrt.server.generation import ServerState
from vkrt.server.prompts import check_prompt_chars
from vkrt.tokenizer import Tokenizer

# Qwen3-Reranker's prompt (its model card): the instruction, query and document in one user turn,
# then an empty thought, so the next token is the judgement.
YES_NO_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES_NO_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class PoolingTask:
    """How the served model embeds (method, normalisation, truncation) and scores (None: it cannot)."""

    method: str
    normalize: bool
    matryoshka: bool
    hidden_size: int
    scorer: str | None  # "classifier" | "yes-no" | None
    num_labels: int
    # The logits rows of "yes" and "no" when a two-label head holds them (None: the vocabulary's tokens).
    yes_no_labels: tuple[int, int] | None = None


def pooling_task(state: ServerState, engine: EngineClient) -> PoolingTask:
    model = engine.model_config
    reranker = state.config.reranker or ("yes-no" if "qwen3-reranker" in model.name.lower() else None)
    labels = model.classifier_labels
    yes_no = (labels.index("yes"), labels.index("no")) if sorted(labels) == ["no", "yes"] else None
    scorer = ("yes-no" if yes_no else "classifier") if model.num_labels else reranker
    return PoolingTask(method=state.config.pooling or model.pooling or "last", normalize=model.pooling_normalize,
                       matryoshka=model.matryoshka, hidden_size=model.hidden_size, scorer=scorer,
                       num_labels=model.num_labels, yes_no_labels=yes_no)


async def warm_up_pooling(engine: EngineClient) -> None:
    """One pooling request of one token: the warm-up of a model that does not generate."""
    await engine.pool([0], PoolingParams("last", logits=True), request_id="vkrt-warm-up")


def embedding_vector(task: PoolingTask, result: PoolingResult, dimensions: int | None) -> np.ndarray:
    """The pooled state truncated to `dimensions` (Matryoshka), then L2-normalised if the model is."""
    vector = result.embedding[:dimensions] if dimensions is not None else result.embedding
    if task.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return np.asarray(vector, dtype=np.float32)


async def pool_all(state: ServerState, engine: EngineClient, prompts: list[list[int]], params: PoolingParams,
                   param: str) -> list[PoolingResult]:
    """Run every prompt as a pooling request at once; the first failure cancels the rest (which
    aborts them in the engine). 400 for an empty prompt or one longer than the context."""
    vocab = engine.model_config.vocab_size
    for i, ids in enumerate(prompts):
        where = f"{param}[{i}]" if len(prompts) > 1 else param
        if not ids:
            raise APIError(400, f"{where} is empty; send at least one token", param=param, code="invalid_value")
        if len(ids) > engine.max_model_len:
            raise APIError(400, f"{where} has {len(ids)} tokens, more than this model's maximum context length "
                           f"(max_model_len) of {engine.max_model_len}; shorten it", param=param,
                           code="context_length_exceeded")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", param=param,
                           code="invalid_value")
    state.admit()
    tasks = [asyncio.ensure_future(engine.pool(ids, params)) for ids in prompts]
    try:
        return list(await asyncio.gather(*tasks))
    except RequestError:
        raise
    except VkrtError as exc:
        raise APIError(500, f"the pooling request failed: {exc}", code="pooling_failed") from None
    finally:
        for task in tasks:  # after a failure (or the client left) none of the prompts keeps running
            task.cancel()
        state.num_in_flight -= 1


def check_scorer(task: PoolingTask) -> None:
    """400 for a model that cannot score."""
    if task.scorer is None:
        raise APIError(400, "this model is neither a reranker nor a sequence classifier, so it cannot score; serve a "
                       "*ForSequenceClassification checkpoint, or a Qwen3-Reranker with --reranker yes-no",
                       param="model", code="model_not_supported")
    if task.scorer == "classifier" and task.num_labels != 1:
        raise APIError(400, f"this model's classification head has {task.num_labels} labels; scores need a head of "
                       "one label", param="model", code="model_not_supported")


def _yes_no(tokenizer: Tokenizer) -> tuple[int, int]:
    yes, no = tokenizer.token_id("yes"), tokenizer.token_id("no")
    if yes is None or no is None:
        raise APIError(400, "--reranker yes-no needs 'yes' and 'no' tokens in the vocabulary, and this model's "
                       "tokenizer lacks them", param="model", code="model_not_supported")
    return yes, no


def score_prompts(engine: EngineClient, task: PoolingTask, pairs: list[tuple[str, str]],
                  max_chars: int) -> list[list[int]]:
    """Token ids of each (query, document) pair as the scorer reads them. CPU work: call it off the event loop."""
    tokenizer = require_tokenizer(engine, "documents")
    for query, document in pairs:
        check_prompt_chars(len(query) + len(document), max_chars, "documents")
    if task.scorer == "classifier":
        return [tokenizer.encode_pair(query, document) for query, document in pairs]
    if task.yes_no_labels is None:
        _yes_no(tokenizer)
    prefix = tokenizer.encode(YES_NO_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(YES_NO_SUFFIX, add_special_tokens=False)
    return [[*prefix, *tokenizer.encode(f"<Instruct>: {YES_NO_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}",
                                        add_special_tokens=False), *suffix]
            for query, document in pairs]


async def score_pairs(state: ServerState, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
    """Each pair's relevance score in [0, 1], and the tokens the prompts held."""
    engine = state.require_engine()
    task = pooling_task(state, engine)
    check_scorer(task)
    prompts = await state.run_cpu(score_prompts, engine, task, pairs, state.config.max_prompt_chars)
    results = await pool_all(state, engine, prompts, PoolingParams("last", logits=True), param)
    # The logits rows a reranker compares (None: a one-label classifier's single logit).
    rows = None if task.scorer == "classifier" else task.yes_no_labels or _yes_no(require_tokenizer(engine, "documents"))
    scores = []
    for result in results:
        assert result.logits is not None
        margin = float(result.logits[0]) if rows is None else float(result.logits[rows[0]] - result.logits[rows[1]])
        # sigmoid(margin): a classifier's probability, and softmax([yes, no])'s yes for a reranker
        scores.append(1.0 / (1.0 + math.exp(-margin)) if margin >= 0 else math.exp(margin) / (1.0 + math.exp(margin)))
    return scores, sum(len(p) for p in prompts)
