"""EngineCore: one synchronous step = schedule -> one forward -> sample -> outputs.

Requests come in through one edge: `make_request` validates a prompt and its parameters and
compiles its grammar (vkrt/engine/processor.py), `add` queues the Request it made. LLM drives
the engine in a loop; AsyncLLM drives it from a background thread. A pooling request
(`make_pooling_request`, vkrt/engine/pooling.py) shares the steps with generation requests:
its prompt runs as any prefill, and it finishes with its hidden states instead of a token.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from vkrt.engine.config import ALL_LOGPROBS, EngineConfig, SamplingParams
from vkrt.engine.draft import DraftProposer, verify_row
from vkrt.engine.guided import GrammarCompiler, StepMasks
from vkrt.engine.kv_events import KVEvents, all_blocks_cleared, event_batch
from vkrt.engine.kv_groups import KVCacheManager, size_kv_pools
from vkrt.engine.mtp_draft import MTPProposer
from vkrt.engine.output import OutputProcessor
from vkrt.engine.pooling import PoolingParams
from vkrt.engine.processor import RequestProcessor
from vkrt.engine.request import Request, RequestOutput, RequestOutputKind, RequestStatus
from vkrt.engine.runner import LogitsLayout, ModelRunner, StepResult, StepStats, build_forward_batch
from vkrt.engine.sampler import Sampler, sample_inputs, token_logprobs
from vkrt.engine.scheduler import Scheduler
from vkrt.engine.speculative import SpecStats, backoff_after, ngram_proposal, proposal_length
from vkrt.errors import (
    DeviceLostError,
    NoTokenizerError,
    OutOfDeviceMemory,
    RequestError,
    VkrtError,
)
from vkrt.models.base import CausalLM
from vkrt.ops.sampling import NONFINITE
from vkrt.tokenizer import Tokenizer

if TYPE_CHECKING:
    from vkrt.engine.kv_event_publisher import ZmqEventPublisher

log = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one step did, for metrics: token counts, latencies observed, device counters."""

    step: StepStats
    num_prompt_tokens: int = 0  # prompts of requests that produced their first token this step
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    ttfts: list[float] = field(default_factory=list)
    mask_seconds: float | None = None  # host time computing structured-output masks (None: none)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec: SpecStats = field(default_factory=SpecStats)  # this step's verified proposals


# Upper bounds of the steps-by-tokens histogram: vLLM's buckets of vllm:iteration_tokens_total.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineTotals:
    """Running totals since start (the facades derive tok/s and per-step averages from these)."""

    steps: int = 0
    # Steps by the tokens they ran: steps_by_tokens[i] counts those with at most
    # STEP_TOKEN_BUCKETS[i] tokens and more than the bound before (the last: more than all).
    steps_by_tokens: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    step_tokens: int = 0  # tokens run, over all steps
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # A step with any prefill token counts as prefill time; pure-decode steps as decode time.
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)  # all steps
    decode_counters: dict[str, int] = field(default_factory=dict)  # pure-decode steps, summed
    decode_counters_max: dict[str, int] = field(default_factory=dict)  # worst pure-decode step
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's proposals and acceptances
    nonfinite_logits: int = 0  # requests ended because their logits held NaN or Inf
    out_of_memory_steps: int = 0  # steps the device refused for lack of memory (their requests ended)

    def decode_counters_per_step(self) -> dict[str, float]:
        return {k: v / self.decode_steps for k, v in self.decode_counters.items()} if self.decode_steps else {}

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


StatsListener = Callable[[IterationStats], None]


