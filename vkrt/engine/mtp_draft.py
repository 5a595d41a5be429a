"""MTP speculation: the target checkpoint's multi-token-prediction head proposes each request's
next k tokens.

The head (vkrt/models/mtp.py) reads the target's final-norm hidden state at a position beside the
token after it, so the target's runner brings every token row's hidden state back (ModelRunner's
`token_hidden`) and the engine hands over the rows of the positions that stand after each step
(`observe`). For each speculating request the proposer keeps a view: a Request whose token i is
the target's token i + 1 (the head's input at position i) followed by this step's guesses, whose
`num_computed_tokens` counts the positions the head's cache holds from the target's states.
Proposing is k head steps over the batch: the first catches each view up on the positions the
target computed since and guesses 1; each later one runs one position per view on its last
guess and the head's own output, guessing the next. Guessed positions are never counted: the
next catch-up computes them again from the target's states.

A head step is recorded once per power-of-two bucket of tokens and of views and replayed, as
the target's decode and verify steps are (vkrt/engine/runner.py): the host writes the step's
inputs, the states beside its tokens and each view's last row, then one submit runs the head
and draws its guesses. A step holding position 0 (a prompt's first catch-up; DeepSeek's form
zeroes that embedding by a choice made on the host) or more tokens than a catch-up after a verify
step runs eagerly. A row's guess and state are the same bits either way (batch invariance).

A position whose target state was never observed (a prefix-cache hit: the target did not compute
it in this request's life) enters the head with a zero state. Its K/V in the head's cache are then
approximate, which can lower acceptance but never changes the output: every guess is verified.

Guesses are the head's argmax, drawn on the device: one-token proposals, verified as n-gram
proposals are (exact for greedy and sampling requests alike).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vkrt import ops
from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.engine.draft import proposer_kv_cache
from vkrt.engine.request import Request, RequestStatus
from vkrt.engine.runner import (
    StepStats,
    build_forward_batch,
    padded_batch,
    recorded,
    verify_shaped,
    write_padded,
)
from vkrt.engine.sampler import GREEDY_PARAMS
from vkrt.engine.scheduler import ScheduledRequest, SchedulerOutput
from vkrt.errors import NotReplayable, VkrtError
from vkrt.models.base import CausalLM, ForwardBatch, KVCache, StepTensors
from vkrt.models.decoder import DecoderModel
from vkrt.models.mtp import MTPHead, mtp_head_model

log = logging.getLogger(__name__)


@dataclass
class _View:
    """The head's side of one request."""

    request: Request  # the target's
    tokens: Request  # token i: the target's token i + 1, then this step's guesses
    hidden: dict[int, np.ndarray] = field(default_factory=dict)  # observed target states by position


