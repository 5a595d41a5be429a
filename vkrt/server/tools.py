"""Tool calling: the request's tools checked, the forcing grammar for tool_choice
"required" or a named function, and parsers from model output to OpenAI `tool_calls`.

Each parser knows one model family's call syntax: "hermes" (Hermes, Qwen 2.5/3:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), "llama3_json" (Llama 3.x:
a bare `{"name": ..., "parameters": {...}}`), "mistral" (`[TOOL_CALLS][{"name": ...,
"arguments": {...}}]`), "qwen3_xml" (Qwen3.5, Qwen3-Coder) and "seed_oss" (Seed-OSS): an XML
block per argument (vkrt/server/tool_xml.py). gpt-oss's "harmony" calls are messages on a
channel, read with the rest of its output by vkrt/server/harmony.py. The forcing grammar writes the same syntax, so a
forced call always parses.
A call's `arguments` is the model's own JSON text of the arguments value (not re-encoded), so
the argument fragments streamed as they are generated join to exactly the non-streamed text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vkrt.engine.guided import JSON_WHITESPACE, GuidedDecoding
from vkrt.engine.json_bounds import DEFAULT_MAX_DIGITS, bound_numbers, close_objects
from vkrt.server import harmony, tool_xml
from vkrt.server.errors import APIError, shown

# What decoding a model's JSON may raise: malformed text, or nesting deeper than json's stack ("[[[[...").
UNDECODABLE = (json.JSONDecodeError, RecursionError)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": new_call_id(), "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> str | None:
    """400 for malformed tools or tool_choice; the forced function's name, "*" for any, else None."""
    if tool_choice is not None and not tools:
        raise _bad("tool_choice", "needs tools")
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise _bad(f"tools.{i}", "each tool must be {\"type\": \"function\", \"function\": {...}}")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise _bad(f"tools.{i}.function.name", f"must be 1-64 letters, digits, _ . or -, got {shown(name)}")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise _bad(f"tools.{i}.function.parameters", "must be a JSON schema of type object")
        _check_schema(parameters, f"tools.{i}.function.parameters")
        names.append(name)
    if tool_choice is None or tool_choice == "auto" or tool_choice == "none":
        return None
    if tool_choice == "required":
        return "*"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise _bad("tool_choice", f"names function {shown(name)}, which is not among the tools")
        return name
    raise _bad("tool_choice", f"must be 'auto', 'none', 'required' or a named function, got {shown(tool_choice)}")


def _check_schema(schema: dict[str, Any], param: str) -> None:
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        error = matcher.validate_grammar(matcher.grammar_from_json_schema(schema))  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise _bad(param, f"invalid JSON schema: {error}")


def arguments_schema(parameters: Any, max_digits: int | None) -> Any:
    """A tool's parameters as the forcing grammar holds its arguments to them: strict (an
    object listing properties takes no others unless it says so: vkrt/engine/json_bounds.py),
    its numbers bounded to `max_digits` digits."""
    return bound_numbers(close_objects(parameters), max_digits)


def _call_schema(tools: list[dict[str, Any]], forced: str, arguments_key: str,
                 max_digits: int | None) -> dict[str, Any]:
    variants = []
    for tool in tools:
        function = tool["function"]
        if forced not in ("*", function["name"]):
            continue
        arguments = arguments_schema(function.get("parameters", {"type": "object"}), max_digits)
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                         "properties": {"name": {"const": function["name"]}, arguments_key: arguments}})
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # %json inside Lark takes llguidance's any-run whitespace unless told the engine's.
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def several_calls(forced: str | None, parallel: bool) -> bool:
    """Whether a reply may hold more than one call: `parallel_tool_calls` allows it, except
    under a named tool_choice, which means exactly one call of that function."""
    return parallel and forced in (None, "*")


