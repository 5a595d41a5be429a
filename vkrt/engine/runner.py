"""One scheduled step -> one ForwardBatch -> one model forward -> a StepResult on the host:
the logits rows, or each row's token sampled on the device."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from vkrt import ops
from vkrt.backend.base import Backend
from vkrt.core.tensor import Tensor
from vkrt.engine.kv_groups import KVCacheManager
from vkrt.engine.request import Request
from vkrt.engine.sampler import GREEDY_PARAMS, SampleInputs
from vkrt.engine.scheduler import SchedulerOutput
from vkrt.engine.state_snapshots import StateCopies
from vkrt.errors import DeviceLostError, NotReplayable, OutOfDeviceMemory
from vkrt.models.base import CausalLM, ForwardBatch, KVCache, StepTensors
from vkrt.ops.sampling import ALL_ALLOWED, mask_words

log = logging.getLogger("vkrt")

# Computes one step's token masks: u32 [rows, ceil(V / 32)], row i for logits row i.
MaskSource = Callable[[], np.ndarray]


@dataclass
class LogitsLayout:
    """Which logits row serves what: a sampled next token, or prompt-logprob positions."""

    # (request, first row, rows): rows 1 + its proposals in a verify step, else 1; row
    # first + i samples the token after the request's tokens and its first i proposals.
    sample_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # (request, first row, first prompt position scored, count): row first + k gives the
    # logprob of prompt token (position + k).
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # Pooling requests: (request, first hidden row, first position, count): hidden row first + k
    # is position + k's final-norm state.
    hidden_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # (request, logits row) of the pooling requests whose prompt ends this step and that want its logits.
    pooled_logits: list[tuple[Request, int]] = field(default_factory=list)
    # Pooling requests whose prompt ends this step: they finish with it.
    pooled: list[Request] = field(default_factory=list)


def build_forward_batch(out: SchedulerOutput, blocks: KVCacheManager) -> tuple[ForwardBatch, LogitsLayout]:
    """Flatten every scheduled chunk into one ForwardBatch (sequence j = out.scheduled[j]),
    with one row of slots and one block table per sequence for each KV group."""
    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    seq_index: list[np.ndarray] = []
    groups = range(blocks.num_groups)
    slots: list[list[np.ndarray]] = [[] for _ in groups]
    tables = [[blocks.block_table(s.request.request_id, g) for s in out.scheduled] for g in groups]
    width = max((len(t) for group in tables for t in group), default=1)
    block_tables = np.zeros((len(groups), len(out.scheduled), width), dtype=np.int32)
    logits_index: list[int] = []
    hidden_index: list[int] = []
    layout = LogitsLayout()
    offset = 0
    for j, s in enumerate(out.scheduled):
        request = s.request
        for g in groups:
            # Entries a window dropped (kv_cache.NULL_BLOCK) are never read; 0 keeps every entry a valid block.
            block_tables[g, j, :len(tables[g][j])] = np.maximum(tables[g][j], 0)
            slots[g].append(blocks.slots(request.request_id, s.start, s.num_tokens, g))
        token_ids += request.all_token_ids[s.start:s.start + s.num_tokens - len(s.spec)] + s.spec
        positions.append(np.arange(s.start, s.start + s.num_tokens))
        seq_index.append(np.full(s.num_tokens, j))
        if request.pooling is not None:
            wanted = request.pooling.positions(s.start, s.num_tokens, request.num_prompt_tokens)
            if wanted:
                layout.hidden_rows.append((request, len(hidden_index), wanted.start, len(wanted)))
                hidden_index += range(offset + wanted.start - s.start, offset + wanted.stop - s.start)
            if s.samples:
                layout.pooled.append(request)
                if request.pooling.logits:
                    layout.pooled_logits.append((request, len(logits_index)))
                    logits_index.append(offset + s.num_tokens - 1)
            offset += s.num_tokens
            continue
        if request.prompt_logprobs is not None:
            # Row at position p predicts prompt token p + 1; skip positions already scored
            # (a preempted request recomputes its prompt).
            first = max(s.start, len(request.prompt_logprobs) - 1)
            last = min(s.start + s.num_tokens, request.num_prompt_tokens - 1)
            if last > first:
                layout.prompt_rows.append((request, len(logits_index), first + 1, last - first))
                logits_index += range(offset + first - s.start, offset + last - s.start)
        if s.samples:
            rows = 1 + len(s.spec)
            layout.sample_rows.append((request, len(logits_index), rows))
            logits_index += range(offset + s.num_tokens - rows, offset + s.num_tokens)
        offset += s.num_tokens
    if not logits_index:
        logits_index.append(offset - 1)  # the model always returns >= 1 row; this one is unused

    def i32(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    batch = ForwardBatch(
        token_ids=np.asarray(token_ids, dtype=np.int32),
        positions=i32(positions),
        seq_index=i32(seq_index),
        slots=np.stack([i32(group) for group in slots]),
        block_tables=block_tables,
        logits_index=np.asarray(logits_index, dtype=np.int32),
        state_slots=np.array([blocks.state_slot(s.request.request_id) for s in out.scheduled], np.int32),
        hidden_index=np.asarray(hidden_index, dtype=np.int32) if hidden_index else None,
    )
    return batch, layout


@dataclass(frozen=True)
class StepResult:
    """What one forward brought back to the host: exactly one of logits and token_ids is set."""

    logits: np.ndarray | None = None  # float32 [rows, vocab], when the host samples
    token_ids: np.ndarray | None = None  # int32 [rows], each row's sample_top_k token drawn on the device
    hidden: np.ndarray | None = None  # float32 [len(hidden_index), hidden]: pooling requests' final-norm states
    # float32 [T, hidden]: every token row's final-norm state (a runner made with token_hidden: MTP speculation)
    token_hidden: np.ndarray | None = None


@dataclass
class StepStats:
    """What one forward cost: sizes, wall time, and the backend's counters for it."""

    num_seqs: int = 0
    num_tokens: int = 0
    num_logits_rows: int = 0
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    replayed: bool = False

    def plus(self, other: StepStats) -> StepStats:
        """This step with `other`'s time and counters added (a draft model's steps)."""
        counters = dict(self.counters)
        for key, value in other.counters.items():
            counters[key] = counters.get(key, 0) + value
        return StepStats(self.num_seqs, self.num_tokens, self.num_logits_rows, self.seconds + other.seconds,
                         counters, self.replayed)


