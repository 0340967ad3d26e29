"""Parameters written one element each (Qwen3-Coder's, GLM's): a string value as plain
text (with the text that closes it: ToolFormat.text_until), anything else as JSON, in the
order the schema lists them (required ones always, optional ones may be left out)."""

from __future__ import annotations

import json
from collections.abc import Callable

from server.api.tool_formats import ToolFormat, json_term

INTEGER = r"/-?(0|[1-9][0-9]*)/"
NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


def parameter_rules(
    fmt: ToolFormat,
    parameters: dict,
    rule: str,
    element: Callable[[str, str], str],
    closer: str,
) -> tuple[str, list[str]]:
    """(the Lark expression of a call's parameters, the lines its terms need). `element`
    wraps a key around its value's term, which includes `closer` (the text that ends a
    value)."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    parts, lines = [], []
    for i, (key, schema) in enumerate(properties.items()):
        name = f"{rule}_v{i}"
        if _is_text(schema):
            term, extra = fmt.text_until(closer, name, _length(schema))
            lines += extra
        else:
            lines.append(f"{name}: {_json_value(schema, defs)}")
            term = f"{name} {fmt.literal(closer)}"
        parts.append(element(key, term) if key in required else f"({element(key, term)})?")
    return " ".join(parts) or '""', lines


def _is_text(schema) -> bool:
    if not isinstance(schema, dict):
        return False
    if "enum" in schema or "const" in schema:
        return False
    return schema.get("type") == "string"


def _json_value(schema: dict, defs: dict) -> str:
    kind = schema.get("type")
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None and all(isinstance(v, str) for v in values):
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in values) or '""'
    if kind == "integer" and len(schema) == 1:
        return INTEGER
    if kind == "number" and len(schema) == 1:
        return NUMBER
    if kind == "boolean":  # Qwen3-Coder's template writes Python's (`v | string`)
        return '"true" | "false" | "True" | "False"'
    return json_term({**schema, **defs})


def _length(schema: dict) -> str:
    """The regex repeat of a string's minLength / maxLength ("*" when it has neither)."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is None and high is None:
        return "*"
    return f"{{{int(low or 0)},{'' if high is None else int(high)}}}"
