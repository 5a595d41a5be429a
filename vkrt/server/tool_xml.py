"""Tool calls in XML, one block per argument: parser "qwen3_xml" (Qwen3.5, Qwen3-Coder) and
parser "seed_oss" (Seed-OSS), the same syntax in different framing.

    <tool_call>                         <seed:tool_call>
    <function=get_weather>              <function=get_weather>
    <parameter=city>                    <parameter=city>Paris</parameter>
    Paris                               <parameter=days>3</parameter>
    </parameter>                        </function>
    <parameter=days>                    </seed:tool_call>
    3
    </parameter>
    </function>
    </tool_call>

Each value is written bare: the chat template writes a string as it is, a mapping or a list as
JSON (Qwen) or with Python's `str` (Seed), anything else with Python's `str` (so True, None).
Reading a call back, the tool's schema says what each value is: a string parameter keeps its
text, the others are read as JSON, else as a Python literal (True / None, `{'a': 1}`), and a
value that reads as neither is kept as text. A call's `arguments` is then the JSON of those
values: unlike the JSON syntaxes it is not a span of the output, so a streamed call sends its
name as soon as `<function=...>` is written and its arguments a parameter at a time, as each
`</parameter>` is written (`{"city": "Paris"`, then `, "days": 3`, then `}` at `</function>`).
A parameter written twice keeps its first value, so what was streamed stays true.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from vkrt.engine.guided import JSON_WHITESPACE
from vkrt.engine.json_bounds import DEFAULT_MAX_DIGITS, bound_numbers, close_objects


@dataclass(frozen=True)
class XmlSyntax:
    """One family's framing of the XML calls: the call's tags, and the line break its template
    writes on each side of a value ("" when the value sits between the tags)."""

    opener: str
    closer: str
    value_break: str


SYNTAXES = {"qwen3_xml": XmlSyntax("<tool_call>", "</tool_call>", "\n"),
            "seed_oss": XmlSyntax("<seed:tool_call>", "</seed:tool_call>", "")}
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_WORDS = {"True": True, "False": False, "None": None}


@cache
def _patterns(syntax: XmlSyntax) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(a whole call: its name and body, the head of a call: its name) in `syntax`."""
    opener, closer = re.escape(syntax.opener), re.escape(syntax.closer)
    head = rf"{opener}\s*<function=([^>\n]+)>"
    return re.compile(rf"{head}\n?(.*?)</function>\s*{closer}", re.DOTALL), re.compile(head)


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _types(schema: Any) -> set[str]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _value(text: str, schema: Any) -> Any:
    """One parameter's value as its schema types it (text where it does not read as one)."""
    kinds = _types(schema)
    if kinds == {"string"} or (isinstance(schema, dict) and "enum" in schema and text in schema["enum"]):
        return text
    if text in _PYTHON_WORDS:
        return _PYTHON_WORDS[text]
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # a model may write "[[[[..." deeper than json's stack
        try:  # Seed's template writes a mapping or a list with Python's str: {'a': 1}
            value = ast.literal_eval(text)
            json.dumps(value)  # a set or bytes inside has no JSON
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return text
        if not isinstance(value, (dict, list, int, float)):
            return text
    if isinstance(value, str) and "string" not in kinds and kinds:
        return text
    return value


def _values(body: str, properties: dict[str, Any]) -> dict[str, Any]:
    """The closed parameters of a call's body, typed; a repeated parameter keeps its first value."""
    values: dict[str, Any] = {}
    for key, raw in _PARAMETER.findall(body):
        values.setdefault(key.strip(), _value(raw, properties.get(key.strip())))
    return values


def _arguments(values: dict[str, Any], closed: bool) -> str:
    """The arguments JSON of `values`; while the call is open, without its closing brace (every
    later parameter then only extends the text)."""
    text = json.dumps(values, ensure_ascii=False)
    return text if closed else text[:-1]


