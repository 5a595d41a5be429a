"""Harmony, gpt-oss's output format: messages on channels, split into reasoning, content and
tool calls, whole or as they stream.

After the prompt's `<|start|>assistant` the model writes messages, each a header, `<|message|>`,
then its body up to `<|end|>` (another message follows, after `<|start|>` and a role) or up to
`<|return|>` / `<|call|>`, which end the turn (they are stop tokens, so they are usually not in
the text: the text's end ends the turn too). The header names the channel and the recipient:

    <|channel|>analysis<|message|>thought<|end|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may also stand before the channel: `assistant to=functions.f<|channel|>commentary
json`, as the chat template writes past calls). `analysis` is reasoning; `final`, and
`commentary` to no one (a preamble to the user), are content; `commentary` to `functions.NAME`
is a call of NAME whose body is its JSON arguments. A message to any other recipient (the
built-in browser and python tools) is dropped. Output with no header at all is content.
A prompt that leaves a message open (continue_final_message: `...<|channel|>final<|message|>The
answer is`) makes the output start in that message's body.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import JSON_WHITESPACE
from vkrt.engine.json_bounds import bound_numbers, close_objects
from vkrt.tokenizer import Tokenizer

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
# The tokens that end the turn: the server stops generation on them.
TURN_ENDS = (RETURN, CALL)
_BODY_ENDS = (END, RETURN, CALL, START)
# A header longer than this with no <|message|> is not a header: the output is plain text.
_MAX_HEADER = 256
# What joins two messages of the same kind (two analysis messages, a preamble and the answer).
SEPARATOR = "\n"

Kind = Literal["reasoning", "content", "call", "dropped"]
_State = Literal["header", "body", "between", "plain", "done"]
# Where a body's end leads (<|return|> and <|call|>: "done"); <|start|> without <|end|> is lenient.
_AFTER_BODY: dict[str, _State] = {END: "between", START: "header"}


def template_speaks_harmony(chat_template: str | None) -> bool:
    """True when the chat template writes harmony's framing (gpt-oss)."""
    return bool(chat_template) and all(marker in (chat_template or "") for marker in (START, CHANNEL, MESSAGE))


