"""What the ingress hands a replica and what comes back: one HTTP request, its answer in parts.

The ingress reads the client's request whole, computes the prompt's prefix-block hashes (the
router's key) and forwards it; the replica runs it through vkrt's own ASGI app and streams the
answer back as a `ResponseStart` and then body bytes, so every route, error and SSE event is
the single server's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vkrt.engine.kv_cache import hash_block
from vkrt.engine.kv_events import external_hash
from vkrt.tokenizer import Tokenizer

REPLICA_HEADER = "x-vkrt-replica"  # "<node ip>/<pid>" of the replica that answered


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    # The prompt's full blocks as the prefix cache names them (external_hash of hash_block's
    # chain); empty when the ingress could not tell the prompt's tokens.
    block_hashes: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The chained hashes of the full blocks of `token_ids`, as the engine's prefix cache and
    its KV events name them."""
    hashes: list[int] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(external_hash(parent))
    return tuple(hashes)


def prompt_token_ids(path: str, body: bytes, tokenizer: Tokenizer | None) -> list[int] | None:
    """The token ids a completion or chat request will prompt with, as far as the ingress can tell
    without the engine: a completion's ids as sent, its text encoded, a chat rendered with the
    model's template. None when it cannot (another route, a batch of prompts, a bad body: the
    replica answers that one)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if path == "/v1/completions":
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tokenizer is not None:
            return tokenizer.encode(prompt, add_special_tokens=request.get("add_special_tokens", True) is not False)
        return None
    if path == "/v1/chat/completions" and tokenizer is not None:
        return _chat_ids(request.get("messages"), tokenizer)
    return None


def _chat_ids(messages: Any, tokenizer: Tokenizer) -> list[int] | None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception:  # any template failure only costs the prefix preference
        return None
    return tokenizer.encode(text, add_special_tokens=False)
