"""What every architecture implements, and the step inputs the engine hands it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vkrt.backend.base import Backend
from vkrt.core import kv_format
from vkrt.core.tensor import Tensor, storage_nbytes
from vkrt.errors import UnsupportedModelError, VkrtError
from vkrt.loader.config import LoadedModel, ModelConfig


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block pool and one block table per sequence: equal attention windows."""

    window: int  # 0: full attention; W: positions p - W < j <= p
    layers: tuple[int, ...]


def kv_groups(config: ModelConfig) -> list[KVGroup]:
    """The model's KV groups: full-attention layers first, then one group per window, smallest
    first. Recurrent layers have no KV cache (their state is a slot of `StatePool`)."""
    by_window: dict[int, list[int]] = {}
    for i in range(config.num_layers):
        if config.layer(i).attends:
            by_window.setdefault(config.layer(i).window, []).append(i)
    return [KVGroup(w, tuple(by_window[w])) for w in sorted(by_window)]


def kv_tensors_per_layer(config: ModelConfig) -> int:
    """2 (a key and a value tensor), or 1 for MLA, whose value is its cached key row."""
    return 1 if config.kv_lora_rank else 2


def state_shapes(config: ModelConfig) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Each recurrent layer's state tensors, as the shape of one sequence's slot (f32)."""
    shapes: dict[int, tuple[tuple[int, ...], ...]] = {}
    for i in range(config.num_layers):
        mixer = config.layer(i).recurrent
        if mixer == "short_conv":  # the last K - 1 inputs of every channel
            shapes[i] = ((config.hidden_size, config.conv_kernel - 1),)
        elif mixer == "gated_delta_net":  # the conv's window over q|k|v, and S per value head
            c = config
            channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            shapes[i] = ((channels, c.conv_kernel - 1),
                         (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))
        elif mixer == "mamba2":  # the conv's window over x|B|C, and each head's [P, N]
            c = config
            channels = c.mamba_num_heads * c.mamba_head_dim + 2 * c.mamba_n_groups * c.mamba_state_size
            shapes[i] = ((channels, c.conv_kernel - 1), (c.mamba_num_heads, c.mamba_head_dim, c.mamba_state_size))
    return shapes


@dataclass(frozen=True)
class Stage:
    """The layers one pipeline stage holds, [start, stop) of `num_layers`: the first stage also
    embeds the tokens, the last also applies the final norm and the head."""

    start: int
    stop: int
    num_layers: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.num_layers


def split_layers(num_layers: int, stages: int) -> list[Stage]:
    """`stages` consecutive runs of layers, as even as they come (the first ones one longer)."""
    if not 1 <= stages <= num_layers:
        raise VkrtError(f"--pipeline-parallel-size must be in [1, {num_layers}] (the model's layers), got {stages}")
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for i in range(stages):
        bounds.append(bounds[-1] + base + (i < extra))
    return [Stage(a, b, num_layers) for a, b in zip(bounds, bounds[1:], strict=False)]


def unsplittable(config: ModelConfig) -> str | None:
    """Why this model's layers cannot be split into pipeline stages, or None: what a layer reads
    must come with the hidden state or live in its own stage."""
    if state_shapes(config):
        return "its recurrent layers' state (hybrid models) is not split over stages yet"
    if config.per_layer_input_size:
        return "every layer reads the per-layer embeddings the first layer's input makes (Gemma 4)"
    if any(config.kv_layer_of(i) != i for i in range(config.num_layers) if config.layer(i).attends):
        return "some layers read an earlier layer's K/V cache (Gemma 4's shared KV)"
    return None


@dataclass
class ForwardBatch:
    """One step over any mix of sequences, as host arrays (the engine builds it).

    Token t belongs to row `seq_index[t]` of `block_tables` at `positions[t]`; its K/V go to
    cache slot `slots[t]` (block * block_size + offset). Logits are produced only for the
    token rows in `logits_index` (typically the last token of each sequence's chunk).
    With one row of `slots` and one table per KV group ([G, T] and [G, S, max_blocks]) each
    group's layers use their own; without the group axis every group uses the same ones.
    """

    token_ids: np.ndarray  # i32 [T]
    positions: np.ndarray  # i32 [T]
    seq_index: np.ndarray  # i32 [T]
    slots: np.ndarray  # i32 [T] or [G, T]
    block_tables: np.ndarray  # i32 [S, max_blocks] or [G, S, max_blocks]
    logits_index: np.ndarray  # i32 [R]
    state_slots: np.ndarray | None = None  # i32 [S]: each sequence's recurrent-state slot (None: slot s)
    hidden_index: np.ndarray | None = None  # i32 [H]: token rows whose final-norm hidden state comes back

    @property
    def seq_start(self) -> np.ndarray:
        """i32 [S + 1]: sequence s's tokens are seq_start[s] .. seq_start[s + 1] - 1 (a sequence's
        tokens are consecutive; padding tokens, seq_index -1, belong to none)."""
        counts = np.bincount(self.seq_index[self.seq_index >= 0], minlength=self.num_seqs)[: self.num_seqs]
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[-2])


@dataclass
class StepTensors:
    """ForwardBatch uploaded to the device. Persistent ones can be rewritten in place.

    `slots` and `block_tables` are KV group 0's; `group_slots[g]` / `group_block_tables[g]`
    each group's (empty when every group shares group 0's).
    """

    token_ids: Tensor
    positions: Tensor
    seq_index: Tensor
    slots: Tensor
    block_tables: Tensor
    logits_index: Tensor
    seq_start: Tensor  # i32 [S + 1] (ForwardBatch.seq_start)
    state_slots: Tensor  # i32 [S]
    group_slots: tuple[Tensor, ...] = ()
    group_block_tables: tuple[Tensor, ...] = ()
    batch: ForwardBatch | None = None  # the host arrays uploaded (None: persistent tensors of a recorded step)

    @classmethod
    def upload(cls, backend: Backend, batch: ForwardBatch) -> StepTensors:
        def up(a: np.ndarray) -> Tensor:
            return backend.upload(np.ascontiguousarray(a, dtype=np.int32), "i32", purpose="inputs")

        slots, tables = batch.slots, batch.block_tables
        group_slots = tuple(up(row) for row in slots) if slots.ndim == 2 else ()
        group_tables = tuple(up(table) for table in tables) if tables.ndim == 3 else ()
        state_slots = batch.state_slots if batch.state_slots is not None else np.arange(batch.num_seqs)
        return cls(up(batch.token_ids), up(batch.positions), up(batch.seq_index),
                   group_slots[0] if group_slots else up(slots), group_tables[0] if group_tables else up(tables),
                   up(batch.logits_index), up(batch.seq_start), up(state_slots), group_slots, group_tables, batch)

    def slots_of(self, group: int) -> Tensor:
        """Cache slots of this step's tokens in KV group `group`'s pool."""
        return self.group_slots[group] if self.group_slots else self.slots

    def block_tables_of(self, group: int) -> Tensor:
        """Block tables [S, max_blocks] of KV group `group`."""
        return self.group_block_tables[group] if self.group_block_tables else self.block_tables


@dataclass
class KVCache:
    """Per-layer key and value caches: [num_blocks of the layer's group, block_size, kv_heads * head_dim]."""

    keys: dict[int, Tensor]  # by attention layer that stores K/V (ModelConfig.kv_layer_of)
    values: dict[int, Tensor]
    num_blocks: list[int]  # per KV group
    block_size: int
    dtype: str  # the --kv-cache-dtype (f32, f16, q8_0; vkrt.core.kv_format)
    groups: list[KVGroup] = field(default_factory=list)
    layer_group: list[int] = field(default_factory=list)  # KV group of each layer (-1: it does not attend)
    # Recurrent layers' states: each layer's tensors [num_state_slots, *slot shape] (state_shapes).
    states: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    num_state_slots: int = 0

    @property
    def nbytes(self) -> int:
        """K and V bytes, each tensor once (an MLA layer's value is its key tensor; the recurrent
        states' are `state_nbytes`)."""
        tensors = {id(t): t for t in (*self.keys.values(), *self.values.values())}
        return sum(t.nbytes for t in tensors.values())

    @property
    def state_nbytes(self) -> int:
        return sum(t.nbytes for tensors in self.states.values() for t in tensors)

    def group_of(self, layer: int) -> int:
        return self.layer_group[layer] if self.layer_group else 0


class CausalLM(ABC):
    """A decoder-only language model written against vkrt.ops only."""

    config: ModelConfig
    backend: Backend
    file_type: str = ""  # storage format of most weights, e.g. "Q4_1"
    stage: Stage | None = None  # a pipeline stage's part of the model (None: all of it)
    replayable = True  # decode steps can be recorded once and replayed (False: every step runs eagerly)
    mtp_source: LoadedModel | None = None  # a checkpoint's MTP head, on the host (vkrt/models/mtp.py)

    @abstractmethod
    def __init__(self, loaded: LoadedModel, backend: Backend, stage: Stage | None = None) -> None: ...

    def kv_groups(self) -> list[KVGroup]:
        return kv_groups(self.config)

    def state_bytes_per_slot(self) -> int:
        """Recurrent-state bytes one sequence holds in every recurrent layer (0: no such layer)."""
        return sum(4 * int(np.prod(shape)) for shapes in state_shapes(self.config).values() for shape in shapes)

    def kv_bytes_per_block(self, block_size: int, dtype: str = "f32") -> int:
        """K and V bytes of one block in every layer."""
        return sum(self.kv_group_bytes_per_block(block_size, dtype))

    def check_kv_dtype(self, dtype: str) -> None:
        """UnsupportedModelError if this model's heads cannot use the KV cache format `dtype`."""
        c = self.config
        for kv_heads, head_dim in sorted({(c.kv_heads_of(i), c.head_dim_of(i)) for i in range(c.num_layers)}):
            why = kv_format.unsupported(dtype, kv_heads, head_dim)
            if why is not None:
                raise UnsupportedModelError(f"--kv-cache-dtype {dtype} does not fit this model: {why}; use f16 or f32")

    def cached_layers(self, group: KVGroup) -> list[int]:
        """The group's layers that store K/V (a layer reading an earlier layer's cache stores none)."""
        return [i for i in group.layers if self.config.kv_layer_of(i) == i]

    def kv_group_bytes_per_block(self, block_size: int, dtype: str = "f32") -> list[int]:
        """K and V bytes of one block of each KV group (its layers that store K/V only)."""
        c = self.config
        self.check_kv_dtype(dtype)
        fmt, per_layer = kv_format.tensor_dtype(dtype), kv_tensors_per_layer(c)
        return [sum(per_layer * storage_nbytes((block_size, c.kv_heads_of(i) * c.head_dim_of(i)), fmt)
                    for i in self.cached_layers(g)) for g in self.kv_groups()]

    def kv_positions(self, num_blocks: int | Sequence[int], block_size: int, max_len: int | None = None) -> int:
        """Positions a sequence can reach in a cache of these pools (the RoPE tables' length).

        A full-attention pool bounds a sequence's length; a sliding window's does not (it
        recycles blocks), so a model of sliding layers only is bounded by `max_len` (the
        engine's max_model_len) when given, else by its largest pool.
        """
        counts = self._pool_sizes(num_blocks)
        full = [n for n, g in zip(counts, self.kv_groups(), strict=True) if not g.window]
        if full:
            reach = min(full) * block_size
        else:
            reach = max_len if max_len is not None else max(counts) * block_size
        return min(self.config.max_position_embeddings, reach)

    def _pool_sizes(self, num_blocks: int | Sequence[int]) -> list[int]:
        groups = self.kv_groups()
        counts = [num_blocks] * len(groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(groups):
            raise ValueError(f"{len(counts)} pool sizes for {len(groups)} KV groups")
        return counts

    def layer_groups(self) -> list[int]:
        """The KV group of each layer (-1: it does not attend)."""
        layer_group = [-1] * self.config.num_layers
        for g, group in enumerate(self.kv_groups()):
            for i in group.layers:
                layer_group[i] = g
        return layer_group

    def allocate_kv_cache(self, num_blocks: int | Sequence[int], block_size: int = 16, dtype: str = "f32",
                          max_len: int | None = None, state_slots: int = 1) -> KVCache:
        """K and V tensors of every attention layer that stores its own, `num_blocks` per KV group
        (one int: the same for all), `dtype` a --kv-cache-dtype (vkrt.core.kv_format); and every
        recurrent layer's state in `state_slots` slots (one per sequence that can run at once)."""
        c = self.config
        self.check_kv_dtype(dtype)
        groups = self.kv_groups()
        counts = self._pool_sizes(num_blocks)
        layer_group = self.layer_groups()
        held = self.stage.layers if self.stage is not None else range(c.num_layers)
        shapes = {i: (counts[g], block_size, c.kv_heads_of(i) * c.head_dim_of(i))
                  for i, g in enumerate(layer_group) if g >= 0 and c.kv_layer_of(i) == i and i in held}
        tensor_dtype = kv_format.tensor_dtype(dtype)
        per_layer = kv_tensors_per_layer(c)
        self.backend.reserve("kv", per_layer * sum(self.backend.tensor_nbytes(shape, tensor_dtype)
                                                   for shape in shapes.values()))
        keys = {i: self.backend.empty(shape, tensor_dtype, purpose="kv") for i, shape in shapes.items()}
        values = keys if per_layer == 1 else {i: self.backend.empty(shape, tensor_dtype, purpose="kv")
                                              for i, shape in shapes.items()}
        states = {i: tuple(self.backend.upload(np.zeros((state_slots, *shape), np.float32), "f32", purpose="kv")
                           for shape in layer_shapes)
                  for i, layer_shapes in state_shapes(c).items() if i in held}
        return KVCache(keys, values, counts, block_size, dtype, groups, layer_group, states,
                       state_slots if states else 0)

    @abstractmethod
    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        """Logits [len(logits_index), vocab] f32 for one step; writes the step's K/V."""

    def close(self) -> None:  # noqa: B027 (a hook: most models hold nothing beyond their tensors)
        """Release what the model holds beyond its tensors (a pipeline's stage processes)."""

    def stage_forward(self, step: StepTensors, kv: KVCache, hidden: Tensor | None) -> Tensor:
        """A pipeline stage's part of `forward` (vkrt/engine/pipeline.py): from the tokens or the
        previous stage's hidden states to the logits or the next stage's hidden states."""
        raise UnsupportedModelError(f"{type(self).__name__} cannot run as a pipeline stage")

    def forward_pooled(self, step: StepTensors, kv: KVCache, hidden_index: Tensor,
                       hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`forward`'s logits and the final-norm hidden states [len(hidden_index), hidden] of the
        rows in `hidden_index` (pooling requests: embeddings, rerank scores); a last pipeline
        stage's from the previous stage's `hidden`."""
        raise UnsupportedModelError(f"{type(self).__name__} does not return hidden states; it cannot pool")
