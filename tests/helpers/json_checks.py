"""Validating generated JSON against a schema: ``jsonschema`` when installed, else a small
checker of the keywords the structured-output tests use (type, properties, required,
additionalProperties, enum, const, min/maxLength, minimum/maximum, items, min/maxItems, anyOf).

    from helpers.json_checks import assert_valid
"""

from __future__ import annotations

import json
from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _errors(value: Any, schema: dict, path: str) -> list[str]:
    if "anyOf" in schema:
        if all(_errors(value, s, path) for s in schema["anyOf"]):
            return [f"{path}: matches no anyOf branch: {value!r}"]
        return []
    out = []
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is not None:
        ok = isinstance(value, _TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool))
    else:
        ok = True
    if not ok:
        return [f"{path}: expected {kind}, got {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: {value!r} != {schema['const']!r}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            out.append(f"{path}: length {len(value)} outside the bounds")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{path}: {value} outside [minimum, maximum]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            out += [f"{path}: unexpected {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                out += _errors(v, props[k], f"{path}.{k}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items outside the bounds")
        if "items" in schema:
            for i, v in enumerate(value):
                out += _errors(v, schema["items"], f"{path}[{i}]")
    return out


def assert_valid(text: str, schema: dict) -> Any:
    """Parse ``text`` as JSON and check it against ``schema``; returns the value."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        errors = _errors(value, schema, "$")
        assert not errors, (text, errors)
    else:
        jsonschema.validate(value, schema)
    return value
