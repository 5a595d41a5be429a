"""Pooling requests: a prompt's prefill returns hidden states instead of a sampled token.

A pooling request runs through the same scheduler and steps as a generation request (so it
batches with them and never blocks them), but its rows go through the final norm only: the
engine collects the final-norm hidden state of the positions its method needs, and, when
asked, the last position's logits (a classification head's scores, or the yes/no logits of a
reranker that is a causal LM). Pooling the rows and normalising is host work on a few vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkrt.errors import RequestError

# last: the last token's state (decoder embedding models: Qwen3-Embedding); mean: the average
# over the prompt; cls: the first token's (BERT-style [CLS]).
POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    method: str = "last"
    logits: bool = False  # also return the last position's logits

    def validate(self) -> None:
        if self.method not in POOLING_METHODS:
            raise RequestError(f"pooling method {self.method!r} is not one of {', '.join(POOLING_METHODS)}",
                               param="pooling")

    def positions(self, start: int, num_tokens: int, num_prompt_tokens: int) -> range:
        """The prompt positions of the chunk start..start+num_tokens-1 whose hidden states the method needs."""
        end = start + num_tokens
        if self.method == "mean":
            return range(start, end)
        wanted = 0 if self.method == "cls" else num_prompt_tokens - 1
        return range(wanted, wanted + 1) if start <= wanted < end else range(0)


@dataclass
class PoolingResult:
    """A finished pooling request: the pooled final-norm hidden state (not normalised) and,
    when asked, the last position's logits."""

    embedding: np.ndarray  # f32 [hidden]
    logits: np.ndarray | None  # f32 [vocab], or [labels] for a classification head
    num_prompt_tokens: int


class PooledRows:
    """The hidden-state rows a pooling request collects as its chunks run."""

    def __init__(self, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        needed = params.positions(0, num_prompt_tokens, num_prompt_tokens)
        self.first, self.count = needed.start, len(needed)
        self.rows: np.ndarray | None = None  # [positions the method needs, hidden]
        self.logits: np.ndarray | None = None

    def put(self, position: int, rows: np.ndarray) -> None:
        """Rows for positions position.. (a preempted request recomputes them: they are overwritten)."""
        if self.rows is None:
            self.rows = np.zeros((self.count, rows.shape[1]), np.float32)
        self.rows[position - self.first:position - self.first + len(rows)] = rows

    def result(self) -> PoolingResult:
        assert self.rows is not None
        embedding = self.rows.mean(axis=0, dtype=np.float64).astype(np.float32)
        return PoolingResult(embedding, self.logits, self.num_prompt_tokens)