def forcing_grammar(tools: list[dict[str, Any]], forced: str, parser: str, parallel: bool,
                    max_digits: int | None = DEFAULT_MAX_DIGITS,
                    special_ids: Mapping[str, int] | None = None) -> GuidedDecoding:
    """A Lark grammar whose sentences are one call (or, with `parallel` and any function
    forced, several) of the forced function(s), in `parser`'s syntax, with arguments valid for
    their schema, strictly (`arguments_schema`). The grammar ends with the call: a single call
    completes it, so the engine stops there; after each of several calls the model may end its
    turn (EOS) or call again. A harmony call ends the turn (`<|call|>`), so it is always one.
    `special_ids` names the call tags (`call_tags`) that are special tokens of the vocabulary."""
    parallel = several_calls(forced, parallel)
    if parser == "harmony":
        return GuidedDecoding("grammar", harmony.forcing_grammar(tools, forced, max_digits))
    if parser in tool_xml.SYNTAXES:
        return GuidedDecoding("grammar", tool_xml.forcing_grammar(tools, forced, parallel, max_digits,
                                                                  tool_xml.SYNTAXES[parser], special_ids))
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = "call: %json " + json.dumps(_call_schema(tools, forced, key, max_digits))
    ids = special_ids or {}

    def tag(marker: str) -> str:  # a special token is named by its id, never spelled as text
        return f"<[{ids[marker]}]>" if marker in ids else json.dumps(marker)

    if parser == "hermes":
        start = 'start: one ("\\n" one)*' if parallel else "start: one"
        lines = [start, f'one: {tag("<tool_call>")} "\\n" call "\\n" {tag("</tool_call>")}']
    elif parser == "mistral":
        items = 'call ("," call)*' if parallel else "call"
        lines = [f'start: {tag("[TOOL_CALLS]")} "[" {items} "]"']
    else:
        lines = ['start: call (";" call)*' if parallel else "start: call"]
    return GuidedDecoding("grammar", "\n".join([*lines, call]))


def pick_parser(chat_template: str | None, override: str | None) -> str:
    """The parser named by --tool-call-parser, else the one the chat template's syntax shows."""
    if override:
        return override
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if tool_xml.SYNTAXES["seed_oss"].opener in template:  # it writes <function= too
        return "seed_oss"
    if "<function=" in template:  # inside <tool_call>: checked before hermes
        return "qwen3_xml"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def call_tags(parser: str | None) -> tuple[str, ...]:
    """The tags `parser`'s calls are written with: a tokenizer may hold them as special
    tokens, which the output's text must then keep (vkrt/server/markers.py)."""
    if parser in tool_xml.SYNTAXES:
        return tool_xml.SYNTAXES[parser].opener, tool_xml.SYNTAXES[parser].closer
    return {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]",)}.get(parser or "", ())


def call_opener(parser: str) -> str:
    """The text that starts a tool call in `parser`'s syntax (streamed content stops there)."""
    if parser in tool_xml.SYNTAXES:
        return tool_xml.SYNTAXES[parser].opener
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[parser]


def _call(obj: Any, raw: str, arguments_key: str) -> ToolCall | None:
    """The call in `obj` (the JSON object decoded from `raw`), its arguments as `raw` writes them."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    span = scan_call(raw, 0, arguments_key)
    if span is None or span.arguments_start is None or span.arguments_end is None:
        return ToolCall(obj["name"], "{}")
    return ToolCall(obj["name"], raw[span.arguments_start:span.arguments_end])


def parse_tool_calls(text: str, parser: str,
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls); no calls when the text holds none that parse.
    An output cut inside its calls (max_tokens, a stop string) keeps each call whose name is
    written, the last with its arguments as far as written (as OpenAI does), so the whole parse
    and a stream, whatever its pieces, agree (`ToolCallStream` announces a call at its name).
    `tools` types the XML syntaxes' bare values (the JSON syntaxes carry their own types)."""
    if ends_inside_calls(text, parser):
        cut = _calls_start(text, parser)
        cut_calls = []
        for name, arguments in written_calls(text, parser, tools):
            if name is None:
                break  # a stream announces calls in order, each once its name is known
            cut_calls.append(ToolCall(name, arguments))
        if cut_calls:
            return text[:cut].rstrip(), cut_calls
    decoder = json.JSONDecoder()
    if parser in tool_xml.SYNTAXES:
        content, named = tool_xml.parse(text, tools, tool_xml.SYNTAXES[parser])
        return content, [ToolCall(name, arguments) for name, arguments in named]
    if parser == "hermes":
        calls = []
        for match in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
            try:
                call = _call(json.loads(match.group(1)), match.group(1), "arguments")
            except UNDECODABLE:
                call = None
            if call is not None:
                calls.append(call)
        cut = text.find("<tool_call>")
        return (text[:cut].rstrip() if calls else text), calls
    if parser == "mistral":
        cut = text.find("[TOOL_CALLS]")
        if cut < 0:
            return text, []
        rest = text[cut + len("[TOOL_CALLS]"):].lstrip()
        try:
            items, _ = decoder.raw_decode(rest)
        except UNDECODABLE:
            return text, []
        if not isinstance(items, list):
            items, raws = [items], [rest]
        else:
            raws = [rest[start:] for start in _list_item_starts(rest)]
        found = [_call(item, raw, "arguments") for item, raw in zip(items, raws, strict=False)]
        ok = len(found) == len(items) and all(found)
        return (text[:cut].rstrip(), [c for c in found if c]) if ok else (text, [])
    # llama3_json: the whole output is one or more JSON objects separated by ";".
    calls, rest = [], text.strip()
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except UNDECODABLE:
            return text, []
        call = _call(obj, rest[:end], "parameters")
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return "", calls


