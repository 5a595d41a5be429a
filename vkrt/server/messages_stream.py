"""The Messages API's stream: chat.py's per-choice deltas (reasoning, content, tool-call
fragments) rewritten as Anthropic's named SSE events, in the order the anthropic SDK's
stream helpers accumulate them: message_start, ping, then per content block
content_block_start / content_block_delta... / content_block_stop, then message_delta
(stop_reason, usage) and message_stop. An error after the headers is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from vkrt.server.chat import ChoiceStream, StartedChat
from vkrt.server.choices import merged_updates
from vkrt.server.errors import anthropic_error_body
from vkrt.server.generation import Result, ServerState, raise_if_failed
from vkrt.server.protocol import ChatCompletionRequest


def stop_of(result: Result, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation; `called`: its output holds tool calls."""
    raise_if_failed(result)
    if result.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One event, named by its payload's type as Anthropic's stream names them."""
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


def sse_error(status: int, message: str, param: str | None, code: str | None) -> bytes:
    return sse_event(anthropic_error_body(status, message))


class _Blocks:
    """The content blocks of the reply as they open and close: one is open at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.open_kind: str | None = None  # "thinking", "text", or "tool_use"
        self.call_blocks: dict[int, int] = {}  # tool-call index -> its block index

    def start(self, kind: str, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self.stop()
        self.open_kind = kind
        yield sse_event({"type": "content_block_start", "index": self.count, "content_block": block})

    def stop(self) -> Iterator[bytes]:
        if self.open_kind is not None:
            yield sse_event({"type": "content_block_stop", "index": self.count})
            self.open_kind = None
            self.count += 1

    def delta(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        at = self.count if index is None else index
        return sse_event({"type": "content_block_delta", "index": at, "delta": delta})

    def text(self, kind: str, text: str) -> Iterator[bytes]:
        """A thinking or text piece, in the open block of its kind (opened when needed)."""
        if self.open_kind != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            yield from self.start(kind, empty)
        yield self.delta({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                         else {"type": "text_delta", "text": text})

    def call(self, call: dict[str, Any]) -> Iterator[bytes]:
        """An OpenAI tool_calls delta entry: a new call opens a tool_use block."""
        function = call.get("function", {})
        if "id" in call:
            yield from self.start("tool_use", {"type": "tool_use", "id": tool_use_id(),
                                               "name": function.get("name", ""), "input": {}})
            self.call_blocks[call["index"]] = self.count
        arguments = function.get("arguments")
        if arguments and call["index"] in self.call_blocks:
            yield self.delta({"type": "input_json_delta", "partial_json": arguments},
                             self.call_blocks[call["index"]])


async def message_events(state: ServerState, run: StartedChat, chat: ChatCompletionRequest,
                         message_id: str) -> AsyncIterator[bytes]:
    """The whole event stream of one message."""
    [[generation]] = run.candidates.groups
    result = generation.result
    yield sse_event({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "content": [], "model": state.model_name,
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(result.prompt_token_ids), "output_tokens": 0}}})
    yield sse_event({"type": "ping"})
    stream = ChoiceStream(run.engine.tokenizer, run.reading, chat.tools)
    blocks = _Blocks()
    async for _, update in merged_updates(run.candidates.groups):
        for delta, _logprobs, _finish in stream.deltas(update):
            if delta.get("reasoning_content"):
                for event in blocks.text("thinking", delta["reasoning_content"]):
                    yield event
            if delta.get("content"):
                for event in blocks.text("text", delta["content"]):
                    yield event
            for call in delta.get("tool_calls", ()):
                for event in blocks.call(call):
                    yield event
    for event in blocks.stop():
        yield event
    stop_reason, stop_sequence = stop_of(generation.result, stream.called)
    yield sse_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     "usage": {"output_tokens": len(generation.result.token_ids)}})
    yield sse_event({"type": "message_stop"})
