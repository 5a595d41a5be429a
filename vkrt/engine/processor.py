"""The engine's edge: a prompt and its SamplingParams checked once and made into a Request.

Everything the engine would refuse is refused here, before anything is queued, with a
RequestError naming the parameter: an empty prompt, ids outside the vocabulary, a bad
parameter, a prompt that leaves no room in the context, `max_tokens` that would run past it
(code `context_length_exceeded`), a grammar llguidance cannot compile. Deeper code (the
scheduler, the sampler, the output processor) trusts the Request it gets.

`make_request` is safe to call from any thread (the server calls it on its worker pool, so
a new schema compiles there, not on the event loop or the engine thread): it reads only
the engine's fixed sizes, the grammar cache (which locks) and a locked seed generator.
"""

from __future__ import annotations

import threading

import numpy as np

from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import GrammarCompiler
from vkrt.engine.pooling import PooledRows, PoolingParams
from vkrt.engine.request import Request, RequestOutputKind
from vkrt.errors import RequestError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestProcessor:
    """Validates requests against one engine's vocabulary and context length."""

    def __init__(self, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...],
                 grammars: GrammarCompiler, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._seed_rng = np.random.default_rng(seed)  # seeds for requests without one
        self._seed_lock = threading.Lock()

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                     prompt: str | None = None,
                     output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> Request:
        """A Request ready to queue; RequestError for a bad prompt, parameter or grammar."""
        self.check_prompt(prompt_token_ids)
        params.validate(self.vocab_size)
        self.check_context(len(prompt_token_ids), params.max_tokens)
        # Compiled (or copied from the cache) once, here.
        guide = self.grammars.compile(params.guided_decoding) if params.guided_decoding is not None else None
        # Drawn only for a request that passed, so a refused one does not shift the seeds of the rest.
        with self._seed_lock:
            generator_seed = int(self._seed_rng.integers(2**63))
        request = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids, prompt=prompt,
                          generator_seed=generator_seed, output_kind=output_kind)
        request.guide = guide
        return request

    def make_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> Request:
        """A pooling Request (its prompt may fill the whole context: nothing is generated)."""
        params.validate()
        self.check_prompt(prompt_token_ids, room=0)
        request = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=1),
                          eos_token_ids=self.eos_token_ids, output_kind=RequestOutputKind.FINAL_ONLY)
        request.pooling = params
        request.pooled = PooledRows(params, len(prompt_token_ids))
        return request

    def check_prompt(self, prompt_token_ids: list[int], room: int = 1) -> None:
        """RequestError unless the prompt is non-empty, in the vocabulary, and leaves `room` tokens of context."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty; send at least one token", param="prompt")
        if len(prompt_token_ids) + room > self.max_model_len:
            leaves = ", leaving no room to generate" if room else ""
            raise RequestError(
                f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens, but the "
                f"prompt has {len(prompt_token_ids)}{leaves}; shorten the prompt",
                param="prompt", code=CONTEXT_LENGTH_EXCEEDED, details=self._context(len(prompt_token_ids)))
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """The prompt and all `max_tokens` must fit the context (None: until it is full)."""
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you asked for "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} to "
                "generate); lower max_tokens", param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED,
                details=self._context(num_prompt_tokens))

    def _context(self, num_prompt_tokens: int) -> dict[str, int]:
        """What a context-length refusal tells the client, in llama-server's names."""
        return {"n_prompt_tokens": num_prompt_tokens, "n_ctx": self.max_model_len}