def sampling_params(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """`params` for a harmony output: special tokens kept in the text (the markers are special
    tokens, and the parser reads them) and the turn's ends as stop tokens (where the vocabulary
    has them as single tokens; a model's EOS list may lack them)."""
    stops = list(params.stop_token_ids)
    for marker in TURN_ENDS:
        ids = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
        if len(ids) == 1 and ids[0] not in stops:
            stops.append(ids[0])
    return dataclasses.replace(params, skip_special_tokens=False, stop_token_ids=stops)


def open_header(prompt: str | None) -> str | None:
    """The header of the message the prompt leaves open (its body continues in the output), or
    None when the prompt ends between messages or in a header (the generation prompt)."""
    if not prompt:
        return None
    tail = prompt[prompt.rfind(START) + len(START):] if START in prompt else prompt
    cut = tail.find(MESSAGE)
    if cut < 0 or any(marker in tail[cut:] for marker in (END, RETURN, CALL)):
        return None
    return tail[:cut]


def _held(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that may be the beginning of one of `markers`."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-k:]) for marker in markers):
            return k
    return 0


def _header_kind(header: str) -> tuple[Kind, str | None]:
    """What the message whose header is `header` is, and the function it calls."""
    recipient = re.search(r"\bto=([^\s<]+)", header)
    channel = re.search(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)", header)
    if recipient is not None:
        target = recipient.group(1)
        if target.startswith("functions.") and len(target) > len("functions."):
            return "call", target[len("functions."):]
        return "dropped", None
    if channel is not None and channel.group(1) == "analysis":
        return "reasoning", None
    return "content", None


@dataclass
class HarmonyPieces:
    """What one feed settled: reasoning and content text, and call pieces (index, the name when
    the call is new, an arguments fragment)."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, str | None, str]] = field(default_factory=list)


class HarmonyParser:
    """Streamed harmony output, fed as it arrives; each feed returns what it settled. `opened`:
    the header of a message the prompt left open (open_header), whose body the output continues."""

    def __init__(self, opened: str | None = None) -> None:
        self._state: _State = "header"
        self._pending = ""
        self._kind: Kind = "content"
        self._opened: set[str] = set()  # the kinds a message of which has already been sent
        self.calls: list[tuple[str, str]] = []  # (name, arguments as far as they are written) of every call
        self._carried = HarmonyPieces()  # what opening the prompt's message settled: sent with the first feed
        if opened is not None:
            self._open(opened, self._carried)
            self._state = "body"

    def feed(self, text: str, final: bool = False) -> HarmonyPieces:
        """The pieces that `text` (appended to what came before) settles; `final` ends the turn."""
        self._pending += text
        pieces, self._carried = self._carried, HarmonyPieces()
        while self._step(pieces, final):
            pass
        return pieces

    def _step(self, pieces: HarmonyPieces, final: bool) -> bool:
        """Consume what the state can; True when the state changed and there may be more."""
        if self._state == "header":
            cut = self._pending.find(MESSAGE)
            if cut < 0:
                if len(self._pending) > _MAX_HEADER or (final and "<|" not in self._pending):
                    self._state = "plain"
                    return True
                if final:
                    self._state, self._pending = "done", ""
                return False
            self._open(self._pending[:cut], pieces)
            self._pending = self._pending[cut + len(MESSAGE):]
            self._state = "body"
            return True
        if self._state == "body":
            found = [(i, marker) for marker in _BODY_ENDS if (i := self._pending.find(marker)) >= 0]
            if found:
                cut, marker = min(found)
                self._emit(self._pending[:cut], pieces)
                self._pending = self._pending[cut + len(marker):]
                self._state = _AFTER_BODY.get(marker, "done")
                return True
            keep = 0 if final else _held(self._pending, _BODY_ENDS)
            self._emit(self._pending[:len(self._pending) - keep], pieces)
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        if self._state == "between":  # after <|end|>: the next message opens with <|start|>
            cut = self._pending.find(START)
            if cut >= 0:
                self._pending, self._state = self._pending[cut + len(START):], "header"
                return True
            if any(marker in self._pending for marker in TURN_ENDS) or final:
                self._state = "done"
            return False
        if self._state == "plain":
            pieces.content += self._pending
            self._pending = ""
            return False
        self._pending = ""  # done: the turn has ended
        return False

    def _open(self, header: str, pieces: HarmonyPieces) -> None:
        self._kind, name = _header_kind(header)
        if self._kind == "call":
            assert name is not None
            pieces.calls.append((len(self.calls), name, ""))
            self.calls.append((name, ""))
        elif self._kind in self._opened:
            self._add(self._kind, SEPARATOR, pieces)
        self._opened.add(self._kind)

    def _emit(self, body: str, pieces: HarmonyPieces) -> None:
        if not body:
            return
        if self._kind == "call":
            index = len(self.calls) - 1
            pieces.calls.append((index, None, body))
            name, arguments = self.calls[index]
            self.calls[index] = (name, arguments + body)
        elif self._kind in ("reasoning", "content"):
            self._add(self._kind, body, pieces)

    @property
    def thought(self) -> bool:
        """Whether the output so far opened an analysis message."""
        return "reasoning" in self._opened

    @staticmethod
    def _add(kind: Kind, text: str, pieces: HarmonyPieces) -> None:
        if kind == "reasoning":
            pieces.reasoning += text
        else:
            pieces.content += text


def parse(text: str, opened: str | None = None) -> tuple[str | None, str, list[tuple[str, str]]]:
    """(reasoning, None when the output has no analysis message; content; the calls as (name,
    arguments JSON text as written)) of a whole output (`opened`: as for HarmonyParser)."""
    parser = HarmonyParser(opened)
    pieces = parser.feed(text, final=True)
    return (pieces.reasoning if parser.thought else None), pieces.content, parser.calls


def forcing_grammar(tools: list[dict[str, Any]], forced: str, max_digits: int | None) -> str:
    """A Lark grammar (llguidance's; `<|...|>` names a special token) for one call of the forced
    function(s) in harmony's framing, from the generation prompt's `<|start|>assistant` to the
    `<|call|>` that ends the turn, its arguments valid for their schema, strictly (as
    vkrt/server/tools.py's arguments_schema holds them)."""
    lines, names = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if forced not in ("*", function["name"]):
            continue
        parameters = function.get("parameters", {"type": "object"})
        schema = {**bound_numbers(close_objects(parameters), max_digits),
                  "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        names.append(f"call{i}")
        lines.append(f"call{i}: {json.dumps(function['name'] + ' ')} {CONSTRAIN} \"json\" {MESSAGE} "
                     f"%json {json.dumps(schema)}")
    start = f'start: {CHANNEL} "commentary to=functions." ({" | ".join(names)}) {CALL}'
    return "\n".join([start, *lines])
