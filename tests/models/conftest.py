"""A minimal single-sequence driver over CausalLM.forward, independent of the engine."""

from __future__ import annotations

import numpy as np

from vkrt.backend.base import Backend
from vkrt.models import CausalLM, ForwardBatch, StepTensors


class Greedy:
    """Prefill a prompt, then decode greedily one token per step; records per-step counters."""

    def __init__(self, model: CausalLM, max_len: int, block_size: int = 16) -> None:
        self.model = model
        self.backend: Backend = model.backend
        blocks = -(-max_len // block_size)
        self.kv = model.allocate_kv_cache(blocks, block_size)
        # Blocks in reverse order, so a kernel that ignores the block table fails the test.
        self.block_table = np.arange(blocks - 1, -1, -1, dtype=np.int32)[None, :]
        self.block_size = block_size
        self.step_counters: list[dict[str, int]] = []

    def step(self, tokens: list[int], start: int, all_logits: bool = False) -> np.ndarray:
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.int32)
        slots = self.block_table[0][pos // self.block_size] * self.block_size + pos % self.block_size
        rows = np.arange(n, dtype=np.int32) if all_logits else np.array([n - 1], np.int32)
        batch = ForwardBatch(np.array(tokens, np.int32), pos, np.zeros(n, np.int32),
                             slots.astype(np.int32), self.block_table, rows)
        before = self.backend.counters.snapshot()
        logits = self.model.forward(StepTensors.upload(self.backend, batch), self.kv).numpy()
        self.step_counters.append(self.backend.counters.since(before))
        return logits

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        logits = self.step(prompt, 0)
        out = [int(logits[-1].argmax())]
        for i in range(new_tokens - 1):
            logits = self.step([out[-1]], len(prompt) + i)
            out.append(int(logits[-1].argmax()))
        return out
