"""Tool calling: the request's tools checked, the forcing grammar for tool_choice
"required" or a named function, and parsers from model output to OpenAI `tool_calls`.

Each parser knows one model family's call syntax: "hermes" (Hermes, Qwen 2.5/3:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), "llama3_json" (Llama 3.x:
a bare `{"name": ..., "parameters": {...}}`), "mistral" (`[TOOL_CALLS][{"name": ...,
"arguments": {...}}]`). The forcing grammar writes the same syntax, so a forced call always
parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from vkrt.engine.guided import JSON_WHITESPACE, GuidedDecoding
from vkrt.server.errors import APIError, shown


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
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


def _call_schema(tools: list[dict[str, Any]], forced: str, arguments_key: str) -> dict[str, Any]:
    variants = []
    for tool in tools:
        function = tool["function"]
        if forced not in ("*", function["name"]):
            continue
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                         "properties": {"name": {"const": function["name"]},
                                        arguments_key: function.get("parameters", {"type": "object"})}})
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # %json inside Lark takes llguidance's any-run whitespace unless told the engine's.
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def forcing_grammar(tools: list[dict[str, Any]], forced: str, parser: str, parallel: bool) -> GuidedDecoding:
    """A Lark grammar whose sentences are one call (or, with `parallel`, several) of the
    forced function(s), in `parser`'s syntax, with arguments valid for their schema."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = "call: %json " + json.dumps(_call_schema(tools, forced, key))
    if parser == "hermes":
        start = 'start: one ("\\n" one)*' if parallel else "start: one"
        lines = [start, 'one: "<tool_call>\\n" call "\\n</tool_call>"']
    elif parser == "mistral":
        lines = ['start: "[TOOL_CALLS][" call ("," call)* "]"' if parallel else 'start: "[TOOL_CALLS][" call "]"']
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
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def call_opener(parser: str) -> str:
    """The text that starts a tool call in `parser`'s syntax (streamed content stops there)."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[parser]


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls); no calls when the text holds none that parse."""
    decoder = json.JSONDecoder()
    if parser == "hermes":
        calls = []
        for match in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
            try:
                call = _call(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        cut = text.find("<tool_call>")
        return (text[:cut].rstrip() if calls else text), calls
    if parser == "mistral":
        cut = text.find("[TOOL_CALLS]")
        if cut < 0:
            return text, []
        try:
            items, _ = decoder.raw_decode(text[cut + len("[TOOL_CALLS]"):].lstrip())
        except json.JSONDecodeError:
            return text, []
        found = [_call(item, "arguments") for item in (items if isinstance(items, list) else [items])]
        return (text[:cut].rstrip(), [c for c in found if c]) if all(found) else (text, [])
    # llama3_json: the whole output is one or more JSON objects separated by ";".
    calls, rest = [], text.strip()
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return "", calls


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
                    except json.JSONDecodeError:
                        pass
                    call = {**call, "function": function}
                decoded.append(call)
            message = {**message, "tool_calls": decoded}
        out.append(message)
    return out
