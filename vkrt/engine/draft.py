"""Draft-model speculation: a small model with the target's vocabulary proposes each request's
next k tokens by decoding them itself.

The draft has its own KV cache (its own block pool, without prefix caching) and its own
ModelRunner, so its decode steps are recorded once per batch bucket and replayed like the
target's, on the same device. For each speculating request it keeps a view: a Request holding
the target's tokens followed by the proposals the draft made, whose `num_computed_tokens`
counts the positions the draft's cache holds. Proposing for a batch is k draft steps: the first
catches each view up on what the draft has not computed (after a verify step the bonus token,
or the last proposal and the bonus when all were accepted; after admission the whole prompt)
and samples proposal 1; each later step feeds the previous proposal and samples the next.
After the target's verify step a view takes the target's tokens again and keeps in its count
only the positions whose tokens did not change: rejected proposals are rolled back by that
count (their blocks trimmed), never copied.

A greedy request's proposals are the draft's argmax (drawn on the device: only ids come back);
a request that samples draws each proposal from the draft's distribution q under its own
sampling parameters and keeps q for its verify row's rejection test (`verify_row`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.engine.kv_groups import KVCacheManager, size_kv_pools
from vkrt.engine.request import Request, RequestStatus, TokenLogprobs
from vkrt.engine.runner import ModelRunner, StepStats, build_forward_batch
from vkrt.engine.sampler import GREEDY_PARAMS, SampleInputs, sampling_distribution, token_logprobs
from vkrt.engine.scheduler import ScheduledRequest, SchedulerOutput
from vkrt.engine.speculative import SpeculativeConfig, draw, rejection_sample
from vkrt.errors import NoTokenizerError, VkrtError
from vkrt.models.base import CausalLM, KVCache
from vkrt.ops.sampling import NONFINITE
from vkrt.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_draft(spec: str, target: CausalLM, check_tensors: bool | None) -> tuple[CausalLM, Tokenizer | None]:
    """The draft model named by `spec` (a path or a pulled model's name) on the target's backend,
    with its tokenizer when it has one."""
    from vkrt.loader import load_model
    from vkrt.loader.pull import resolve_model
    from vkrt.models import build_model

    path, _ = resolve_model(spec, flag='--speculative-config "model"')
    loaded = load_model(path, check_tensors=check_tensors)
    try:
        tokenizer: Tokenizer | None = Tokenizer.from_model(loaded)
    except NoTokenizerError:
        tokenizer = None
    return build_model(loaded, target.backend), tokenizer


def check_same_vocabulary(name: str, target: CausalLM, target_tokenizer: Tokenizer | None,
                          draft: CausalLM, draft_tokenizer: Tokenizer | None) -> None:
    """VkrtError unless the draft's token ids mean what the target's do: the same vocabulary
    size and, where the models ship tokenizers, the same token for every id (as vLLM checks)."""
    sizes = target.config.vocab_size, draft.config.vocab_size
    if sizes[0] != sizes[1]:
        raise VkrtError(f"draft model {name}: its vocabulary has {sizes[1]} tokens, the target's {sizes[0]}; "
                        "a draft model must share the target's tokenizer")
    if target_tokenizer is None and draft_tokenizer is None:
        return  # token-id prompts only: the sizes are all there is to compare
    if target_tokenizer is None or draft_tokenizer is None:
        which = "the target" if target_tokenizer is None else "the draft"
        raise VkrtError(f"draft model {name}: {which} ships no tokenizer, so the two vocabularies cannot be "
                        "compared; a draft model must share the target's tokenizer")
    tokens = [{i: t for t, i in tok.vocab().items()} for tok in (target_tokenizer, draft_tokenizer)]
    for token_id in sorted(tokens[0].keys() | tokens[1].keys()):
        mine, theirs = tokens[0].get(token_id), tokens[1].get(token_id)
        if mine != theirs:
            raise VkrtError(f"draft model {name}: token {token_id} is {mine!r} in the target's vocabulary but "
                            f"{theirs!r} in the draft's; a draft model must share the target's tokenizer")


def verify_row(request: Request, row: np.ndarray, draft: int, q: np.ndarray) -> tuple[int, TokenLogprobs | None]:
    """A sampling request's verify row for proposal `draft` drawn from q: the token it emits
    (`draft` if accepted, else the residual's draw; NONFINITE for a row that holds NaN or Inf)
    and its logprobs when the request asks for them."""
    if not np.isfinite(row.max()):
        return NONFINITE, None
    params = request.params
    p = sampling_distribution(row, params, request.prompt_token_ids, request.output_token_ids,
                              request.eos_token_ids)
    token = rejection_sample(p, q, draft, request.generator)
    if request.logprobs is None:
        return token, None
    return token, token_logprobs(row, token, params.logprobs or 0, params.logprob_token_ids)


@dataclass
class _View:
    """The draft's side of one request: its tokens (the target's, then this step's proposals)
    and, in `tokens.num_computed_tokens`, how many positions the draft's cache holds."""

    request: Request  # the target's
    tokens: Request
    known: int = 0  # positions before this are the target's own tokens: they never change
    probs: list[np.ndarray] = field(default_factory=list)  # q of each proposal (a request that samples)


def proposer_kv_cache(model: CausalLM, config: EngineConfig, max_model_len: int, target_blocks: int,
                      num_speculative_tokens: int) -> tuple[KVCache, KVCacheManager]:
    """A proposer's own KV cache for `model` (a draft model, an MTP head) and its block manager:
    as many tokens as the target's full-attention pool (`target_blocks`) plus room for every
    sequence's proposals, in the target's block size and format, without prefix caching."""
    groups = model.kv_groups()
    extra = config.max_num_seqs * -(-(num_speculative_tokens + 1) // config.block_size)
    sizing = replace(config, num_kv_blocks=target_blocks + extra)
    num_blocks = size_kv_pools(sizing, groups, model.kv_group_bytes_per_block(config.block_size, config.kv_dtype),
                               max_model_len)
    kv = model.allocate_kv_cache(num_blocks, config.block_size, config.kv_dtype, max_len=max_model_len)
    return kv, KVCacheManager(groups, num_blocks, config.block_size, enable_prefix_caching=False)


class DraftProposer:
    """Proposals from a draft model: k replayed draft decode steps per engine step."""

    def __init__(self, model: CausalLM, config: EngineConfig, max_model_len: int, target_blocks: int,
                 num_speculative_tokens: int) -> None:
        """`target_blocks`: the target's full-attention pool; the draft holds as many tokens, plus
        room for every sequence's proposals."""
        if model.state_bytes_per_slot():
            raise VkrtError("a draft model with recurrent layers cannot take rejected proposals back out of its "
                            "state; use a draft with attention layers only")
        if max_model_len > model.config.max_position_embeddings:
            raise VkrtError(f"the draft model's max_position_embeddings ({model.config.max_position_embeddings}) "
                            f"is below max_model_len ({max_model_len}); lower max_model_len")
        self.model = model
        kv, self.blocks = proposer_kv_cache(model, config, max_model_len, target_blocks, num_speculative_tokens)
        # A catch-up step holds up to 2 tokens a sequence (the last proposal and the bonus token).
        self.runner = ModelRunner(model, kv, 2 * config.max_num_seqs, max_model_len, replay=config.enable_replay)
        self.views: dict[str, _View] = {}
        log.info("draft model: %s, KV %d MiB", model.config.architecture, kv.nbytes >> 20)

    @classmethod
    def load(cls, spec: SpeculativeConfig, config: EngineConfig, target: CausalLM, tokenizer: Tokenizer | None,
             max_model_len: int, target_blocks: int) -> DraftProposer:
        """The draft `spec.model` names, checked against the target's vocabulary."""
        assert spec.model is not None
        model, draft_tokenizer = load_draft(spec.model, target, config.check_tensors)
        check_same_vocabulary(spec.model, target, tokenizer, model, draft_tokenizer)
        return cls(model, config, max_model_len, target_blocks, spec.num_speculative_tokens)

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> StepStats:
        """Set each (request, k)'s `spec_token_ids` to the draft's next k tokens (fewer where the
        draft's pool is short) and, for a request that samples, `spec_draft_probs`; what the
        draft's steps cost. On a failed step (device errors pass through) the draft forgets everything."""
        cost = StepStats()
        for request_id in [r for r, v in self.views.items() if v.request.status is not RequestStatus.RUNNING]:
            self._forget(request_id)  # finished, aborted or preempted: its blocks go back
        views = [(self._sync(request), k) for request, k in wanted]
        try:
            for j in range(max((k for _, k in views), default=0)):
                # A view whose row held NaN or Inf has nothing left to feed: it proposes no more.
                active = [v for v, k in views if k > j and v.tokens.num_tokens > v.tokens.num_computed_tokens
                          and self._allocate(v)]
                if not active:
                    break
                cost = cost.plus(self._step(active))
        except VkrtError:
            for request_id in list(self.views):
                self._forget(request_id)
            raise
        for view, _ in views:
            view.request.spec_token_ids = view.tokens.all_token_ids[view.request.num_tokens:]
            view.request.spec_draft_probs = view.probs
        return cost

    def _sync(self, request: Request) -> _View:
        """The request's view, on its current tokens: proposals the target rejected rolled back."""
        view = self.views.get(request.request_id)
        if view is None or view.request is not request:
            if view is not None:
                self._forget(request.request_id)
            # Fresh params: the view is only tokens (no prompt logprobs, no sampling of its own).
            view = self.views[request.request_id] = _View(request, Request(request.request_id, [], SamplingParams()))
        tokens = view.tokens
        kept = min(tokens.num_computed_tokens, request.num_tokens)
        for i in range(view.known, kept):
            if tokens.all_token_ids[i] != request.all_token_ids[i]:
                kept = i
                break
        tokens.all_token_ids = list(request.all_token_ids)
        tokens.num_computed_tokens = kept
        self.blocks.trim(tokens, kept)
        view.known = request.num_tokens
        view.probs = []
        return view

    def _allocate(self, view: _View) -> bool:
        tokens = view.tokens
        return self.blocks.allocate_slots(tokens, tokens.num_tokens - tokens.num_computed_tokens)

    def _step(self, views: list[_View]) -> StepStats:
        """One draft forward over `views`: each one's uncomputed tokens in, its next proposal out."""
        scheduled = [ScheduledRequest(v.tokens, v.tokens.num_computed_tokens,
                                      v.tokens.num_tokens - v.tokens.num_computed_tokens) for v in views]
        batch, _ = build_forward_batch(SchedulerOutput(scheduled), self.blocks)
        ends = np.cumsum([s.num_tokens for s in scheduled]) - 1
        rows = np.arange(len(views))  # logits rows: the last token of each sequence
        if all(s.num_tokens <= 2 for s in scheduled) and batch.num_tokens <= self.runner.max_bucket:
            # Every token's row, so the step is decode-shaped and replays; only the last rows are read.
            batch = replace(batch, logits_index=np.arange(batch.num_tokens, dtype=np.int32))
            rows = ends
        samples = not all(v.request.params.greedy for v in views)
        sampling = None if samples else SampleInputs(np.tile(GREEDY_PARAMS, (len(batch.logits_index), 1)),
                                                     np.zeros(len(batch.logits_index), np.float32))
        result = self.runner.execute(batch, sampling)
        for view, s, row in zip(views, scheduled, rows, strict=True):
            view.tokens.num_computed_tokens += s.num_tokens
            token = self._sample(view, result.token_ids, result.logits, int(row))
            if token is not None:
                view.tokens.all_token_ids.append(token)
        return self.runner.last_step

    def _sample(self, view: _View, ids: np.ndarray | None, logits: np.ndarray | None, row: int) -> int | None:
        """The view's next proposal from its logits row (None: the row holds NaN or Inf)."""
        vocab = self.model.config.vocab_size
        if ids is not None:
            token = int(ids[row])
            return token if 0 <= token < vocab else None
        assert logits is not None
        x = logits[row]
        if not np.isfinite(x.max()):
            return None
        request = view.request
        if request.params.greedy:
            return int(np.argmax(x))
        proposed = view.tokens.all_token_ids[request.num_tokens:]
        q = sampling_distribution(x, request.params, request.prompt_token_ids,
                                  request.output_token_ids + proposed, request.eos_token_ids)
        view.probs.append(q)
        return draw(q, request.generator)

    def _forget(self, request_id: str) -> None:
        view = self.views.pop(request_id)
        self.blocks.free(view.tokens)
