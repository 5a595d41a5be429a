"""One scheduled step -> one ForwardBatch -> one model forward -> logits rows on the host."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from vkrt.engine.kv_cache import BlockManager
from vkrt.engine.request import Request
from vkrt.engine.scheduler import SchedulerOutput
from vkrt.models.base import CausalLM, ForwardBatch, KVCache, StepTensors


@dataclass
class LogitsLayout:
    """Which logits row serves what: a sampled next token, or prompt-logprob positions."""

    sample_rows: list[tuple[Request, int]] = field(default_factory=list)  # (request, row)
    # (request, first row, first prompt position scored, count): row first + k gives the
    # logprob of prompt token (position + k).
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)


def build_forward_batch(out: SchedulerOutput, blocks: BlockManager) -> tuple[ForwardBatch, LogitsLayout]:
    """Flatten every scheduled chunk into one ForwardBatch (sequence j = out.scheduled[j])."""
    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    seq_index: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    tables = [blocks.block_table(s.request.request_id) for s in out.scheduled]
    block_tables = np.zeros((len(tables), max((len(t) for t in tables), default=1)), dtype=np.int32)
    logits_index: list[int] = []
    layout = LogitsLayout()
    offset = 0
    for j, s in enumerate(out.scheduled):
        request = s.request
        block_tables[j, :len(tables[j])] = tables[j]
        token_ids += request.all_token_ids[s.start:s.start + s.num_tokens]
        positions.append(np.arange(s.start, s.start + s.num_tokens))
        seq_index.append(np.full(s.num_tokens, j))
        slots.append(blocks.slots(request.request_id, s.start, s.num_tokens))
        if request.prompt_logprobs is not None:
            # Row at position p predicts prompt token p + 1; skip positions already scored
            # (a preempted request recomputes its prompt).
            first = max(s.start, len(request.prompt_logprobs) - 1)
            last = min(s.start + s.num_tokens, request.num_prompt_tokens - 1)
            if last > first:
                layout.prompt_rows.append((request, len(logits_index), first + 1, last - first))
                logits_index += range(offset + first - s.start, offset + last - s.start)
        if s.samples:
            layout.sample_rows.append((request, len(logits_index)))
            logits_index.append(offset + s.num_tokens - 1)
        offset += s.num_tokens
    if not logits_index:
        logits_index.append(offset - 1)  # the model always returns >= 1 row; this one is unused

    def i32(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    batch = ForwardBatch(
        token_ids=np.asarray(token_ids, dtype=np.int32),
        positions=i32(positions),
        seq_index=i32(seq_index),
        slots=i32(slots),
        block_tables=block_tables,
        logits_index=np.asarray(logits_index, dtype=np.int32),
    )
    return batch, layout


@dataclass
class StepStats:
    """What one forward cost: sizes, wall time, and the backend's counters for it."""

    num_seqs: int = 0
    num_tokens: int = 0
    num_logits_rows: int = 0
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    """Runs ForwardBatches through a CausalLM over its paged KV cache."""

    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.backend = model.backend
        self.last_step = StepStats()

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        """Logits [len(batch.logits_index), vocab] float32; the step's K/V land in the cache."""
        counters = self.backend.counters
        before = counters.snapshot()
        start = time.perf_counter()
        step = StepTensors.upload(self.backend, batch)
        logits = self.backend.read(self.model.forward(step, self.kv))
        self.last_step = StepStats(
            num_seqs=int(batch.block_tables.shape[0]),
            num_tokens=batch.num_tokens,
            num_logits_rows=int(batch.logits_index.shape[0]),
            seconds=time.perf_counter() - start,
            counters=counters.since(before),
        )
        return np.asarray(logits, dtype=np.float32).reshape(batch.logits_index.shape[0], -1)