# ---- reading calls as they are written --------------------------------------------------

_WHITESPACE = " \t\n\r"


@dataclass
class CallSpan:
    """What a call object written so far shows: its name once complete, and where its arguments
    value lies (`arguments_end` None while it is still being written; `end` None while open)."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    end: int | None = None


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string opening at text[i], None if the text ends inside it."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], None if the text ends inside it (a
    number or literal ends at a delimiter, so one at the very end may still grow)."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WHITESPACE + ",}]":
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, start: int, arguments_key: str) -> CallSpan | None:
    """Read the call object that starts at text[start] (after whitespace) as far as the text
    goes; None once it is clearly not a JSON object."""
    span = CallSpan()
    i = _skip_whitespace(text, start)
    if i == len(text):
        return span
    if text[i] != "{":
        return None
    i += 1
    while True:
        i = _skip_whitespace(text, i)
        if i == len(text):
            return span
        if text[i] == "}":
            span.end = i + 1
            return span
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        key_end = _string_end(text, i)
        if key_end is None:
            return span
        key = json.loads(text[i:key_end])
        i = _skip_whitespace(text, key_end)
        if i == len(text):
            return span
        if text[i] != ":":
            return None
        i = _skip_whitespace(text, i + 1)
        if i == len(text):
            return span
        end = _value_end(text, i)
        if key == "name":
            if end is None:
                return span
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                return None
            span.name = name
        elif key in (arguments_key, "arguments") and span.arguments_start is None:
            span.arguments_start, span.arguments_end = i, end
        if end is None:
            return span
        i = end


def _list_item_starts(text: str) -> list[int]:
    """Where each item of the JSON list at the start of `text` begins."""
    starts: list[int] = []
    i = 1
    while True:
        i = _skip_whitespace(text, i)
        if i >= len(text) or text[i] == "]":
            return starts
        starts.append(i)
        end = _value_end(text, i)
        if end is None:
            return starts
        i = _skip_whitespace(text, end)
        if i < len(text) and text[i] == ",":
            i += 1


def call_spans(text: str, parser: str) -> list[CallSpan]:
    """The calls written so far in `parser`'s syntax, the last one possibly unfinished."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    starts: list[int] = []
    if parser == "hermes":
        opener = call_opener(parser)
        starts = [m.end() for m in re.finditer(re.escape(opener), text)]
    elif parser == "mistral":
        cut = text.find("[TOOL_CALLS]")
        if cut < 0:
            return []
        i = _skip_whitespace(text, cut + len("[TOOL_CALLS]"))
        if i == len(text) or text[i] != "[":
            return []
        starts = [i + s for s in _list_item_starts(text[i:])]
    else:
        i = _skip_whitespace(text, 0)
        while i < len(text) and text[i] == "{":
            starts.append(i)
            span = scan_call(text, i, key)
            if span is None or span.end is None:
                break
            i = _skip_whitespace(text, span.end)
            if i < len(text) and text[i] == ";":
                i = _skip_whitespace(text, i + 1)
    spans = []
    for start in starts:
        span = scan_call(text, start, key)
        if span is None:
            break
        spans.append(span)
    return spans


def _calls_start(text: str, parser: str) -> int:
    """Where the calls begin (the whole output is the call in llama3_json)."""
    return 0 if parser == "llama3_json" else text.find(call_opener(parser))


