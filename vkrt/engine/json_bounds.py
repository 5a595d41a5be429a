"""JSON-schema rewrites made before llguidance compiles a schema.

`bound_numbers`: llguidance lets an integer or a number without bounds run to any length, and a
small model sampled under such a grammar can write `1111...` until max_tokens. llama.cpp's
schema grammars bound an integer's digits (16); llguidance has no such option, so the bound is
written into the schema: an integer or number with no `minimum` (or `exclusiveMinimum`) gets
`minimum: -(10**digits - 1)`, likewise `maximum`, and a number with no `multipleOf` gets
`multipleOf: 10**-min(digits, 10)` (at most that many digits after the point; llguidance
takes no finer multipleOf). Bounds a schema gives itself are kept, so a schema that needs
bigger numbers says so. The any-value parts of a schema (`{}`, an object without
properties) are left as they are; `any_object` is "any JSON object" with bounded numbers.

`close_objects`: an object schema that lists `properties` and says nothing of
`additionalProperties` (nor `patternProperties` / `unevaluatedProperties`) gets
`additionalProperties: false`, as OpenAI's strict function calling has it (a key it lists in
`required` but not in `properties` is added there, any value); `allOf` members are left open
(closing each would refuse the properties of the others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# llama.cpp's json-schema-to-grammar bounds an integer's digits at 16.
DEFAULT_MAX_DIGITS = 16
# The finest multipleOf llguidance compiles (1e-11 is "too many digits" as an f64).
MAX_FRACTION_DIGITS = 10

Schema = Any  # a dict, a bool, or anything else a malformed schema holds (left to llguidance)

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
        "not", "if", "then", "else", "contains", "propertyNames")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _walk(schema: Schema, rewrite: Callable[[dict[str, Any], bool], dict[str, Any]], in_all_of: bool = False) -> Schema:
    """A copy of `schema` with `rewrite(node, in_all_of)` applied to every subschema object."""
    if not isinstance(schema, dict):
        return schema
    node = rewrite(dict(schema), in_all_of)
    for key in _ONE:
        value = node.get(key)
        if isinstance(value, dict):
            node[key] = _walk(value, rewrite)
        elif key == "items" and isinstance(value, list):  # draft 4-7 tuple items
            node[key] = [_walk(item, rewrite) for item in value]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_walk(item, rewrite, key == "allOf") for item in node[key]]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _walk(sub, rewrite) for name, sub in node[key].items()}
    return node


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def bound_numbers(schema: Schema, max_digits: int | None) -> Schema:
    """`schema` with its unbounded integers and numbers bounded to `max_digits` digits
    (None: unchanged)."""
    if max_digits is None:
        return schema
    limit = 10**max_digits - 1
    fraction = min(max_digits, MAX_FRACTION_DIGITS)

    def bound(node: dict[str, Any], _in_all_of: bool) -> dict[str, Any]:
        types = _types(node)
        if not types & {"integer", "number"} or "enum" in node or "const" in node:
            return node
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -limit
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = limit
        if "number" in types and "multipleOf" not in node:
            node["multipleOf"] = 10.0**-fraction
        return node

    return _walk(schema, bound)


def close_objects(schema: Schema) -> Schema:
    """`schema` with every object that lists properties closed to others unless it allows them."""

    def close(node: dict[str, Any], in_all_of: bool) -> dict[str, Any]:
        properties = node.get("properties")
        if (not in_all_of and isinstance(properties, dict)
                and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & node.keys()):
            node["additionalProperties"] = False
            required = node.get("required")
            # A required key the properties do not list stays allowed (any value), else closing
            # would make the schema unsatisfiable.
            missing = [k for k in required if isinstance(k, str) and k not in properties] \
                if isinstance(required, list) else []
            if missing:
                node["properties"] = {**properties, **{key: {} for key in missing}}
        return node

    return _walk(schema, close)


def any_object(max_digits: int | None) -> dict[str, Any]:
    """A schema of any JSON object, its numbers (at any depth) bounded to `max_digits`."""
    if max_digits is None:
        return {"type": "object"}
    value = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "integer"}, {"type": "number"},
                       {"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/value"}},
                       {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}
    return bound_numbers({"type": "object", "additionalProperties": {"$ref": "#/$defs/value"},
                          "$defs": {"value": value}}, max_digits)
