"""Tool calls in XML, parser "qwen3_xml": the syntax Qwen3.5 and Qwen3-Coder are trained on.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each argument is its own block, its value written bare: the chat template writes a string as
it is, a mapping or a list as JSON, anything else with Python's `str` (so True, None). Reading a
call back, the tool's schema says what each value is: a string parameter keeps its text, the
others are read as JSON (Python's True / False / None accepted), and a value that does not
read as its type is kept as text. A call's `arguments` is then the JSON of those values: unlike
the JSON syntaxes it is not a span of the output, so a streamed call sends its name as soon as
`<function=...>` is written and its arguments in one piece once `</function>` is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vkrt.engine.guided import JSON_WHITESPACE
from vkrt.engine.json_bounds import DEFAULT_MAX_DIGITS, bound_numbers, close_objects

OPENER = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"<tool_call>\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_WORDS = {"True": True, "False": False, "None": None}


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
    except json.JSONDecodeError:
        return text
    if isinstance(value, str) and "string" not in kinds and kinds:
        return text
    return value


def _arguments(body: str, properties: dict[str, Any]) -> str:
    values = {key.strip(): _value(raw, properties.get(key.strip())) for key, raw in _PARAMETER.findall(body)}
    return json.dumps(values, ensure_ascii=False)


def parse(text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[tuple[str, str]]]:
    """(content before the calls, [(name, arguments JSON)]); no calls when none is complete."""
    calls = [(name.strip(), _arguments(body, _properties(tools, name.strip())))
             for name, body in _CALL.findall(text)]
    cut = text.find(OPENER)
    return (text[:cut].rstrip() if calls else text), calls


def written(text: str, tools: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """The calls written so far: (name, arguments), arguments "" until the call is closed."""
    calls = []
    for match in _NAME.finditer(text):
        name = match.group(1).strip()
        closed = _CALL.match(text, match.start())
        calls.append((name, _arguments(closed.group(2), _properties(tools, name)) if closed else ""))
        if closed is None:
            break
    return calls


# ---- the forcing grammar ------------------------------------------------------------------

def _lark_string(text: str) -> str:
    return json.dumps(text)


def _string_value(schema: dict[str, Any]) -> str:
    """A lexeme for a bare string value, ended lazily by the block's closing tag."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(_lark_string(v + "\n</parameter>\n") for v in schema["enum"])
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    span = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}" if low else "*"
    return f'/(?s:.){span}/'


def forcing_grammar(tools: list[dict[str, Any]], forced: str, parallel: bool,
                    max_digits: int | None = DEFAULT_MAX_DIGITS) -> str:
    """Lark whose sentences are calls of the forced function(s) in this syntax: a schema's
    properties (and no others) in their declared order, the required ones always, strings
    bare and every other value as JSON valid for its schema, strictly (an object value that
    lists properties takes no others unless it allows them), its numbers bounded to
    `max_digits` digits."""
    lines = ['start: one ("\\n" one)*' if parallel else "start: one"]
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
            head = _lark_string(f"<parameter={key}>\n")
            if _types(schema) == {"string"} or ("enum" in schema and not _types(schema) - {"string"}):
                value = _string_value(schema)
                if value.startswith("/"):
                    lines.append(f'{rule}_v[suffix="\\n</parameter>\\n"]: {value}')
                    lines.append(f"{rule}: {head} {rule}_v")
                else:
                    lines.append(f"{rule}: {head} ({value})")
            else:
                value_schema = {**bound_numbers(close_objects(schema), max_digits),
                                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
                lines.append(f"{rule}_v: %json {json.dumps(value_schema)}")
                lines.append(f'{rule}: {head} {rule}_v "\\n</parameter>\\n"')
            parts.append(rule if key in required else f"{rule}?")
        lines.append(f"f{f}: {_lark_string('<function=' + function['name'] + '>' + chr(10))} {' '.join(parts)} "
                     '"</function>\\n</tool_call>"')
        functions.append(f"f{f}")
    lines.insert(1, f'one: "<tool_call>\\n" ({" | ".join(functions)})')
    return "\n".join(lines)
