"""The schema rewrites made before llguidance compiles a schema (vkrt/engine/json_bounds.py)."""

from __future__ import annotations

from vkrt.engine.json_bounds import any_object, bound_numbers, close_objects

LIMIT = 10**16 - 1


def test_unbounded_numbers_get_bounds_and_given_ones_are_kept() -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"},
        "low": {"type": "integer", "minimum": 0},
        "wide": {"type": "integer", "exclusiveMaximum": 10**18},
        "x": {"type": ["number", "null"]},
        "step": {"type": "number", "multipleOf": 0.5},
        "fixed": {"type": "integer", "enum": [10**20]},
        "list": {"type": "array", "items": {"type": "integer"}},
        "ref": {"$ref": "#/$defs/d"}},
        "$defs": {"d": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}
    bounded = bound_numbers(schema, 16)
    props = bounded["properties"]
    assert props["n"] == {"type": "integer", "minimum": -LIMIT, "maximum": LIMIT}
    assert props["low"] == {"type": "integer", "minimum": 0, "maximum": LIMIT}
    assert props["wide"] == {"type": "integer", "exclusiveMaximum": 10**18, "minimum": -LIMIT}
    assert props["x"] == {"type": ["number", "null"], "minimum": -LIMIT, "maximum": LIMIT, "multipleOf": 1e-10}
    assert props["step"]["multipleOf"] == 0.5
    assert props["fixed"] == {"type": "integer", "enum": [10**20]}
    assert props["list"]["items"]["maximum"] == LIMIT
    assert bounded["$defs"]["d"]["anyOf"][0]["maximum"] == LIMIT
    assert bound_numbers(schema, 4)["properties"]["x"]["multipleOf"] == 1e-4
    assert bound_numbers(schema, None) is schema
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema is not changed


def test_objects_listing_properties_are_closed_unless_they_allow_more() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        "any": {"type": "object"},
        "both": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["map"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["any"]
    assert all("additionalProperties" not in member for member in props["both"]["allOf"])
    # A required key missing from the properties stays allowed, so the schema stays satisfiable.
    assert close_objects({"properties": {"a": {}}, "required": ["a", "b"]}) == {
        "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "additionalProperties": False}


def test_any_object_bounds_numbers_at_every_depth() -> None:
    schema = any_object(16)
    value = schema["$defs"]["value"]["anyOf"]
    assert {"type": "integer", "minimum": -LIMIT, "maximum": LIMIT} in value
    assert any_object(None) == {"type": "object"}
