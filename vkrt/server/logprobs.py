"""Engine logprobs -> the OpenAI wire formats of /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import math
from typing import Any

from vkrt.engine.request import Logprob, TokenLogprobs
from vkrt.tokenizer import Tokenizer

# JSON has no -inf; vLLM sends this floor for tokens the model rules out entirely.
_LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def _text(tokenizer: Tokenizer | None, logprob: Logprob, as_ids: bool = False) -> str:
    if as_ids:  # vLLM's return_tokens_as_token_ids: every token by its id, even half a character
        return _id_name(logprob.token_id)
    if logprob.text:
        return logprob.text
    # Without a tokenizer, name the id the way return_tokens_as_token_ids does.
    return tokenizer.token_text(logprob.token_id) if tokenizer is not None else _id_name(logprob.token_id)


def _id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def completion_logprobs(tokenizer: Tokenizer | None, positions: list[TokenLogprobs], text_offset: int,
                        as_ids: bool = False) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets continue from `text_offset`;
    `as_ids` names the tokens "token_id:<id>"."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for position in positions:
        text = _text(tokenizer, position.token, as_ids)
        tokens.append(text)
        token_logprobs.append(_finite(position.token.logprob))
        top = {_text(tokenizer, alt, as_ids): _finite(alt.logprob) for alt in position.top}
        top.setdefault(text, _finite(position.token.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def echo_logprobs(tokenizer: Tokenizer | None, prompt_token_ids: list[int],
                  positions: list[TokenLogprobs | None], as_ids: bool = False) -> dict[str, Any]:
    """The prompt's tokens in completion-logprobs form, for `echo` with `logprobs`, as vLLM
    sends them: a position the model did not score (the first) has null logprob and top_logprobs."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, position in zip(prompt_token_ids, positions, strict=True):
        if position is None:
            text = tokenizer.token_text(token_id) if tokenizer is not None and not as_ids else _id_name(token_id)
            entry: dict[str, list[Any]] = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None],
                                           "text_offset": [offset]}
        else:
            entry = completion_logprobs(tokenizer, [position], offset, as_ids)
        for key, values in entry.items():
            out[key] += values
        offset += len(entry["tokens"][0])
    return out


def joined_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two completion-logprobs objects one after the other (`then`'s offsets already continue)."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}


def logprobs_text_length(logprobs: dict[str, Any]) -> int:
    """The characters a completion-logprobs object's tokens cover (where the next offset starts)."""
    return sum(len(token) for token in logprobs["tokens"])


def _chat_entry(tokenizer: Tokenizer | None, logprob: Logprob, as_ids: bool) -> dict[str, Any]:
    return {"token": _text(tokenizer, logprob, as_ids), "logprob": _finite(logprob.logprob),
            "bytes": list(tokenizer.token_bytes(logprob.token_id)) if tokenizer is not None else None}


def chat_logprobs(tokenizer: Tokenizer | None, positions: list[TokenLogprobs], as_ids: bool = False) -> dict[str, Any]:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}; `as_ids`
    names the tokens "token_id:<id>" (`bytes` stay the token's own)."""
    content = []
    for position in positions:
        entry = _chat_entry(tokenizer, position.token, as_ids)
        entry["top_logprobs"] = [_chat_entry(tokenizer, alt, as_ids) for alt in position.top]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_json(tokenizer: Tokenizer | None,
                         positions: list[TokenLogprobs | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token_id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    out: list[dict[str, Any] | None] = []
    for position in positions:
        if position is None:
            out.append(None)
            continue
        entries = {}
        for lp in [position.token, *position.top]:
            entries[str(lp.token_id)] = {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                         "decoded_token": _text(tokenizer, lp)}
        out.append(entries)
    return out