class MTPProposer:
    """Proposals from the target's MTP head: k head steps per engine step."""

    def __init__(self, target: CausalLM, config: EngineConfig, max_model_len: int, target_blocks: int,
                 num_speculative_tokens: int) -> None:
        """`target_blocks`: the target's full-attention pool; the head's holds as many tokens, plus
        room for every sequence's guesses."""
        if not isinstance(target, DecoderModel):  # a pipeline's stages (vkrt/engine/pipeline.py)
            raise VkrtError('--speculative-config: method "mtp" runs the model\'s head on one device; '
                            "it does not combine with --pipeline-parallel-size > 1 yet")
        if target.mtp_source is None:
            raise VkrtError('--speculative-config: method "mtp" drafts with the model\'s multi-token-prediction '
                            "head, and this model has none that vkrt loads (Qwen3.5, Qwen3-Next, GLM-4.5 and "
                            "DeepSeek-V3 checkpoints carry one, unless they were saved or converted without it); "
                            'use {"method": "ngram", ...} instead')
        self.head = MTPHead(target, mtp_head_model(target.mtp_source))
        self.kv, self.blocks = proposer_kv_cache(self.head, config, max_model_len, target_blocks,
                                                 num_speculative_tokens)
        self.views: dict[str, _View] = {}
        backend = self.head.backend
        self.replay = backend.supports_replay and self.head.replayable
        # A catch-up runs each view's accepted tokens and its last position again: at most k + 2.
        self.max_tokens = config.max_num_seqs * (num_speculative_tokens + 2)
        # A view's positions end below the target's length plus its guesses.
        self.max_blocks = -(-(max_model_len + num_speculative_tokens) // config.block_size)
        self.graphs: dict[tuple[int, int], _HeadGraph] = {}  # by (tokens, views) bucket
        log.info("MTP head: %d layer%s, KV %d MiB", self.head.config.num_layers,
                 "" if self.head.config.num_layers == 1 else "s", self.kv.nbytes >> 20)

    def observe(self, scheduled: Sequence[ScheduledRequest], token_hidden: np.ndarray) -> None:
        """Keep the target's states of the positions that stand after a step: each chunk's rows
        (in step order) below its request's count of computed tokens."""
        row = 0
        for s in scheduled:
            request = s.request
            end = min(s.start + s.num_tokens, request.num_computed_tokens)
            if request.pooling is None and request.params.speculative and not request.is_finished:
                view = self._view(request)
                for position in range(s.start, end):
                    view.hidden[position] = token_hidden[row + position - s.start]
            row += s.num_tokens

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> StepStats:
        """Set each (request, k)'s `spec_token_ids` to the head's next k guesses; what the head's
        steps cost. On a failed step (device errors pass through) the head forgets everything."""
        asked = {request.request_id for request, _ in wanted}
        for request_id, view in list(self.views.items()):
            # Gone, or taking no guesses this step after its first token: its states would pile up.
            if view.request.status is not RequestStatus.RUNNING or (
                    request_id not in asked and view.request.num_output_tokens > 0):
                self._forget(request_id)
        views: list[tuple[_View, int]] = []
        for request, k in wanted:
            request.spec_token_ids = []
            # Only a request whose next step is its one new token takes guesses (after a hybrid's
            # rejection it recomputes first, and the scheduler attaches no proposals to that).
            if request.num_tokens - request.num_computed_tokens == 1:
                views.append((self._sync(request), k))
        cost = StepStats()
        outputs: dict[str, np.ndarray] = {}  # each view's last output: what its next guess continues from
        try:
            caught_up = [v for v, _ in views if self._allocate(v, v.tokens.num_tokens - v.tokens.num_computed_tokens)]
            if caught_up:
                chunks = [(v, v.tokens.num_computed_tokens, self._catch_up_hidden(v)) for v in caught_up]
                cost = cost.plus(self._step(chunks, outputs, computed=True))
            for j in range(1, max((k for _, k in views), default=0)):
                chained = [v for v, k in views if k > j and v.request.request_id in outputs and self._allocate(v, j)]
                if not chained:
                    break
                chunks = [(v, v.tokens.num_computed_tokens + j - 1, outputs[v.request.request_id][None])
                          for v in chained]
                cost = cost.plus(self._step(chunks, outputs, computed=False))
        except VkrtError:
            for request_id in list(self.views):
                self._forget(request_id)
            raise
        for view, _ in views:
            view.request.spec_token_ids = view.tokens.all_token_ids[view.request.num_tokens - 1:]
        return cost

    def _view(self, request: Request) -> _View:
        view = self.views.get(request.request_id)
        if view is None or view.request is not request:
            if view is not None:
                self._forget(request.request_id)
            view = self.views[request.request_id] = _View(request, Request(request.request_id, [], SamplingParams()))
        return view

    def _sync(self, request: Request) -> _View:
        """The request's view on its current tokens (shifted by one), last step's guesses dropped
        and its count no further than the target's."""
        view = self._view(request)
        tokens = view.tokens
        tokens.all_token_ids = request.all_token_ids[1:]
        # At least the last position runs again: the first guess comes from its output.
        kept = min(tokens.num_computed_tokens, request.num_computed_tokens - 1)
        tokens.num_computed_tokens = kept
        self.blocks.trim(tokens, kept)
        return view

    def _catch_up_hidden(self, view: _View) -> np.ndarray:
        """The target's states of the view's uncomputed positions (zeros where none was observed);
        the count moves to the end, and states before the last are dropped."""
        start, end = view.tokens.num_computed_tokens, view.tokens.num_tokens
        width = self.head.config.hidden_size
        rows = np.stack([view.hidden.get(p, np.zeros(width, np.float32)) for p in range(start, end)])
        for position in [p for p in view.hidden if p < end - 1]:
            del view.hidden[position]
        return rows

    def _allocate(self, view: _View, num_tokens: int) -> bool:
        return self.blocks.allocate_slots(view.tokens, num_tokens)

    def _step(self, chunks: list[tuple[_View, int, np.ndarray]], outputs: dict[str, np.ndarray],
              computed: bool) -> StepStats:
        """One head forward: each view's positions from `start` with the states given, its next
        guess appended to its tokens and its last output kept in `outputs`. `computed`: the states
        are the target's, so the positions count as the head's cache (a catch-up)."""
        counters = self.head.backend.counters
        before, began = counters.snapshot(), time.perf_counter()
        scheduled = [ScheduledRequest(v.tokens, start, len(rows)) for v, start, rows in chunks]
        batch, _ = build_forward_batch(SchedulerOutput(scheduled), self.blocks)
        hidden = np.concatenate([r for _, _, r in chunks]).astype(np.float32)
        graph = self._graph_for(batch)
        guesses, states = graph.run(batch, hidden) if graph is not None else self._run_eagerly(batch, hidden)
        vocab = self.head.config.vocab_size
        for (view, start, r), guess, state in zip(chunks, guesses, states, strict=True):
            if computed:
                view.tokens.num_computed_tokens = start + len(r)
            if 0 <= int(guess) < vocab:
                view.tokens.all_token_ids.append(int(guess))
                outputs[view.request.request_id] = state
            else:  # a row of NaN or Inf: no more guesses for it
                outputs.pop(view.request.request_id, None)
        return StepStats(num_seqs=len(chunks), num_tokens=batch.num_tokens, num_logits_rows=len(chunks),
                         seconds=time.perf_counter() - began, counters=counters.since(before),
                         replayed=graph is not None)

    def _run_eagerly(self, batch: ForwardBatch, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step recorded and submitted now: each view's guess and last row's state."""
        backend = self.head.backend
        step = StepTensors.upload(backend, batch)
        rows = int(batch.logits_index.shape[0])
        params = backend.upload(np.tile(GREEDY_PARAMS, (rows, 1)), "f32", purpose="inputs")
        uniforms = backend.upload(np.zeros(rows, np.float32), "f32", purpose="inputs")
        logits, out = self.head.forward_mtp(step, self.kv, backend.upload(hidden, "f32", purpose="inputs"))
        ids = ops.sample_top_k(logits, params, uniforms, None)
        last = ops.gather_rows(out, step.logits_index)
        return (backend.read(ids).reshape(rows),
                np.asarray(backend.read(last), dtype=np.float32).reshape(rows, -1))

    def _graph_for(self, batch: ForwardBatch) -> _HeadGraph | None:
        """The recorded step for this batch (consecutive positions of every view, none at
        position 0), or None to run it eagerly."""
        t, views = batch.num_tokens, batch.num_seqs
        if not self.replay or t > self.max_tokens or batch.block_tables.shape[-1] > self.max_blocks:
            return None
        if not verify_shaped(batch) or not bool(np.all(batch.positions > 0)):
            return None
        key = (_pow2(t), _pow2(views))
        try:
            return recorded(self.graphs, key, lambda: _HeadGraph(self.head, self.kv, *key, self.max_blocks))
        except NotReplayable:
            log.warning("the MTP head's steps cannot be recorded for replay on %s; running them eagerly",
                        self.head.backend.name)
            self.replay = False
            return None

    def _forget(self, request_id: str) -> None:
        view = self.views.pop(request_id)
        self.blocks.free(view.tokens)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _HeadGraph:
    """The head's step over up to `tokens` positions of up to `views` views, recorded once:
    persistent inputs (the step's tensors, the states beside its tokens, each view's last row),
    the head over those last rows, and greedy guesses drawn on the device. Padding rows attend to
    nothing and store no K/V; padding views guess from row 0, and are dropped."""

    def __init__(self, head: MTPHead, kv: KVCache, tokens: int, views: int, max_blocks: int) -> None:
        backend = head.backend
        self.backend = backend
        self.host = padded_batch(tokens, len(kv.num_blocks), max_blocks)
        self.host_hidden = np.zeros((tokens, head.config.hidden_size), np.float32)
        self.hidden = backend.upload(self.host_hidden, "f32")
        self.host_last = np.zeros(views, np.int32)
        self.last = backend.upload(self.host_last, "i32")
        # No host batch: its positions would be read as position 0 (see the module's docstring).
        self.inputs = dataclasses.replace(StepTensors.upload(backend, self.host), batch=None, logits_index=self.last)
        params = backend.upload(np.tile(GREEDY_PARAMS, (views, 1)), "f32")
        uniforms = backend.upload(np.zeros(views, np.float32), "f32")
        with backend.capture() as graph:
            logits, out = head.forward_mtp(self.inputs, kv, self.hidden)
            self.ids = ops.sample_top_k(logits, params, uniforms, None)
            self.states = ops.gather_rows(out, self.last)
        self.graph = graph

    def run(self, batch: ForwardBatch, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each view's guess and state (its last row's)."""
        t, views = batch.num_tokens, batch.num_seqs
        write_padded(self.backend, batch, self.host, self.inputs)
        self.host_hidden[:t], self.host_hidden[t:] = hidden, 0.0
        self.host_last[:views], self.host_last[views:] = batch.logits_index, 0
        self.backend.write(self.hidden, self.host_hidden)
        self.backend.write(self.last, self.host_last)
        self.graph.replay()
        states = np.asarray(self.backend.read(self.states), dtype=np.float32).reshape(self.host_last.size, -1)
        return self.backend.read(self.ids)[:views], states[:views]
