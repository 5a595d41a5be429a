"""Output processing: detokenize new tokens, decide when a request stops, build RequestOutputs.

Stop strings may straddle token boundaries, so text that could still be the start of a stop
string is held back from the stream until the next token settles it, and the final text is
cut at the stop string (kept only with include_stop_str_in_output). The checks follow
vLLM's `check_stop`: nothing but length can end a request before min_tokens; EOS (unless
ignore_eos) and stop_token_ids end it without adding their text.

Each request's outputs take the shape of its RequestOutputKind: a DELTA output holds only
what its step added and a FINAL_ONLY request gets one output at the end, so neither copies
the history on every step; only CUMULATIVE outputs do.
"""

from __future__ import annotations

import dataclasses

from vkrt.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    TokenLogprobs,
)
from vkrt.tokenizer import IncrementalDetokenizer, Tokenizer


class _TextState:
    """The detokenized text of one request: settled pieces, which no stop string can cut any
    more, and the held-back tail, the longest end of the text that may start a stop string."""

    def __init__(self, tokenizer: Tokenizer | None, request: Request) -> None:
        params = request.params
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.stop_strings = params.stop_strings
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.include_stop = params.include_stop_str_in_output
        self.settled: list[str] = []  # in the pieces they settled in (appending never copies the text)
        self.tail = ""
        self.num_taken = 0  # settled pieces a DELTA output already carried
        self.num_sent_tokens = 0
        self.sent_prompt_logprobs = False

    def append(self, token_id: int, check_stop_strings: bool) -> str | None:
        """Add one token's text; the stop string it completes, if any (the text is then cut)."""
        if self.detokenizer is None:
            return None
        new_text = self.detokenizer.add(token_id)
        if not new_text:
            return None
        # A stop string that ends in the new text starts inside the tail or the new text: had
        # it started earlier, the text before this token would end in a longer prefix of it
        # than the tail, which is the longest such end.
        window = self.tail + new_text
        if check_stop_strings and self.stop_strings:
            found: tuple[int, str] | None = None
            for stop in self.stop_strings:  # only a match that ends in the new text is new; earliest wins
                index = window.find(stop, max(0, len(self.tail) - len(stop) + 1))
                if index >= 0 and (found is None or index < found[0]):
                    found = (index, stop)
            if found is not None:
                index, stop = found
                self.tail = window[: index + len(stop) if self.include_stop else index]
                return stop
        held = self._held_back(window)
        if held < len(window):
            self.settled.append(window[: len(window) - held])
        self.tail = window[len(window) - held:]
        return None

    def _held_back(self, text: str) -> int:
        """How many characters at the end of `text` may start a stop string."""
        for k in range(min(len(text), self.longest - 1), 0, -1):
            suffix = text[-k:]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return k
        return 0

    def finish(self) -> None:
        """The request ended: its held-back tail is final text too."""
        if self.tail:
            self.settled.append(self.tail)
            self.tail = ""

    def text(self) -> str:
        """All the text that may be streamed now."""
        return "".join(self.settled)

    def take_delta(self) -> str:
        """The settled text no DELTA output has carried yet."""
        delta = "".join(self.settled[self.num_taken:])
        self.num_taken = len(self.settled)
        return delta


class OutputProcessor:
    """Per-request text state, stop decisions and the RequestOutputs handed back."""

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

    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's update after this step, shaped by its output kind; None for a
        FINAL_ONLY request that has not finished."""
        state = self._states[request.request_id]
        finished = request.is_finished
        kind = request.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished:
            state.finish()
        first_new, state.num_sent_tokens = state.num_sent_tokens, request.num_output_tokens
        if kind is RequestOutputKind.DELTA:
            text = state.take_delta()
            token_ids = request.output_token_ids[first_new:]
            logprobs = None if request.logprobs is None else request.logprobs[first_new:]
            # Complete by the first output: every prompt position is scored before the first token.
            prompt_logprobs = None
            if not state.sent_prompt_logprobs and request.prompt_logprobs is not None:
                prompt_logprobs = list(request.prompt_logprobs)
            state.sent_prompt_logprobs = True
        else:
            text = state.text()
            token_ids = list(request.output_token_ids)
            logprobs = None if request.logprobs is None else list(request.logprobs)
            prompt_logprobs = None if request.prompt_logprobs is None else list(request.prompt_logprobs)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error=request.error,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            metrics=dataclasses.replace(request.metrics),
        )
