"""POST /v1/responses with stream=true: the chat route's deltas as Responses API events.

chat.ChoiceStream splits the output into reasoning, content and tool-call deltas, as for a
streamed chat completion; `_Events` turns them into the event sequence the openai SDK's
stream accumulator follows: each output item added, its deltas, then its done events before
the next item opens, and response.completed (or response.incomplete) with the whole object,
which is what the non-streamed route would have answered.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from vkrt.server.chat import ChoiceStream, StartedChat
from vkrt.server.choices import merged_updates
from vkrt.server.generation import raise_if_failed
from vkrt.server.responses_items import (
    call_item,
    finished,
    item_id,
    message_item,
    reasoning_item,
    reasoning_tokens,
)
from vkrt.server.responses_protocol import ResponsesRequest
from vkrt.tokenizer import Tokenizer


class _Open:
    """The output item being written: its kind, index, id and text (or arguments) so far."""

    def __init__(self, kind: str, index: int, item: str, call_id: str = "", name: str = "") -> None:
        self.kind, self.index, self.item = kind, index, item
        self.call_id, self.name = call_id, name
        self.text = ""


class _Events:
    """Builds the events, numbering them, and the output items as they close."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.calls: dict[int, _Open] = {}  # tool call delta index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, ensure_ascii=False, allow_nan=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _start(self, item: _Open, added: dict[str, Any]) -> Iterator[bytes]:
        yield from self.close(True)
        self.open = item
        yield self.event("response.output_item.added", output_index=item.index, item=added)

    def text(self, kind: str, piece: str) -> Iterator[bytes]:
        """A piece of reasoning ("reasoning") or content ("message"), opening its item first."""
        if self.open is None or self.open.kind != kind:
            yield from self.close(True)  # first: the new item's index counts the closed one
            item = _Open(kind, len(self.items), item_id("rs" if kind == "reasoning" else "msg"))
            shell = (reasoning_item("", False, item.item) if kind == "reasoning"
                     else message_item("", False, item.item))
            yield from self._start(item, {**shell, "status": "in_progress", "content": []})
            yield self.event("response.content_part.added", item_id=item.item, output_index=item.index,
                             content_index=0, part=self._part(kind, ""))
        assert self.open is not None
        self.open.text += piece
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        yield self.event(delta_type, item_id=self.open.item, output_index=self.open.index, content_index=0,
                         delta=piece, **extra)

    def call(self, delta: dict[str, Any]) -> Iterator[bytes]:
        """One tool_calls delta entry: a new call announced, or more of a call's arguments."""
        function = delta.get("function", {})
        if "id" in delta:
            yield from self.close(True)
            item = _Open("call", len(self.items), item_id("fc"), delta["id"], function.get("name", ""))
            self.calls[delta["index"]] = item
            shell = call_item(item.call_id, item.name, "", False, item.item)
            yield from self._start(item, {**shell, "status": "in_progress"})
        item = self.calls[delta["index"]]
        arguments = function.get("arguments", "")
        if arguments and item is self.open:  # a late fragment of a closed call cannot happen
            item.text += arguments
            yield self.event("response.function_call_arguments.delta", item_id=item.item,
                             output_index=item.index, delta=arguments)

    def wrote_message(self) -> bool:
        open_message = self.open is not None and self.open.kind == "message"
        return open_message or any(item["type"] == "message" for item in self.items)

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def close(self, complete: bool) -> Iterator[bytes]:
        """The done events of the open item, which joins the output."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item.item, "output_index": item.index}
        if item.kind == "call":
            done = call_item(item.call_id, item.name, item.text, complete, item.item)
            yield self.event("response.function_call_arguments.done", **where, arguments=item.text)
        else:
            reasoning = item.kind == "reasoning"
            done = (reasoning_item(item.text, complete, item.item) if reasoning
                    else message_item(item.text, complete, item.item))
            text_done = "response.reasoning_text.done" if reasoning else "response.output_text.done"
            extra: dict[str, Any] = {} if reasoning else {"logprobs": []}
            yield self.event(text_done, **where, content_index=0, text=item.text, **extra)
            yield self.event("response.content_part.done", **where, content_index=0,
                             part=self._part(item.kind, item.text))
        self.items.append(done)
        yield self.event("response.output_item.done", output_index=item.index, item=done)


async def response_events(started: StartedChat, body: ResponsesRequest, base: dict[str, Any],
                          tokenizer: Tokenizer | None) -> AsyncIterator[bytes]:
    """The whole event stream of one response."""
    events = _Events()
    shell = {**base, "status": "in_progress", "output": [], "usage": None}
    yield events.event("response.created", response=shell)
    yield events.event("response.in_progress", response=shell)
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"})} for tool in body.tools or []]
    stream = ChoiceStream(tokenizer, started.reading, tools or None)
    finish: str | None = None
    reasoning = ""
    async for _, update in merged_updates(started.candidates.groups):
        for delta, _logprobs, finish_reason in stream.deltas(update):
            finish = finish_reason or finish
            if delta.get("reasoning_content"):
                reasoning += delta["reasoning_content"]
                for chunk in events.text("reasoning", delta["reasoning_content"]):
                    yield chunk
            if delta.get("content"):
                for chunk in events.text("message", delta["content"]):
                    yield chunk
            for call in delta.get("tool_calls") or []:
                for chunk in events.call(call):
                    yield chunk
    results = [generation.result for generation in started.candidates.groups[0]]
    for result in results:
        raise_if_failed(result)
    complete = finish != "length"
    if not events.calls and not events.wrote_message():
        for chunk in events.text("message", ""):  # a message, even empty, as the non-streamed answer has
            yield chunk
    for chunk in events.close(complete):
        yield chunk
    final = finished(base, events.items, complete, results, reasoning_tokens(tokenizer, reasoning))
    yield events.event("response.completed" if complete else "response.incomplete", response=final)