def parse(text: str, tools: list[dict[str, Any]] | None,
          syntax: XmlSyntax = SYNTAXES["qwen3_xml"]) -> tuple[str, list[tuple[str, str]]]:
    """(content before the calls, [(name, arguments JSON)]); no calls when none is complete."""
    call, _ = _patterns(syntax)
    calls = [(name.strip(), _arguments(_values(body, _properties(tools, name.strip())), True))
             for name, body in call.findall(text)]
    cut = text.find(syntax.opener)
    return (text[:cut].rstrip() if calls else text), calls


def written(text: str, tools: list[dict[str, Any]] | None,
            syntax: XmlSyntax = SYNTAXES["qwen3_xml"]) -> list[tuple[str, str]]:
    """The calls written so far: (name, arguments so far), an open call's without its closing
    brace and "" until its first parameter closes."""
    call, head = _patterns(syntax)
    calls = []
    for match in head.finditer(text):
        name = match.group(1).strip()
        closed = call.match(text, match.start())
        body = closed.group(2) if closed else text[match.end():]
        values = _values(body, _properties(tools, name))
        calls.append((name, _arguments(values, True) if closed else _arguments(values, False) if values else ""))
        if closed is None:
            break
    return calls


# ---- the forcing grammar ------------------------------------------------------------------

def _lark_string(text: str) -> str:
    return json.dumps(text)


def _string_value(schema: dict[str, Any], tail: str) -> str:
    """A lexeme for a bare string value, ended lazily by `tail` (the block's closing tag)."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(_lark_string(v + tail) for v in schema["enum"])
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    span = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}" if low else "*"
    return f'/(?s:.){span}/'


def forcing_grammar(tools: list[dict[str, Any]], forced: str, parallel: bool,
                    max_digits: int | None = DEFAULT_MAX_DIGITS, syntax: XmlSyntax = SYNTAXES["qwen3_xml"],
                    special_ids: Mapping[str, int] | None = None) -> str:
    """Lark whose sentences are calls of the forced function(s) in `syntax`: a schema's
    properties (and no others) in their declared order, the required ones always, strings
    bare and every other value as JSON valid for its schema, strictly (an object value that
    lists properties takes no others unless it allows them), its numbers bounded to
    `max_digits` digits. A call tag the vocabulary holds as a special token (`special_ids`)
    is named by its id, which matches that token and never its spelling as text."""
    ids = special_ids or {}

    def tag(marker: str) -> str:
        return f"<[{ids[marker]}]>" if marker in ids else _lark_string(marker)

    lines = ['start: one ("\\n" one)*' if parallel else "start: one"]
    tail = syntax.value_break + "</parameter>\n"
    functions = []
    for f, tool in enumerate(tools):
        function = tool["function"]
        if forced not in ("*", function["name"]):
            continue
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required") or [])
        parts = []
        for p, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule = f"f{f}_p{p}"
            schema = schema if isinstance(schema, dict) else {}
            head = _lark_string(f"<parameter={key}>" + syntax.value_break)
            if _types(schema) == {"string"} or ("enum" in schema and not _types(schema) - {"string"}):
                value = _string_value(schema, tail)
                if value.startswith("/"):
                    lines.append(f"{rule}_v[suffix={_lark_string(tail)}]: {value}")
                    lines.append(f"{rule}: {head} {rule}_v")
                else:
                    lines.append(f"{rule}: {head} ({value})")
            else:
                value_schema = {**bound_numbers(close_objects(schema), max_digits),
                                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
                lines.append(f"{rule}_v: %json {json.dumps(value_schema)}")
                lines.append(f"{rule}: {head} {rule}_v {_lark_string(tail)}")
            parts.append(rule if key in required else f"{rule}?")
        lines.append(f"f{f}: {_lark_string('<function=' + function['name'] + '>' + chr(10))} {' '.join(parts)} "
                     f'"</function>\\n" {tag(syntax.closer)}')
        functions.append(f"f{f}")
    lines.insert(1, f'one: {tag(syntax.opener)} "\\n" ({" | ".join(functions)})')
    return "\n".join(lines)
