"""A request's lifecycle inside the engine, and the outputs handed back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vkrt.engine.config import SamplingParams

if TYPE_CHECKING:
    from vkrt.engine.guided import Guide
    from vkrt.engine.pooling import PooledRows, PoolingParams, PoolingResult


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names).

    CUMULATIVE: everything generated so far, every step (each output copies the whole
    history: for callers that read the engine directly). DELTA: only what this step added
    (text, token ids, logprobs; prompt logprobs in the first output), for streams.
    FINAL_ONLY: one output, when the request finishes, holding the whole result.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # the model gave no usable distribution (`Request.error` says why)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Logprob:
    """One token's log-probability under the raw model distribution; rank 1 is the argmax."""

    token_id: int
    logprob: float
    rank: int
    text: str = ""  # filled in by output processing when a tokenizer is present


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen (or prompt) token, the top-N, the explicitly scored ids."""

    token: Logprob
    top: list[Logprob] = field(default_factory=list)
    scored: list[Logprob] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Request:
    """Token state of one request; the engine mutates it, callers see RequestOutput snapshots."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        prompt: str | None = None,
        generator_seed: int = 0,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.output_kind = output_kind
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose K/V are in the cache (prefix-cache hits included); reset on preemption.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (kv_cache.BlockManager)
        wants_logprobs = params.logprobs is not None or params.logprob_token_ids is not None
        self.logprobs: list[TokenLogprobs] | None = [] if wants_logprobs else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # why it finished with "error"
        # Advanced exactly once per sampled token of this request, so a seeded request samples
        # the same tokens whatever else shares its batch.
        self.generator = np.random.Generator(np.random.PCG64(
            params.seed if params.seed is not None else generator_seed))
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.guide: Guide | None = None  # the grammar's state under structured output
        # Tokens proposed to follow all_token_ids, verified in the next step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # A sampling draft model's distribution for each proposal (empty: verify by equality).
        self.spec_draft_probs: list[np.ndarray] = []
        self.spec_backoff = 0  # steps a request last waited after proposals that all failed (0: none failed)
        self.spec_wait = 0  # steps left before it proposes again
        self.spec_length = 0  # tokens it proposes next (speculative.proposal_length; 0: the configured k)
        # A pooling request (vkrt/engine/pooling.py) returns hidden states after its prompt, never a token.
        self.pooling: PoolingParams | None = None
        self.pooled: PooledRows | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass
class CompletionOutput:
    """The generated continuation: all of it so far, or (a DELTA output) what this step added.

    Text that may still turn out to start a stop string is held back until the next token
    settles it, so `text` never holds what a stop string will cut."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # with finish_reason "error": what went wrong


@dataclass
class RequestOutput:
    """One update of one request, shaped by its RequestOutputKind: a step's delta, a
    cumulative snapshot, or the final result."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    pooling: PoolingResult | None = None  # a finished pooling request's result

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
