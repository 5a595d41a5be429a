"""The output items and the final object of a /v1/responses answer, streamed or not."""

from __future__ import annotations

import uuid
from typing import Any

from vkrt.server.generation import Result
from vkrt.server.responses import combined_usage
from vkrt.tokenizer import Tokenizer


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, complete: bool, item: str | None = None) -> dict[str, Any]:
    return {"id": item or item_id("msg"), "type": "message", "role": "assistant",
            "status": "completed" if complete else "incomplete",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, complete: bool, item: str | None = None) -> dict[str, Any]:
    return {"id": item or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed" if complete else "incomplete"}


def reasoning_item(text: str, complete: bool, item: str | None = None) -> dict[str, Any]:
    return {"id": item or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed" if complete else "incomplete"}


def finished(base: dict[str, Any], items: list[dict[str, Any]], complete: bool, results: list[Result],
             thought_tokens: int) -> dict[str, Any]:
    """The final response object: output, status and usage."""
    usage = combined_usage([results])
    return {**base, "status": "completed" if complete else "incomplete", "output": items,
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": thought_tokens},
                      "total_tokens": usage["total_tokens"]}}


def reasoning_tokens(tokenizer: Tokenizer | None, reasoning: str | None) -> int:
    """The thought's token count (re-encoded: the output's ids are not split by the parser)."""
    if not reasoning or tokenizer is None:
        return 0
    return len(tokenizer.encode(reasoning, add_special_tokens=False))
