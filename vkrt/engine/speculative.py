"""Speculative decoding: proposals for the next tokens, verified by the target in one step.

A speculating request runs its last token and k proposed tokens in one forward (a T = k + 1
decode step, replayed like any other). Row i of that step holds the target's distribution
after the request's tokens and the first i proposals; the engine samples row i as it would
sample a plain decode step and emits the token, going on to row i + 1 only while the sampled
token equals proposal i. So every emitted token is a sample of the target's distribution given
exactly the tokens before it: greedy output equals plain decoding, and with temperature > 0
this is standard rejection sampling for a proposal that puts all its mass on one token
(accept with min(1, p(d) / 1) = p(d), else resample from the residual p restricted to the
other tokens, which is what a draw from p that missed d is). The KV entries of rejected
proposals are never read (attention is causal by position) and are overwritten when those
positions are computed again; the request's count of computed tokens is what rolls back.

Methods (vLLM's `--speculative-config` keys): "ngram" (prompt lookup in the request's own
tokens) and "draft_model" (`"model": PATH_OR_NAME`: a small model with the target's vocabulary
proposes by decoding k tokens itself, vkrt/engine/draft.py). A draft that samples proposes
from a distribution q rather than one token, so its rows are verified by the general rule
instead: accept d with min(1, p(d) / q(d)), else resample from max(0, p - q) normalised
(`rejection_sample`). A structured-output request's proposals are cut where its grammar
stops accepting them and each verify row is masked as its plain step would be
(vkrt/engine/guided.py). "mtp" drafts with the target checkpoint's own multi-token-prediction
head (vkrt/engine/mtp_draft.py): greedy guesses from the target's hidden states, verified as
n-gram proposals are. A hybrid's recurrent state runs on through the proposals, so a
verify step first copies the state it starts from into the sequence's checkpoint slot, and a
rejection sends the request back to it: its next step recomputes the tokens since (the
scheduler attaches no proposals to that chunk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkrt.engine.json_flag import json_object
from vkrt.errors import VkrtError

# vkrt's defaults where the config leaves them out (a missing min takes 2, a missing max 4;
# one given alone bounds the other).
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2
MAX_SPECULATIVE_TOKENS = 32  # k per step; more only makes a longer verify step for rare gains

_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What `--speculative-config` asked for, validated."""

    method: str  # "ngram" | "draft_model" | "mtp"
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    model: str | None = None  # "draft_model": the draft's path or pulled name

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """From a JSON object (the CLI flag's text) or a dict; None for None or an empty string.
        VkrtError says what is wrong."""
        value = json_object(value, "--speculative-config", _KEYS, '{"method": "ngram", "num_speculative_tokens": 4}')
        if value is None:
            return None
        method = value.get("method")
        if method is None and "model" in value:
            method = "draft_model"
        if method in ("eagle", "eagle3", "medusa", "mlp_speculator"):
            raise VkrtError(f"--speculative-config: method {method!r} is not supported yet; "
                            'use {"method": "ngram", ...} (prompt lookup) or {"model": DRAFT, ...} (a draft model)')
        if method not in ("ngram", "draft_model", "mtp"):
            raise VkrtError(f"--speculative-config: method must be \"ngram\", \"draft_model\" or \"mtp\", "
                            f"got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise VkrtError(f"--speculative-config: num_speculative_tokens must be an integer in "
                            f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if method == "draft_model":
            return cls._draft(value, k)
        if method == "mtp":
            extra = sorted(key for key in value if key not in ("method", "num_speculative_tokens"))
            if extra:
                raise VkrtError(f"--speculative-config: method \"mtp\" drafts with the model's own "
                                f"multi-token-prediction head; it takes no {', '.join(extra)}")
            return cls("mtp", k)
        if "model" in value:
            raise VkrtError('--speculative-config: "model" names a draft model; method "ngram" takes none')
        lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        for name, n in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise VkrtError(f"--speculative-config: {name} must be an integer >= 1, got {n!r}")
        if lookup_max is None:
            lookup_max = max(DEFAULT_LOOKUP_MAX, lookup_min or 0)
        if lookup_min is None:
            lookup_min = min(DEFAULT_LOOKUP_MIN, lookup_max)
        if lookup_min > lookup_max:
            raise VkrtError(f"--speculative-config: prompt_lookup_min ({lookup_min}) exceeds "
                            f"prompt_lookup_max ({lookup_max})")
        return cls("ngram", k, lookup_max, lookup_min)

    @classmethod
    def _draft(cls, value: Mapping[str, Any], k: int) -> SpeculativeConfig:
        model = value.get("model")
        if not isinstance(model, str) or not model.strip():
            raise VkrtError('--speculative-config: method "draft_model" needs "model": a GGUF file, a Hugging Face '
                            f"model directory or a pulled model's name, got {model!r}")
        lookup = sorted(key for key in value if key.startswith("prompt_lookup"))
        if lookup:
            raise VkrtError(f"--speculative-config: {', '.join(lookup)} belong to method \"ngram\", not to a draft model")
        return cls("draft_model", k, model=model)

    def describe(self) -> str:
        if self.method == "draft_model":
            return f"draft model {self.model}, {self.num_speculative_tokens} tokens"
        if self.method == "mtp":
            return f"the model's MTP head, {self.num_speculative_tokens} tokens"
        return (f"ngram, {self.num_speculative_tokens} tokens, lookup "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}")


def ngram_proposal(token_ids: Sequence[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    of `token_ids` (lookup_max >= n >= lookup_min), continuing periodically past the end;
    [] when no suffix recurs."""
    length = len(token_ids)
    if k < 1 or length < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n:]
        # Candidate starts s < length - n whose n tokens equal the suffix: filter on the first
        # token, then check the rest (cheap: most positions fail the first compare).
        starts = np.flatnonzero(tokens[:length - n] == suffix[0])
        for offset in range(1, n):
            starts = starts[tokens[starts + offset] == suffix[offset]]
        if starts.size:
            follow = int(starts[-1]) + n  # the latest occurrence: the most local context
            proposal = [int(t) for t in tokens[follow:follow + k]]
            # A match close to the end runs out of tokens: copy on from the proposal itself
            # (a repeating run goes on repeating), as an LZ77 copy overlaps its output.
            while len(proposal) < k:
                proposal.append(proposal[len(proposal) - (length - follow)])
            return proposal
    return []


def draw(weights: np.ndarray, generator: np.random.Generator) -> int:
    """One token drawn from unnormalised `weights` (>= 0, some > 0) by inverse CDF, one draw."""
    cdf = np.cumsum(weights, dtype=np.float64)
    return int(min(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"), cdf.shape[0] - 1))


def rejection_sample(p: np.ndarray, q: np.ndarray, draft: int, generator: np.random.Generator) -> int:
    """The token a verify row emits when the draft sampled `draft` from q and the target's
    distribution is p (both normalised): `draft` with probability min(1, p(d) / q(d)), else a
    draw from max(0, p - q) normalised, so the token is distributed as p."""
    if generator.random() * q[draft] < p[draft]:
        return draft
    residual = np.maximum(p - q, 0.0)
    if not residual.sum() > 0.0:  # p equals q up to rounding: a rejection had probability ~0
        residual = p
    return draw(residual, generator)


# After a verify step that accepts nothing, a request waits 1, 2, 4, ... up to this many
# steps before proposing again (any acceptance ends the wait): on llvmpipe a verify step of
# 1 + k rows costs 1.7-2.5x a plain step, so text that does not repeat its input must not pay
# that on every token.
MAX_BACKOFF = 16


def backoff_after(backoff: int, accepted: int) -> int:
    """The steps to wait before the next proposal, given the last wait and this step's acceptances."""
    return 0 if accepted else min(max(1, 2 * backoff), MAX_BACKOFF)


def proposal_length(proposed: int, accepted: int, most: int) -> int:
    """How many tokens a request proposes in its next step (1 .. `most`) after a verify step that
    accepted `accepted` of its `proposed`: after a full acceptance 2 * proposed + 1, after a
    rejection the smallest 2^n - 1 above the accepted ones. A verify step of 2^n rows is a whole
    token tile of the matmul kernels (on llvmpipe 5 rows cost what 8 do, and each tile costs more
    than the last), so lengths of 2^n - 1 waste no rows, and a request whose proposals keep failing
    pays for a short step."""
    wanted = 2 * proposed + 1 if accepted == proposed else (1 << (accepted + 1).bit_length()) - 1
    return max(1, min(most, wanted))


@dataclass
class SpecStats:
    """Speculation counters (vLLM's spec_decode metrics): one draft per request per verify step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos))

    def add(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted proposals plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_pos),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}