def ends_inside_calls(text: str, parser: str) -> bool:
    """Whether the output stops inside its calls: after a call's opener and before the closing
    tag (hermes, XML), list (mistral) or object (llama3_json) that ends them."""
    if parser == "llama3_json":
        spans = call_spans(text, parser)
        return bool(spans) and spans[-1].end is None
    if parser == "mistral":
        cut = text.find("[TOOL_CALLS]")
        i = _skip_whitespace(text, cut + len("[TOOL_CALLS]"))
        return cut >= 0 and (i == len(text) or (text[i] == "[" and _value_end(text, i) is None))
    opener, closer = call_tags(parser)
    cut = text.rfind(opener)
    return cut >= 0 and text.find(closer, cut) < 0


def written_calls(text: str, parser: str, tools: list[dict[str, Any]] | None = None) -> list[tuple[str | None, str]]:
    """Each call written so far: its name (None until complete) and its arguments so far."""
    if parser in tool_xml.SYNTAXES:
        return list(tool_xml.written(text, tools, tool_xml.SYNTAXES[parser]))
    return [(span.name, "" if span.arguments_start is None else text[span.arguments_start:span.arguments_end])
            for span in call_spans(text, parser)]


def sendable_content(text: str, parser: str) -> int:
    """How much of the output so far is surely content: everything before a tool call's
    opener, less any tail that may be the opener's beginning and the whitespace before it
    (which the whole parse strips from content that a call follows)."""
    if parser == "llama3_json":  # a call is the whole output, a JSON object
        stripped = text.lstrip()
        return len(text) if stripped and not stripped.startswith("{") else 0
    opener = call_opener(parser)
    cut = text.find(opener)
    if cut < 0:
        cut = len(text)
        for k in range(min(len(opener) - 1, len(text)), 0, -1):
            if text.endswith(opener[:k]):
                cut = len(text) - k
                break
    return len(text[:cut].rstrip())


class ToolCallStream:
    """Streamed output with tools offered: content until a call's opener, then each call as
    OpenAI deltas: `{index, id, type, function: {name, arguments: ""}}` once its name is
    written, then `{index, function: {arguments}}` fragments as its arguments are generated."""

    def __init__(self, parser: str, parallel: bool, tools: list[dict[str, Any]] | None = None) -> None:
        self.parser = parser
        self.parallel = parallel
        self.tools = tools  # types the XML syntaxes' values
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []  # the calls announced so far
        self.arguments_sent: list[str] = []
        self.found_calls = False  # set by the final feed: the whole output holds calls

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool_calls delta entries) once `piece` is appended to the output."""
        self.text += piece
        if final:
            return self._finish()
        safe = max(self.content_sent, sendable_content(self.text, self.parser))
        content = self.text[self.content_sent:safe]
        self.content_sent = safe
        deltas = []
        for index, (name, written) in enumerate(written_calls(self.text, self.parser, self.tools)[
                :None if self.parallel else 1]):
            if name is None and index >= len(self.ids):
                break  # calls are announced in order, each once its name is known
            delta = self._delta(index, name, written)
            if delta is not None:
                deltas.append(delta)
        return content, deltas

    def _delta(self, index: int, name: str | None, arguments: str) -> dict[str, Any] | None:
        """The delta that brings call `index` up to `arguments`, None if nothing is new."""
        if index == len(self.ids):
            assert name is not None
            self.ids.append(new_call_id())
            self.arguments_sent.append(arguments)
            return {"index": index, "id": self.ids[index], "type": "function",
                    "function": {"name": name, "arguments": arguments}}
        sent = self.arguments_sent[index]
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return None
        self.arguments_sent[index] = arguments
        return {"index": index, "function": {"arguments": arguments[len(sent):]}}

    def _finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_tool_calls(self.text, self.parser, self.tools)
        if not calls:
            rest = "" if self.ids else self.text[self.content_sent:]
            self.content_sent = len(self.text)
            return rest, []
        self.found_calls = True
        rest = content[self.content_sent:]
        deltas = []
        for index, call in enumerate(calls[:None if self.parallel else 1]):
            delta = self._delta(index, call.name, call.arguments)
            if delta is not None:
                deltas.append(delta)
        return rest, deltas


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool_calls with their JSON-text arguments decoded, as chat templates (and
    vLLM) expect them: `tool_call.arguments | tojson` would otherwise quote the text again."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            decoded = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        function = {**function, "arguments": json.loads(function["arguments"])}
                    except UNDECODABLE:
                        pass
                    call = {**call, "function": function}
                decoded.append(call)
            message = {**message, "tool_calls": decoded}
        out.append(message)
    return out
