"""Output processing: detokenize new tokens, decide when a request stops, build RequestOutputs.

Stop strings may straddle token boundaries, so text that could still be the start of a stop
string is held back from the stream until the next token settles it, and the final text is
cut at the stop string (kept only with include_stop_str_in_output). The checks follow
vLLM's `check_stop`: nothing but length can end a request before min_tokens; EOS (unless
ignore_eos) and stop_token_ids end it without adding their text.
"""

from __future__ import annotations

import dataclasses

from vkrt.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    TokenLogprobs,
)
from vkrt.tokenizer import IncrementalDetokenizer, Tokenizer


class _TextState:
    """The detokenized text of one request and how much of it has been streamed."""

    def __init__(self, tokenizer: Tokenizer | None, request: Request) -> None:
        params = request.params
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.text = ""
        self.num_sent = 0
        self.num_sent_tokens = 0

    def append(self, token_id: int, check_stop_strings: bool) -> str | None:
        """Add one token's text; the stop string it completes, if any (text is then cut)."""
        if self.detokenizer is None:
            return None
        new_text = self.detokenizer.add(token_id)
        if not new_text:
            return None
        prev_len = len(self.text)
        self.text += new_text
        if not (check_stop_strings and self.stop_strings):
            return None
        longest = max(len(s) for s in self.stop_strings)
        # Only a match that ends inside the new text is new; earliest match wins.
        search_from = max(0, prev_len - longest + 1)
        found: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = self.text.find(stop, search_from)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text that can be streamed now: all of it once finished, else minus a possible stop prefix."""
        end = len(self.text)
        if not finished:
            end -= self._held_back()
        end = max(end, self.num_sent)
        delta = self.text[self.num_sent:end]
        self.num_sent = end
        return delta

    def _held_back(self) -> int:
        for k in range(min(len(self.text), max((len(s) for s in self.stop_strings), default=1) - 1), 0, -1):
            suffix = self.text[-k:]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return k
        return 0


class OutputProcessor:
    """Per-request text state, stop decisions and RequestOutput snapshots."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._states: dict[str, _TextState] = {}

    def add(self, request: Request) -> None:
        self._states[request.request_id] = _TextState(self.tokenizer, request)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def append_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> RequestStatus | None:
        """Record a sampled token; the finished status it causes, if any."""
        request.append_output_token(token_id)
        if logprobs is not None and request.logprobs is not None:
            self.fill_text(logprobs)
            request.logprobs.append(logprobs)
        params = request.params
        state = self._states[request.request_id]
        may_stop = request.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            if params.include_stop_str_in_output:
                state.append(token_id, check_stop_strings=False)
            return RequestStatus.FINISHED_STOPPED
        stop = state.append(token_id, check_stop_strings=may_stop)
        if stop is not None:
            request.stop_reason = stop
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fill_text(self, entry: TokenLogprobs | None) -> None:
        """Attach each logprob's token text (needs a tokenizer; otherwise left empty)."""
        if entry is None or self.tokenizer is None:
            return
        for logprob in (entry.token, *entry.top, *entry.scored):
            logprob.text = self.tokenizer.token_text(logprob.token_id)

    def make_output(self, request: Request) -> RequestOutput:
        """A snapshot of the request with everything new since the previous snapshot."""
        state = self._states[request.request_id]
        finished = request.is_finished
        delta_text = state.take_delta(finished)
        delta_ids = request.output_token_ids[state.num_sent_tokens:]
        state.num_sent_tokens = request.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=state.text[:state.num_sent],
            token_ids=list(request.output_token_ids),
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            metrics=dataclasses.replace(request.metrics),
        )
