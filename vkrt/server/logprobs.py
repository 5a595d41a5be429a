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


def _text(tokenizer: Tokenizer | None, logprob: Logprob) -> str:
    if logprob.text:
        return logprob.text
    # Without a tokenizer, name the id the way vLLM's return_tokens_as_token_ids does.
    return tokenizer.token_text(logprob.token_id) if tokenizer is not None else f"token_id:{logprob.token_id}"


def completion_logprobs(tokenizer: Tokenizer | None, positions: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets continue from `text_offset`."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for position in positions:
        text = _text(tokenizer, position.token)
        tokens.append(text)
        token_logprobs.append(_finite(position.token.logprob))
        top = {_text(tokenizer, alt): _finite(alt.logprob) for alt in position.top}
        top.setdefault(text, _finite(position.token.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_entry(tokenizer: Tokenizer | None, logprob: Logprob) -> dict[str, Any]:
    return {"token": _text(tokenizer, logprob), "logprob": _finite(logprob.logprob),
            "bytes": list(tokenizer.token_bytes(logprob.token_id)) if tokenizer is not None else None}


def chat_logprobs(tokenizer: Tokenizer | None, positions: list[TokenLogprobs]) -> dict[str, Any]:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for position in positions:
        entry = _chat_entry(tokenizer, position.token)
        entry["top_logprobs"] = [_chat_entry(tokenizer, alt) for alt in position.top]
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