class EngineCore:
    """Requests in, RequestOutputs out, one `step()` at a time. Not thread-safe."""

    def __init__(self, config: EngineConfig, model: CausalLM, tokenizer: Tokenizer | None = None) -> None:
        config.validate()
        spec = config.speculative
        # A hybrid that speculates keeps each sequence's state from before its verify step too
        # (a checkpoint slot), to go back to when a proposal is rejected.
        slot_bytes = model.state_bytes_per_slot()
        checkpoints = spec is not None and slot_bytes > 0
        per_seq = slot_bytes * (2 if checkpoints else 1)
        slots = config.state_slots(per_seq)  # a hybrid's sequences share a state budget
        if slots < config.max_num_seqs:
            log.warning("max_num_seqs capped at %d (asked %d): each sequence's recurrent state is %.1f MiB%s and "
                        "%d sequences fill the state memory; raise --state-memory for more", slots,
                        config.max_num_seqs, per_seq / 2**20, " (with its checkpoint for speculation)" if checkpoints
                        else "", slots)
            config = replace(config, max_num_seqs=slots)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_model_len = config.max_model_len or min(model.config.max_position_embeddings,
                                                         config.default_max_model_len or 1 << 62)
        if self.max_model_len > model.config.max_position_embeddings:
            raise VkrtError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{model.config.max_position_embeddings}; lower max_model_len")
        groups = model.kv_groups()
        bytes_per_block = model.kv_group_bytes_per_block(config.block_size, config.kv_dtype)
        num_blocks = size_kv_pools(config, groups, bytes_per_block, self.max_model_len)
        # A hybrid's prefix hit needs the recurrent state at its end: snapshot slots follow the
        # running sequences' in the state tensors (engine/state_snapshots.py).
        snapshots = config.snapshot_slots(slot_bytes, num_blocks[0])
        kv = model.allocate_kv_cache(num_blocks, config.block_size, config.kv_dtype, max_len=self.max_model_len,
                                     state_slots=config.max_num_seqs * (2 if checkpoints else 1) + snapshots)
        self.prefix_caching = config.enable_prefix_caching and (not kv.states or snapshots > 0)
        if config.enable_prefix_caching and kv.states and not snapshots:
            log.warning("prefix caching is off for this model: --state-snapshot-memory (%.1f MiB) holds no "
                        "snapshot of its recurrent state (%.1f MiB each), so a cached prefix would lack it",
                        config.snapshot_budget / 2**20, slot_bytes / 2**20)
        self.block_manager = KVCacheManager(groups, num_blocks, config.block_size, self.prefix_caching,
                                            num_state_slots=config.max_num_seqs if kv.states else 0,
                                            num_snapshot_slots=snapshots, state_checkpoints=checkpoints)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # A verify step runs each sequence's token and its proposals: its bucket is that much wider.
        step_tokens = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        # An MTP head continues from the target's hidden states: every step brings them back.
        mtp = spec is not None and spec.method == "mtp"
        self.runner = ModelRunner(model, kv, min(step_tokens, max(config.max_num_batched_tokens, config.max_num_seqs)),
                                  self.max_model_len, replay=config.enable_replay,
                                  verify_width=1 + (spec.num_speculative_tokens if spec else 0), token_hidden=mtp)
        # A draft model's (or MTP head's) own KV pool holds as many tokens as the target's first group.
        self.drafter: DraftProposer | MTPProposer | None = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftProposer.load(spec, config, model, tokenizer, self.max_model_len, num_blocks[0])
        elif spec is not None and mtp:
            self.drafter = MTPProposer(model, config, self.max_model_len, num_blocks[0], spec.num_speculative_tokens)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(tokenizer, self.max_model_len)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else model.config.eos_token_ids
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self.processor = RequestProcessor(self.vocab_size, self.max_model_len, self.eos_token_ids, self.grammars,
                                          seed=config.seed)
        self.totals = EngineTotals()
        self.stats_listeners: list[StatsListener] = []
        # Set once a step met VK_ERROR_DEVICE_LOST: nothing can run any more, so every request
        # (running, waiting or added later) ends with it; the process has to be restarted.
        self.device_lost: DeviceLostError | None = None
        log.info("KV cache: %s blocks x %d tokens (%d MiB), max_model_len %d",
                 " + ".join(f"{n} ({len(g.layers)} layers, window {g.window or 'full'})"
                            for n, g in zip(num_blocks, groups, strict=True)),
                 config.block_size, kv.nbytes >> 20, self.max_model_len)
        if spec is not None:
            log.info("speculative decoding: %s", spec.describe())
        if kv.states:
            log.info("recurrent state: %d slots + %d prefix-cache snapshots x %d KiB (%d layers), %d MiB",
                     config.max_num_seqs, snapshots, slot_bytes >> 10, len(kv.states), kv.state_nbytes >> 20)
        # Last: nothing after it may fail and leave the publisher's thread and sockets behind.
        self.kv_events: ZmqEventPublisher | None = None
        if config.kv_events is not None:
            if self.prefix_caching:
                self.kv_events = self._start_kv_events()
            else:
                log.warning("KV events are off: this engine has no prefix cache, so no block is ever stored")

    def _start_kv_events(self) -> ZmqEventPublisher:
        """Attach an event log to each group's block manager and start the publisher; its first
        batch is AllBlocksCleared, so a router forgets what an earlier engine at this endpoint held."""
        # Imported here: a server without KV events never imports zmq.
        from vkrt.engine.kv_event_publisher import ZmqEventPublisher

        assert self.config.kv_events is not None
        for idx, manager in enumerate(self.block_manager.managers):
            manager.events = KVEvents(manager.block_size, idx, manager.window)
        publisher = ZmqEventPublisher(self.config.kv_events)
        publisher.publish(event_batch([all_blocks_cleared()]))
        return publisher

    def _publish_kv_events(self) -> None:
        """The step's stores and evictions, as one batch (none when the cache did not change)."""
        if self.kv_events is None:
            return
        events = [e for m in self.block_manager.managers if m.events is not None for e in m.events.take()]
        if events:
            self.kv_events.publish(event_batch(events))

    def close(self) -> None:
        """Stop what runs beside the engine (the KV event publisher); the engine itself holds no thread."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self.model.close()

    @classmethod
    def from_config(cls, config: EngineConfig, model: CausalLM | None = None,
                    tokenizer: Tokenizer | None = None) -> EngineCore:
        """Load the model named by `config` (unless one is given) with its tokenizer, if it has one."""
        config.validate()  # before a load (or a pipeline's processes) that a bad field would waste
        built = model is None
        if model is None:
            from vkrt.backend import get_backend
            from vkrt.loader import load_model
            from vkrt.models import build_model

            path = config.model
            if not path:
                from vkrt.loader.pull import ensure_default_model

                path = ensure_default_model()
            if config.pipeline_parallel_size > 1:
                from vkrt.engine.pipeline import PipelineModel

                # Here only the config and tokenizer: each stage loads (and checks) its own weights.
                loaded = load_model(path, check_tensors=False)
                model = PipelineModel(loaded, get_backend("reference"), config.pipeline_parallel_size,
                                      config.device, config.pipeline_devices, config.check_tensors,
                                      micro_batches=config.pipeline_micro_batches,
                                      executor=config.distributed_executor_backend, ray_address=config.ray_address)
            else:
                loaded = load_model(path, check_tensors=config.check_tensors)
                model = build_model(loaded, get_backend(config.device))
            if tokenizer is None:
                try:
                    tokenizer = Tokenizer.from_model(loaded)
                except NoTokenizerError as exc:  # e.g. test fixtures that ship only weights;
                    # a tokenizer that is present but corrupt stays an error
                    log.warning("%s; only token-id prompts will work", exc)
        try:
            return cls(config, model, tokenizer)
        except BaseException:
            if built:  # what the load started (a pipeline's stage processes) must not outlive the error
                model.close()
            raise

    # ---- requests -------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                     prompt: str | None = None,
                     output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> Request:
        """Validate a request and compile its grammar, once; RequestError for a bad prompt,
        parameter or grammar. Safe from any thread (nothing is queued)."""
        if self.model.config.num_labels:
            raise RequestError(f"this model is a sequence classifier ({self.model.config.num_labels} labels): it "
                               "scores (/v1/rerank, /v1/score) and embeds, but does not generate text", param="model")
        return self.processor.make_request(request_id, prompt_token_ids, params, prompt=prompt,
                                           output_kind=output_kind)

    def make_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> Request:
        """A request whose prompt's final-norm hidden states are pooled instead of sampled from;
        RequestError for a bad prompt. Safe from any thread."""
        return self.processor.make_pooling_request(request_id, prompt_token_ids, params)

    def add(self, request: Request) -> None:
        """Queue a request `make_request` made. Its arrival is now: the queue time the metrics
        report starts when the engine takes it, not when a caller built it."""
        request.metrics.arrival_time = time.monotonic()
        self.scheduler.add_request(request)
        self.outputs.add(request)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> Request:
        """`make_request` then `add` (cumulative outputs)."""
        request = self.make_request(request_id, prompt_token_ids, params, prompt=prompt)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort and free the request's blocks now; its final output, or None if not in flight."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        # A finished request always has an output, whatever its kind.
        output = self.outputs.make_output(request)
        self.outputs.remove(request_id)
        return output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------

    def reset_totals(self) -> None:
        """Start the throughput and counter totals afresh (e.g. between benchmark runs)."""
        self.totals = EngineTotals()

    def step(self) -> list[RequestOutput]:
        """Run one batched forward; an output for every request that got a token (for a
        FINAL_ONLY request, only once it finishes). A verify step (speculative decoding) may
        give a request several tokens."""
        if self.device_lost is not None:
            return self._fail(list(self.scheduler.requests.values()), self.device_lost)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            self._publish_kv_events()
            return []
        batch, layout = build_forward_batch(scheduled, self.block_manager)
        # One entry per sampled logits row: a verifying request once for each of its rows.
        row_requests = [request for request, _, rows in layout.sample_rows for _ in range(rows)]
        # Constrained rows' token masks: the runner has them computed while the device runs
        # a replayed step (before the step otherwise); the sampling waits for them.
        masks = StepMasks.of(row_requests, self.grammars.words)
        # When every row is plain greedy or sample_top_k's, the device samples and only ids
        # come back (the draws happen here, one per sampled row, as the host's would).
        # A sampling draft's proposals are verified against the target's whole distribution: host rows.
        host_rows = (bool(layout.prompt_rows) or bool(layout.pooled_logits)
                     or any(r.spec_draft_probs for r in row_requests))
        sampling = None if host_rows else sample_inputs(row_requests, len(batch.logits_index))
        # A hybrid's prefix caching: states restored from snapshots and snapshots taken this step.
        copies = self.block_manager.state_copies((s.request, s.start, s.num_tokens, len(s.spec))
                                                 for s in scheduled.scheduled)
        try:
            result = self.runner.execute(batch, sampling, masks, copies)
        except DeviceLostError as exc:
            log.critical("%s; ending every request, and this engine can run nothing more", exc)
            self.device_lost = exc
            return self._fail(list(self.scheduler.requests.values()), exc)
        except OutOfDeviceMemory as exc:
            # runner.execute discarded what the step had recorded; what ran of it wrote only its
            # own requests' blocks and state, released now, so the engine is consistent: its
            # requests end, the others go on.
            log.error("a step of %d requests ran out of device memory (%s); ending them", len(scheduled.scheduled), exc)
            self.totals.out_of_memory_steps += 1
            return self._fail([s.request for s in scheduled.scheduled], exc)
        self.block_manager.commit_state_snapshots()
        now = time.monotonic()
        for s in scheduled.scheduled:  # proposals count as computed once they are accepted
            s.request.num_computed_tokens += s.num_tokens - len(s.spec)
        if result.logits is not None:
            for request, row, position, count in layout.prompt_rows:
                assert request.prompt_logprobs is not None
                num_top = request.params.prompt_logprobs or 0
                if num_top == ALL_LOGPROBS:
                    num_top = result.logits.shape[1]
                for k in range(count):
                    entry = token_logprobs(result.logits[row + k], request.prompt_token_ids[position + k],
                                           num_top, request.params.logprob_token_ids)
                    self.outputs.fill_text(entry)
                    request.prompt_logprobs.append(entry)

        stats = IterationStats(self.runner.last_step, num_preemptions=len(scheduled.preempted),
                               mask_seconds=None if masks is None else masks.seconds)
        failed = {} if masks is None else masks.failed
        results = self._pool(layout, result, stats, now)
        mask_row = 0  # the request's first entry in row_requests (and the masks)
        for request, first, rows in layout.sample_rows:
            status = self._emit(request, result, first, rows, mask_row, masks, failed, stats, now)
            mask_row += rows
            if status is not None:
                self.scheduler.finish(request, status)
                stats.finished.append(FinishedRequestStats(
                    status.finish_reason or "", now - request.metrics.arrival_time,
                    request.num_prompt_tokens, request.num_output_tokens))
            output = self.outputs.make_output(request)
            if output is not None:
                results.append(output)
            if status is not None:
                self.outputs.remove(request.request_id)
        for s in scheduled.scheduled:
            self.block_manager.free_skipped_blocks(s.request)  # blocks that left a sliding window
        if result.token_hidden is not None and isinstance(self.drafter, MTPProposer):
            self.drafter.observe(scheduled.scheduled, result.token_hidden)  # the states of what stands
        draft_cost = self._propose(request for request, _, _ in layout.sample_rows)
        if draft_cost is not None:  # the draft model's steps are part of this step's cost
            stats.step = stats.step.plus(draft_cost)
        self._record(stats, num_prefill=scheduled.num_tokens - scheduled.num_decode_tokens)
        self._publish_kv_events()
        return results

    def _pool(self, layout: LogitsLayout, result: StepResult, stats: IterationStats, now: float) -> list[RequestOutput]:
        """Keep the pooling requests' hidden rows of this step; finish those whose prompt ended."""
        for request, first, position, count in layout.hidden_rows:
            assert request.pooled is not None and result.hidden is not None
            request.pooled.put(position, result.hidden[first:first + count])
        for request, row in layout.pooled_logits:
            assert request.pooled is not None and result.logits is not None
            request.pooled.logits = result.logits[row].copy()
        outputs: list[RequestOutput] = []
        for request in layout.pooled:
            assert request.pooled is not None
            pooled = request.pooled.result()
            status = RequestStatus.FINISHED_STOPPED
            values = [pooled.embedding] if pooled.logits is None else [pooled.embedding, pooled.logits]
            if not all(np.all(np.isfinite(v)) for v in values):
                self.totals.nonfinite_logits += 1
                request.error = ("the model's hidden states hold NaN or Inf (a corrupt weight or an overflow); "
                                 "`--check-tensors` scans the weights for NaN / Inf")
                status = RequestStatus.FINISHED_ERROR
            self.scheduler.finish(request, status)
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.finished.append(FinishedRequestStats(status.finish_reason or "", now - request.metrics.arrival_time,
                                                       request.num_prompt_tokens, 0))
            output = self.outputs.make_output(request)
            assert output is not None
            outputs.append(replace(output, pooling=pooled if status is RequestStatus.FINISHED_STOPPED else None))
            self.outputs.remove(request.request_id)
        return outputs

    def _emit(self, request: Request, result: StepResult, first: int, rows: int, mask_row: int,
              masks: StepMasks | None, failed: dict[int, str], stats: IterationStats,
              now: float) -> RequestStatus | None:
        """Sample the request's rows in order and emit their tokens: all of a plain step's one;
        in a verify step while each equals its proposal (then the target's own token after the
        last accepted one). The status that ends the request, if any."""
        drafts = request.spec_token_ids[:rows - 1]
        metrics = request.metrics
        status: RequestStatus | None = None
        emitted = accepted = 0
        for i in range(rows):
            if mask_row + i in failed:  # its row had no mask, so its token is unconstrained: not emitted
                log.error("request %s: computing its grammar's token mask failed (%s); aborting it",
                          request.request_id, failed[mask_row + i])
                status = RequestStatus.FINISHED_ABORTED
                break
            row = first + i
            if result.token_ids is not None:  # sampled on the device
                token_id, logprobs = int(result.token_ids[row]), None
            elif i < len(drafts) and request.spec_draft_probs:  # a sampling draft's proposal
                assert result.logits is not None
                token_id, logprobs = verify_row(request, result.logits[row], drafts[i], request.spec_draft_probs[i])
            else:
                assert result.logits is not None
                mask = None if masks is None or masks.masks is None else masks.masks[mask_row + i:mask_row + i + 1]
                sampled = self.sampler.sample(result.logits[row:row + 1], [request], mask)
                token_id, logprobs = sampled.token_ids[0], sampled.logprobs[0]
            if token_id == NONFINITE:
                status = self._nonfinite(request)
                break
            if i == 0:
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                    stats.ttfts.append(now - metrics.arrival_time)
                    stats.num_prompt_tokens += request.num_prompt_tokens
                elif metrics.last_token_time is not None:
                    stats.inter_token_latencies.append(now - metrics.last_token_time)
                metrics.last_token_time = now
            stats.num_generation_tokens += 1
            emitted += 1
            status = self.outputs.append_token(request, token_id, logprobs)
            if request.guide is not None:
                status = self._advance_guide(request, token_id, status)
            if i == len(drafts) or token_id != drafts[i]:
                break
            accepted += 1
            if status is not None:
                break
        if drafts:
            stats.spec.record(len(drafts), accepted)
            request.spec_backoff = request.spec_wait = backoff_after(request.spec_backoff, accepted)
            assert self.config.speculative is not None
            request.spec_length = proposal_length(len(drafts), accepted, self.config.speculative.num_speculative_tokens)
            request.num_computed_tokens += accepted  # the accepted proposals' K/V stand
            if accepted < len(drafts) and status is None and self.block_manager.checkpoint_base is not None:
                # A hybrid's recurrent state went on through the rejected proposals: the next step
                # starts from the state before this one and computes its tokens again.
                request.num_computed_tokens -= 1 + accepted
                self.block_manager.roll_back_state(request)
            if result.token_ids is None and not request.params.greedy and not request.spec_draft_probs:
                for _ in range(rows - emitted):  # the draws the device would have made for them
                    request.generator.random()
            if status is None:
                self.block_manager.trim(request, request.num_tokens)  # blocks only rejected ones needed
        request.spec_token_ids, request.spec_draft_probs = [], []
        return status

    def _propose(self, requests: Iterable[Request]) -> StepStats | None:
        """Proposals for each running request's next step (speculative decoding): up to k
        tokens, no more than its max_tokens and max_model_len leave room for. What a draft
        model's steps cost (None: no draft model ran)."""
        spec = self.config.speculative
        if spec is None:
            return None
        wanted: list[tuple[Request, int]] = []
        for request in requests:
            if request.is_finished or not request.params.speculative:
                continue
            if request.guide is not None and isinstance(self.drafter, DraftProposer) and not request.params.greedy:
                # A sampled draft token the grammar rejects must still be verified (and rejected)
                # for the emitted token to follow the target's distribution; cutting it is not
                # exact, so a constrained request that samples does not take a draft's proposals.
                continue
            if self.drafter is None and request.spec_wait:  # its last proposals all failed: plain steps for a while
                request.spec_wait -= 1
                continue
            room = self.max_model_len - request.num_tokens
            if request.params.max_tokens is not None:
                room = min(room, request.params.max_tokens - request.num_output_tokens - 1)
            k = min(request.spec_length or spec.num_speculative_tokens, room)
            if k > 0:
                wanted.append((request, k))
        cost: StepStats | None = None
        if self.drafter is None:
            for request, k in wanted:
                request.spec_token_ids = ngram_proposal(request.all_token_ids, k, spec.prompt_lookup_max,
                                                        spec.prompt_lookup_min)
        else:
            try:
                cost = self.drafter.propose(wanted)
            except (OutOfDeviceMemory, DeviceLostError) as exc:  # proposals are optional: the next step decodes plainly
                log.error("the draft model's step failed (%s); no proposals this step", exc)
                return None
        for request, _ in wanted:  # a constrained request proposes only what its grammar accepts
            if request.guide is not None and request.spec_token_ids:
                del request.spec_token_ids[request.guide.valid_prefix(request.spec_token_ids):]
        return cost

    def _fail(self, requests: list[Request], exc: VkrtError) -> list[RequestOutput]:
        """End `requests` with finish_reason "error" and `exc` as the reason: their step failed
        on the device. Their blocks go back, and none the step did not fill stays in the prefix cache."""
        outputs: list[RequestOutput] = []
        for request in requests:
            request.error = str(exc)
            self.block_manager.forget_uncomputed(request)
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            output = self.outputs.make_output(request)
            if output is not None:
                outputs.append(output)
            self.outputs.remove(request.request_id)
        self._publish_kv_events()
        return outputs

    def _nonfinite(self, request: Request) -> RequestStatus:
        """End a request whose logits hold NaN or Inf (a corrupt weight, an overflow): any token
        drawn from them would be garbage."""
        self.totals.nonfinite_logits += 1
        request.error = (f"the model's logits after {request.num_tokens} tokens hold NaN or Inf (a corrupt weight "
                         "or an overflow in the model); `--check-tensors` scans the weights for NaN / Inf")
        log.error("request %s: %s; ending it", request.request_id, request.error)
        return RequestStatus.FINISHED_ERROR

    def _advance_guide(self, request: Request, token_id: int, status: RequestStatus | None) -> RequestStatus | None:
        """Feed the sampled token to the request's grammar: a complete grammar stops the request;
        a rejected token (the mask allowed it, so a bug) aborts it rather than emit invalid output."""
        assert request.guide is not None
        if not request.guide.advance(token_id):
            log.error("request %s: the grammar rejected token %d: %s", request.request_id, token_id,
                      request.guide.error)
            return RequestStatus.FINISHED_ABORTED
        if status is None and request.guide.is_complete:
            return RequestStatus.FINISHED_STOPPED
        return status

    def _record(self, stats: IterationStats, num_prefill: int) -> None:
        totals = self.totals
        step = stats.step
        totals.steps += 1
        totals.steps_by_tokens[bisect.bisect_left(STEP_TOKEN_BUCKETS, step.num_tokens)] += 1
        totals.step_tokens += step.num_tokens
        totals.prompt_tokens += stats.num_prompt_tokens
        totals.generation_tokens += stats.num_generation_tokens
        totals.spec.add(stats.spec)
        if num_prefill:
            totals.prefill_tokens += num_prefill
            totals.prefill_seconds += step.seconds
        else:
            totals.decode_tokens += stats.num_generation_tokens
            totals.decode_steps += 1
            totals.decode_seconds += step.seconds
        for key, value in step.counters.items():
            totals.counters[key] = totals.counters.get(key, 0) + value
            if not num_prefill:
                totals.decode_counters[key] = totals.decode_counters.get(key, 0) + value
                totals.decode_counters_max[key] = max(totals.decode_counters_max.get(key, 0), value)
        for listener in self.stats_listeners:
            listener(stats)

    # ---- state for metrics ----------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def kv_usage(self) -> float:
        return self.block_manager.usage
