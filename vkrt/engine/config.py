"""Engine and per-request configuration, built once at the edge and validated there."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from vkrt.core.kv_format import KV_DTYPES
from vkrt.engine.guided import GuidedDecoding
from vkrt.engine.kv_events import KVEventsConfig
from vkrt.engine.speculative import SpeculativeConfig
from vkrt.errors import RequestError, VkrtError

# Most top/scored logprobs one request may ask for per position (OpenAI caps top_logprobs at 20).
MAX_LOGPROBS = 20
# prompt_logprobs asking for every vocabulary entry at each prompt position (vLLM's -1).
ALL_LOGPROBS = -1
# Most ids one request may score explicitly with logprob_token_ids (each costs a gather per row).
MAX_LOGPROB_TOKEN_IDS = 1024
# Default KV budget when kv_cache_memory is not given: enough for max_num_seqs full-length
# sequences, but never more than this (a laptop iGPU shares its memory with everything else).
DEFAULT_KV_BUDGET = 512 * 1024 * 1024
# Default budget for a hybrid model's recurrent state (one fixed-size slot per sequence) when
# state_memory is not given; max_num_seqs is capped to the slots that fit.
DEFAULT_STATE_BUDGET = 512 * 1024 * 1024
# Default budget for the snapshots of a hybrid's recurrent state that prefix caching keeps at
# cached block boundaries (one slot each, as big as a sequence's) when state_snapshot_memory is not given.
DEFAULT_SNAPSHOT_BUDGET = 256 * 1024 * 1024


@dataclass
class EngineConfig:
    """How one engine is built: model, device, batching limits and the KV pool."""

    model: str | Path = ""
    device: str = "auto"  # "auto" | "vulkan" | "reference"
    max_model_len: int | None = None  # None: the model's max_position_embeddings ...
    default_max_model_len: int | None = None  # ... capped at this (the CLI keeps KV small)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for K and V of all layers; None: sized below
    num_kv_blocks: int | None = None  # exact pool size, overrides kv_cache_memory (tests)
    state_memory: int | None = None  # bytes for recurrent-state slots (hybrids); None: DEFAULT_STATE_BUDGET
    # bytes for prefix caching's recurrent-state snapshots (hybrids); None: DEFAULT_SNAPSHOT_BUDGET,
    # 0: none, so prefix caching is off for hybrids
    state_snapshot_memory: int | None = None
    kv_dtype: str = "f16"  # KV cache format (vkrt.core.kv_format); f32 where tests compare against goldens tightly
    enable_prefix_caching: bool = True
    enable_replay: bool = True  # record decode steps once per batch bucket and replay them
    seed: int = 0
    speculative: SpeculativeConfig | None = None  # speculative decoding (vkrt/engine/speculative.py)
    check_tensors: bool | None = None  # scan weights for NaN / Inf at load; None: VKRT_CHECK_TENSORS
    kv_events: KVEventsConfig | None = None  # publish prefix-cache events for routers (vkrt/engine/kv_events.py)
    pipeline_parallel_size: int = 1  # layers split over this many stage processes (vkrt/engine/pipeline.py)
    pipeline_devices: tuple[str, ...] = ()  # VKRT_DEVICE selector of each stage ((): each takes its default)
    pipeline_micro_batches: int | None = None  # a step cut into up to this many (None: one per stage)
    distributed_executor_backend: str = "mp"  # the stages: local processes ("mp") or Ray actors ("ray")
    ray_address: str | None = None  # the Ray cluster of "ray" stages (None: RAY_ADDRESS, else a local one)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise VkrtError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise VkrtError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_dtype not in KV_DTYPES:
            raise VkrtError(f"EngineConfig.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise VkrtError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.state_memory is not None and self.state_memory < 1:
            raise VkrtError(f"EngineConfig.state_memory must be >= 1 byte, got {self.state_memory}")
        if self.pipeline_parallel_size < 1:
            raise VkrtError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_devices and len(self.pipeline_devices) != self.pipeline_parallel_size:
            raise VkrtError(f"--pipeline-devices names {len(self.pipeline_devices)} devices for "
                            f"--pipeline-parallel-size {self.pipeline_parallel_size}; give one per stage")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise VkrtError(f"--pipeline-micro-batches must be >= 1, got {self.pipeline_micro_batches}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise VkrtError("--distributed-executor-backend must be mp (local processes) or ray, got "
                            f"{self.distributed_executor_backend!r}")
        if self.state_snapshot_memory is not None and self.state_snapshot_memory < 0:
            raise VkrtError(f"EngineConfig.state_snapshot_memory must be >= 0 bytes, got {self.state_snapshot_memory}")

    def state_slots(self, bytes_per_slot: int) -> int:
        """How many sequences can run at once given each one's recurrent state: max_num_seqs, or
        fewer when their slots do not fit in state_memory; an error when not even one does."""
        if bytes_per_slot == 0:
            return self.max_num_seqs
        budget = self.state_memory if self.state_memory is not None else DEFAULT_STATE_BUDGET
        fits = budget // bytes_per_slot
        if fits < 1:
            raise VkrtError(f"one sequence's recurrent state is {bytes_per_slot / 2**20:.1f} MiB but the state "
                            f"memory is {budget / 2**20:.1f} MiB; raise --state-memory "
                            f"(>= {bytes_per_slot} bytes)")
        return min(self.max_num_seqs, fits)

    def snapshot_slots(self, bytes_per_slot: int, num_blocks: int) -> int:
        """Snapshot slots for prefix caching of a hybrid: as many as state_snapshot_memory holds,
        but no more than the `num_blocks` cached blocks they can belong to (0: no recurrent state,
        or prefix caching off)."""
        if bytes_per_slot == 0 or not self.enable_prefix_caching:
            return 0
        return min(self.snapshot_budget // bytes_per_slot, num_blocks)

    @property
    def snapshot_budget(self) -> int:
        return self.state_snapshot_memory if self.state_snapshot_memory is not None else DEFAULT_SNAPSHOT_BUDGET

    def resolve_num_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        """KV pool size in blocks: explicit, from kv_cache_memory, or sized for the batch limits."""
        if self.num_kv_blocks is not None:
            num_blocks = self.num_kv_blocks
        elif self.kv_cache_memory is not None:
            num_blocks = self.kv_cache_memory // bytes_per_block
        else:
            wanted = self.max_num_seqs * math.ceil(max_model_len / self.block_size)
            num_blocks = min(wanted, max(DEFAULT_KV_BUDGET // bytes_per_block, 1))
        # One sequence of max_model_len must always fit alone, or it could never finish.
        needed = math.ceil(max_model_len / self.block_size)
        if num_blocks < needed:
            raise VkrtError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens but one "
                f"sequence of max_model_len={max_model_len} needs {needed}; raise "
                f"kv_cache_memory (>= {needed * bytes_per_block} bytes) or lower max_model_len"
            )
        return num_blocks


@dataclass
class SamplingParams:
    """What one request asks for. n=1 only. The engine validates it, with the prompt, when it
    makes the request (vkrt/engine/processor.py)."""

    max_tokens: int | None = 16  # None: until max_model_len
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None  # sample only these ids (None: any)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N alternatives per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None  # ALL_LOGPROBS: the whole vocabulary
    logprob_token_ids: list[int] | None = None  # also score exactly these ids at every position
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    guided_decoding: GuidedDecoding | None = None  # structured output: the grammar to follow
    speculative: bool = True  # False: this request decodes without speculation (when the engine speculates)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError(param=...) naming the first bad field (the context-length rules,
        which need the prompt, are the RequestProcessor's)."""

        def bad(param: str, message: str) -> RequestError:
            return RequestError(f"{param}: {message}", param=param)

        if self.n != 1:
            raise bad("n", f"only n=1 is supported, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias.items():
            if not 0 <= int(token_id) < vocab_size:
                raise bad("logit_bias", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
            if not -100.0 <= float(bias) <= 100.0:
                raise bad("logit_bias", f"bias {bias} for token {token_id} must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must hold at least one token id")
            bad_id = next((t for t in self.allowed_token_ids if not 0 <= t < vocab_size), None)
            if bad_id is not None:
                raise bad("allowed_token_ids", f"token id {bad_id} is outside the vocabulary [0, {vocab_size})")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise bad("stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "stop strings must be non-empty strings")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"{self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS
                                                     or self.prompt_logprobs == ALL_LOGPROBS):
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], or {ALL_LOGPROBS} for the whole "
                      f"vocabulary, got {self.prompt_logprobs}")
        if self.logprob_token_ids is not None:
            if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
                raise bad("logprob_token_ids", f"at most {MAX_LOGPROB_TOKEN_IDS} ids per request")
            for token_id in self.logprob_token_ids:
                if not 0 <= token_id < vocab_size:
                    raise bad("logprob_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.guided_decoding is not None:
            self.guided_decoding.validate()
