"""Continuous batching: which tokens of which requests run in the next step.

Every request carries `num_computed_tokens`; a step gives each scheduled request a run of
new tokens (a whole or partial prompt, a recomputation after preemption, or one decode
token), all in ONE forward. Running requests go first, oldest first; waiting ones are
admitted while the token budget, `max_num_seqs` and the KV pool allow. When blocks run out
the newest running request is preempted by recompute: its blocks are freed and it goes back
to the front of the queue, to be prefilled again (prompt + tokens generated so far).

A decoding request with proposed tokens (speculative decoding, vkrt/engine/speculative.py)
runs them after its last token in the same step, within the token budget; they are the first
thing dropped when blocks are short.

A hybrid model with prefix caching keeps its recurrent state only where a chunk ends, so a
chunk that crosses a block boundary is cut at the last one it crosses (the rest runs next step).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from vkrt.engine.kv_groups import KVCacheManager
from vkrt.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """Positions start..start+num_tokens-1 of `request` run this step; the last len(spec) of
    them are proposed tokens (speculative decoding) that follow its known ones."""

    request: Request
    start: int
    num_tokens: int
    spec: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last known token, so a new one is sampled."""
        return self.start + self.num_tokens - len(self.spec) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens that extend a request by generated tokens: one, or one and its proposals in a
        verify step (the rest is prefill)."""
        return sum(s.num_tokens for s in self.scheduled
                   if s.num_tokens - len(s.spec) == 1 and s.start >= s.request.num_prompt_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _priority(request: Request) -> float:
    return request.metrics.arrival_time


class Scheduler:
    """Owns the waiting queue and the running list; the KVCacheManager owns their blocks."""

    def __init__(self, block_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest (highest priority) first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request.num_computed_tokens, min(request.num_tokens - request.num_computed_tokens,
                                                                   budget))
            # A decoding request's proposals ride along after its last token, as far as the token
            # budget goes (not after a chunk that recomputes tokens: a hybrid's rolled-back state).
            at_end = num_new == 1 and request.num_computed_tokens + 1 == request.num_tokens
            spec = request.spec_token_ids[:budget - num_new] if at_end else []
            num_new += len(spec)
            while not self.block_manager.allocate_slots(request, num_new):
                if spec:  # proposals are optional: drop them before preempting anyone
                    num_new, spec = num_new - len(spec), []
                    continue
                # The victim is always at the tail, so it was not scheduled yet in this step.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new, spec))
            budget -= num_new
            i += 1

        # Admitting more right after a preemption would only thrash the pool.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit = self.block_manager.get_computed_blocks(request)
            num_cached = hit.num_tokens
            num_new = self._chunk(num_cached, min(request.num_tokens - num_cached, budget))
            if not self.block_manager.allocate_slots(request, num_new, hit):
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:  # first admission, not a resumption
                request.num_cached_tokens = num_cached
                request.metrics.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            keys = [_priority(r) for r in self.running]
            self.running.insert(bisect.bisect_right(keys, _priority(request)), request)
            out.scheduled.append(ScheduledRequest(request, num_cached, num_new))
            budget -= num_new
        return out

    def _chunk(self, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, cut to end on the last boundary they cross when chunks
        are aligned (KVCacheManager.chunk_alignment)."""
        align = self.block_manager.chunk_alignment
        end = (start + num_new) // align * align if align else 0
        return end - start if end > start else num_new

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.spec_token_ids, request.spec_draft_probs = [], []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length or aborted) and free its blocks at once."""
        if request.request_id not in self.requests:
            return
        del self.requests[request.request_id]
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.metrics.finished_time = time.monotonic()

    def abort(self, request_id: str) -> Request | None:
        """Abort a request wherever it is; None if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request
