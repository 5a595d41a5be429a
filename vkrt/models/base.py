"""What every architecture implements, and the step inputs the engine hands it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from vkrt.backend.base import Backend
from vkrt.loader.config import LoadedModel, ModelConfig
from vkrt.ops.tensor import Tensor


@dataclass
class ForwardBatch:
    """One step over any mix of sequences, as host arrays (the engine builds it).

    Token t belongs to row `seq_index[t]` of `block_tables` at `positions[t]`; its K/V go to
    cache slot `slots[t]` (block * block_size + offset). Logits are produced only for the
    token rows in `logits_index` (typically the last token of each sequence's chunk).
    """

    token_ids: np.ndarray  # i32 [T]
    positions: np.ndarray  # i32 [T]
    seq_index: np.ndarray  # i32 [T]
    slots: np.ndarray  # i32 [T]
    block_tables: np.ndarray  # i32 [S, max_blocks]
    logits_index: np.ndarray  # i32 [R]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class StepTensors:
    """ForwardBatch uploaded to the device. Persistent ones can be rewritten in place."""

    token_ids: Tensor
    positions: Tensor
    seq_index: Tensor
    slots: Tensor
    block_tables: Tensor
    logits_index: Tensor

    @classmethod
    def upload(cls, backend: Backend, batch: ForwardBatch) -> StepTensors:
        def up(a: np.ndarray) -> Tensor:
            return backend.upload(np.ascontiguousarray(a, dtype=np.int32), "i32", purpose="inputs")

        return cls(up(batch.token_ids), up(batch.positions), up(batch.seq_index), up(batch.slots),
                   up(batch.block_tables), up(batch.logits_index))


@dataclass
class KVCache:
    """Per-layer key and value caches: [num_blocks, block_size, kv_heads * head_dim]."""

    keys: list[Tensor]
    values: list[Tensor]
    num_blocks: int
    block_size: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


class CausalLM(ABC):
    """A decoder-only language model written against vkrt.ops only."""

    config: ModelConfig
    backend: Backend
    file_type: str = ""  # storage format of most weights, e.g. "Q4_1"

    @abstractmethod
    def __init__(self, loaded: LoadedModel, backend: Backend) -> None: ...

    def kv_bytes_per_block(self, block_size: int, dtype: str = "f32") -> int:
        c = self.config
        item = 4 if dtype == "f32" else 2
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * item

    def allocate_kv_cache(self, num_blocks: int, block_size: int = 16, dtype: str = "f32") -> KVCache:
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads * c.head_dim)
        self.backend.reserve("kv", 2 * c.num_layers * self.backend.weight_nbytes(dtype, shape))
        keys = [self.backend.empty(shape, dtype, purpose="kv") for _ in range(c.num_layers)]
        values = [self.backend.empty(shape, dtype, purpose="kv") for _ in range(c.num_layers)]
        return KVCache(keys, values, num_blocks, block_size, dtype)

    @abstractmethod
    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        """Logits [len(logits_index), vocab] f32 for one step; writes the step's K/V."""