class ModelRunner:
    """Runs ForwardBatches through a CausalLM over its paged KV cache.

    Decode steps (one token per sequence, every token sampled; or a verify step's few per
    sequence, on a model without recurrent layers) are padded to a power-of-two
    bucket and, on a backend that supports it, recorded once per bucket and replayed: the
    host only rewrites the step's input tensors, then one submit runs the whole step.
    Prefill and mixed steps run eagerly.
    """

    def __init__(self, model: CausalLM, kv: KVCache, max_step_tokens: int, max_model_len: int,
                 replay: bool = True, verify_width: int = 1, token_hidden: bool = False) -> None:
        """`max_step_tokens`: the most tokens a decode or verify step holds (max_num_seqs, times
        1 + k when speculating); steps up to its bucket are recorded. `verify_width` (1 + k when
        speculating) adds buckets at its multiples: a verify step is padded to the next one
        rather than to a power of two (on llvmpipe a step's cost grows with its rows).
        `token_hidden`: every step also brings back each token row's final-norm hidden state
        (StepResult.token_hidden), what an MTP head continues from."""
        self.model = model
        self.kv = kv
        self.token_hidden = token_hidden
        self.backend = model.backend
        self.last_step = StepStats()
        self.replay = replay and self.backend.supports_replay and model.replayable
        self.max_bucket = 1 << max(0, max_step_tokens - 1).bit_length()
        self.buckets = sorted({1 << i for i in range(self.max_bucket.bit_length())}
                              | (set(range(verify_width, max_step_tokens + 1, verify_width)) if verify_width > 1 else set()))
        self.max_blocks = -(-max_model_len // kv.block_size)
        self._graphs: dict[int, _DecodeGraph] = {}

    def execute(self, batch: ForwardBatch, sampling: SampleInputs | None = None,
                masks: MaskSource | None = None, copies: StateCopies | None = None) -> StepResult:
        """Run the step; its K/V land in the cache. Without `sampling` the result holds the
        logits [len(batch.logits_index), vocab] float32.

        With `sampling` (one row per logits row) the caller needs only each row's
        sample_top_k token: the result holds int32 ids [rows] instead, drawn on the device
        (inside the recorded step when it is replayed), so no logits are read back. `masks` (None: no
        row is constrained) is called exactly once: for a replayed step after its submit,
        while the device runs the forward (the sampling waits for the masks on the device);
        otherwise before the step. With `sampling` its rows mask the draws.

        `copies` (a hybrid's prefix caching and speculation) are recurrent-state slot copies
        recorded around the forward, on the device: restores before it, snapshots after it. A step
        with snapshots runs eagerly (only prefill steps have them); a replayed step's restores (a
        verify step's checkpoints) run just before its submit, in one submit of their own. A step
        with `batch.hidden_index` (pooling requests) runs eagerly too and also brings those rows'
        final-norm hidden states back.
        """
        counters = self.backend.counters
        before = counters.snapshot()
        start = time.perf_counter()
        rows = int(batch.logits_index.shape[0])
        if sampling is not None and sampling.uniforms.shape != (rows,):
            raise ValueError(f"sampling has {sampling.uniforms.shape[0]} rows, the step {rows} logits rows")
        try:
            eager = (copies is not None and bool(copies.snapshot)) or batch.hidden_index is not None
            graph = None if eager else self._graph_for(batch)
            if graph is not None:
                if copies is not None:
                    self._copy_states(copies.restore)  # flushed by the replay, ahead of it
                result = graph.run(batch, sampling, masks)
            else:
                result = self._run_eagerly(batch, sampling, masks, copies or StateCopies())
        except (OutOfDeviceMemory, DeviceLostError):
            self.backend.discard()  # what the failed step recorded must not run with the next one
            raise
        self.last_step = StepStats(
            num_seqs=batch.num_seqs,
            num_tokens=batch.num_tokens,
            num_logits_rows=rows,
            seconds=time.perf_counter() - start,
            counters=counters.since(before),
            replayed=graph is not None,
        )
        return result

    def _run_eagerly(self, batch: ForwardBatch, sampling: SampleInputs | None, masks: MaskSource | None,
                     copies: StateCopies) -> StepResult:
        rows, tokens = int(batch.logits_index.shape[0]), batch.num_tokens
        host_masks = None if masks is None else masks()
        step = StepTensors.upload(self.backend, batch)
        # Every input is written before the forward is recorded: an upload after it could have
        # to submit the forward first, when its memory is one the forward still reads.
        if sampling is not None:
            params = self.backend.upload(sampling.params, "f32", purpose="inputs")
            uniforms = self.backend.upload(sampling.uniforms, "f32", purpose="inputs")
            mask = None if host_masks is None else self.backend.upload(host_masks, "u32", purpose="inputs")
        self._copy_states(copies.restore)
        normed = None
        if batch.hidden_index is None and not self.token_hidden:
            logits = self.model.forward(step, self.kv)
        else:  # every token row's state when the runner returns them all; the pooling rows are among them
            wanted = np.arange(tokens, dtype=np.int32) if self.token_hidden else batch.hidden_index
            assert wanted is not None
            index = self.backend.upload(wanted, "i32", purpose="inputs")
            logits, normed = self.model.forward_pooled(step, self.kv, index)
        self._copy_states(copies.snapshot)
        hidden = token_hidden = None
        if normed is not None:
            hidden = np.asarray(self.backend.read(normed), dtype=np.float32).reshape(normed.shape)
            if self.token_hidden:
                token_hidden = hidden
                hidden = None if batch.hidden_index is None else hidden[batch.hidden_index]
        if sampling is None:
            return StepResult(logits=np.asarray(self.backend.read(logits), dtype=np.float32).reshape(rows, -1),
                              hidden=hidden, token_hidden=token_hidden)
        ids = ops.sample_top_k(logits, params, uniforms, mask)
        return StepResult(token_ids=self.backend.read(ids).reshape(rows), hidden=hidden, token_hidden=token_hidden)

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slot src to dst in every recurrent layer's tensors, for each (src, dst)."""
        if not pairs:
            return
        src, dst = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
        for tensors in self.kv.states.values():
            for state in tensors:
                ops.copy_state_slots(state, src, dst)

    def _graph_for(self, batch: ForwardBatch) -> _DecodeGraph | None:
        """The recorded step for this decode batch's bucket, or None to run eagerly."""
        t = batch.num_tokens
        if not self.replay or t == 0 or t > self.max_bucket:
            return None
        if batch.block_tables.shape[-1] > self.max_blocks or not np.array_equal(batch.logits_index, np.arange(t)):
            return None
        if not np.array_equal(batch.seq_index, np.arange(t)) and not verify_shaped(batch):
            return None
        bucket = self.buckets[bisect.bisect_left(self.buckets, t)]
        try:
            return recorded(self._graphs, bucket, lambda: _DecodeGraph(self.model, self.kv, bucket, self.max_blocks,
                                                                       self.token_hidden))
        except NotReplayable:
            # An op of this model has no native kernel here (its drain named it in a
            # warning): decode steps run eagerly, correct but one submit per drain.
            log.warning("decode steps of this model cannot be recorded for replay on %s; "
                        "running them eagerly", self.backend.name)
            self.replay = False
            return None


class Recorded(Protocol):
    """A recorded step: its backend graph (`stale` once the backend released its pipelines)."""

    graph: Any


R = TypeVar("R", bound=Recorded)
K = TypeVar("K", int, tuple[int, int])


def recorded(graphs: dict[K, R], bucket: K, record: Callable[[], R]) -> R:
    """graphs[bucket], recorded now when it is missing or stale (NotReplayable passes through)."""
    graph = graphs.get(bucket)
    if graph is not None and graph.graph.stale:  # the backend released its pipelines: record again
        graph.graph.release()
        graph = None
    if graph is None:
        graph = graphs[bucket] = record()
    return graph


def verify_shaped(batch: ForwardBatch) -> bool:
    """Whether a recorded decode graph runs `batch` as it is: one or several consecutive tokens
    of every sequence in order (a decode step, or a verify step of speculative decoding).
    Attention reads each token's own positions through its sequence's table, and the recurrent
    kernels walk each sequence's tokens from `seq_start` (a graph recorded with one token per
    sequence takes the same per-sequence kernels a verify step's eager run does: its sequences
    are short)."""
    seq = batch.seq_index
    return (batch.num_seqs <= batch.num_tokens and int(seq[0]) == 0
            and bool(np.all(np.diff(seq) >= 0)) and bool(np.all(np.diff(seq) <= 1))
            and int(seq[-1]) == batch.num_seqs - 1)


def padded_batch(bucket: int, groups: int, max_blocks: int) -> ForwardBatch:
    """The host arrays of a recorded step's inputs: `bucket` token rows of `groups` KV groups'
    slots and block tables, every row padding until `write_padded` fills them."""
    return ForwardBatch(
        token_ids=np.zeros(bucket, np.int32), positions=np.zeros(bucket, np.int32),
        seq_index=np.full(bucket, -1, np.int32), slots=np.full((groups, bucket), -1, np.int32),
        block_tables=np.zeros((groups, bucket, max_blocks), np.int32),
        logits_index=np.arange(bucket, dtype=np.int32), state_slots=np.zeros(bucket, np.int32))


def write_padded(backend: Backend, batch: ForwardBatch, host: ForwardBatch, inputs: StepTensors) -> None:
    """Write `batch` into a recorded step's inputs (`host`: their arrays, from `padded_batch`),
    the rows past its tokens padding: seq_index -1 makes attention skip them and slot -1 keeps
    their K/V out of the cache."""
    t = batch.num_tokens
    host.token_ids[:t], host.token_ids[t:] = batch.token_ids, 0
    host.positions[:t], host.positions[t:] = batch.positions, 0
    host.seq_index[:t], host.seq_index[t:] = batch.seq_index, -1
    host.slots[:, :t], host.slots[:, t:] = batch.slots, -1
    s = batch.num_seqs  # t, or fewer in a verify step (several tokens per sequence)
    host.block_tables[:] = 0
    host.block_tables[:, :s, :batch.block_tables.shape[-1]] = batch.block_tables
    assert host.state_slots is not None
    host.state_slots[:s], host.state_slots[s:] = batch.state_slots if batch.state_slots is not None else 0, 0
    for name in ("token_ids", "positions", "seq_index", "state_slots"):
        backend.write(getattr(inputs, name), getattr(host, name))
    backend.write(inputs.seq_start, host.seq_start)  # padding sequences hold no tokens
    for g in range(host.slots.shape[0]):
        backend.write(inputs.slots_of(g), host.slots[g])
        backend.write(inputs.block_tables_of(g), host.block_tables[g])


class _DecodeGraph:
    """One decode bucket: persistent input tensors and the forward recorded over them,
    then sample_top_k over the logits (a step that samples reads back only its ids).
    Each KV group has its own slots and block tables among the inputs. The token masks are
    a late input: the host writes them after the submit, and the sampling dispatch waits on
    the device until it has, so their computation overlaps the forward. With `token_hidden`
    the forward also gives every row's final-norm hidden state, read back after the step."""

    def __init__(self, model: CausalLM, kv: KVCache, bucket: int, max_blocks: int, token_hidden: bool = False) -> None:
        backend = model.backend
        self.backend = backend
        self.bucket = bucket
        self.max_blocks = max_blocks
        self.host = padded_batch(bucket, len(kv.num_blocks), max_blocks)
        self.inputs = StepTensors.upload(backend, self.host)
        # Padding rows sample greedily (top_k=1) with a uniform of 0; their ids are dropped.
        self.host_sampling = SampleInputs(np.tile(GREEDY_PARAMS, (bucket, 1)), np.zeros(bucket, np.float32))
        self.sample_params = backend.upload(self.host_sampling.params, "f32")
        self.uniforms = backend.upload(self.host_sampling.uniforms, "f32")
        # Token masks (structured output), rewritten only while a step has a constrained row;
        # host-visible, since the host writes them while the step runs.
        self.host_masks = np.full((bucket, mask_words(model.config.vocab_size)), ALL_ALLOWED, np.uint32)
        self.masks = backend.upload(self.host_masks, "u32", purpose="inputs")
        self.masks_all_ones = True
        self.hidden: Tensor | None = None
        rows = backend.upload(np.arange(bucket, dtype=np.int32), "i32") if token_hidden else None
        with backend.capture() as graph:
            graph.wait_for_host(self.masks)  # recorded just before the sampling dispatch reads them
            if rows is None:
                self.logits = model.forward(self.inputs, kv)
            else:
                self.logits, self.hidden = model.forward_pooled(self.inputs, kv, rows)
            self.ids = ops.sample_top_k(self.logits, self.sample_params, self.uniforms, self.masks)
        self.graph = graph

    def run(self, batch: ForwardBatch, sampling: SampleInputs | None, masks: MaskSource | None) -> StepResult:
        t = batch.num_tokens
        write_padded(self.backend, batch, self.host, self.inputs)
        if sampling is None:  # the caller samples on the host: the ids are not read
            self.graph.replay(during=masks)  # the masks are only computed, for the host sampler
            return StepResult(logits=np.asarray(self.backend.read(self.logits), dtype=np.float32)[:t],
                              token_hidden=self._token_hidden(t))
        params, uniforms = self.host_sampling.params, self.host_sampling.uniforms
        params[:t], params[t:] = sampling.params, GREEDY_PARAMS
        uniforms[:t], uniforms[t:] = sampling.uniforms, 0.0
        self.backend.write(self.sample_params, params)
        self.backend.write(self.uniforms, uniforms)
        if masks is None:
            if not self.masks_all_ones:  # restore after a constrained step, before the submit
                self.host_masks[:] = ALL_ALLOWED
                self.backend.write(self.masks, self.host_masks)
                self.masks_all_ones = True
            self.graph.replay()  # the event is left set: the sampling does not wait
        else:
            self.masks_all_ones = False

            def write_masks() -> None:
                self.host_masks[:t] = masks()
                self.host_masks[t:] = ALL_ALLOWED
                self.backend.write(self.masks, self.host_masks)

            self.graph.replay(during=write_masks)
        return StepResult(token_ids=self.backend.read(self.ids)[:t], token_hidden=self._token_hidden(t))

    def _token_hidden(self, t: int) -> np.ndarray | None:
        if self.hidden is None:
            return None
        return np.asarray(self.backend.read(self.hidden), dtype=np.float32).reshape(self.hidden.shape)[:t]
