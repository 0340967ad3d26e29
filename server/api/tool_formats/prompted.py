"""The fallback for a template without a tools section: the tools described in a system
message, calls in the Hermes convention (`<tool_call>{"name": ..., "arguments": ...}
</tool_call>`), which the model was told and never trained on. A forced reply is the
calls' bare JSON (an array when several may come); this is the format the server used
for every model before formats were read from the template."""

from __future__ import annotations

import json
from typing import Any

from server.api.tool_formats import ToolFormat, json_term
from server.api.tool_formats.hermes import JSON_HEAD, json_name

MAX_PARALLEL_CALLS = 4  # a forced reply's calls at most (a bounded grammar)
TOOLS_INTRO = (
    "You can call these functions. To call one, reply with only "
    '<tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call> '
    "(several calls: one after another). The functions:"
)


class PromptedJSON(ToolFormat):
    name = "prompted_json"
    native = False
    head = JSON_HEAD
    json_arguments = True
    has_grammar = True

    def parse(self, body: str, tools: list[dict]) -> list[dict]:
        found = json.loads(body)
        return found if isinstance(found, list) else [found]

    def calls_lines(self, functions: list, many: int, forced: bool) -> list[str]:
        """Forced: the bare JSON of the calls; else each call between the markers."""
        calls = [_call_schema(f.name, i) for i, f in enumerate(functions)]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        defs = {f"f{i}": _repointed(f.parameters, f"#/$defs/f{i}") for i, f in enumerate(functions)}
        if forced:
            schema = one if many == 1 else {"type": "array", "items": one, "minItems": 1,
                                             "maxItems": many}  # fmt: skip
            return [f"calls: {json_term({**schema, '$defs': defs})}"]
        more = f"~0..{many - 1}"
        return [
            f'calls: block ("\\n"? block){more}',
            f"block: {self.literal(self.start)} call {self.literal(self.end)}",
            f"call: {json_term({**one, '$defs': defs})}",
        ]

    def name_of(self, match) -> str:
        return json_name(match)


def _call_schema(name: str, i: int) -> dict:
    """One call of function i: its name, then its arguments (`$defs` f{i})."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/f{i}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _repointed(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` pointer ("#", "#/...") resolved from `root`: a
    function's parameters sit at `$defs` f{i} of the calls' schema, where pydantic's
    `#/$defs/...` and a recursive `#` would otherwise resolve against the calls."""
    if isinstance(schema, list):
        return [_repointed(v, root) for v in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema  # a resource of its own: its "#" is itself, wherever it sits
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = root + value[1:]  # a JSON pointer (not an anchor, "#name")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names of schemas
            out[key] = {name: _repointed(sub, root) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value
        else:
            out[key] = _repointed(value, root)
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
