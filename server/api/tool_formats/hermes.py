"""Hermes / Qwen 2.5-3 JSON calls, as templates with a tools section render them:
`<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>` (mlx-lm's json_tools)."""

from __future__ import annotations

import json
import re

from server.api.tool_formats import ToolFormat, json_term

# A call's name and where its arguments start (the grammar fixes the JSON's spacing).
JSON_HEAD = re.compile(r'\{"name": "(?P<name>(?:[^"\\]|\\.)*)", "arguments": ')


def json_name(match: re.Match) -> str:
    """The name a JSON_HEAD matched, unescaped."""
    return json.loads(f'"{match.group("name")}"')


class HermesJSON(ToolFormat):
    name = "json_tools"
    head = JSON_HEAD
    json_arguments = True
    has_grammar = True

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        opening = self.literal(f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": ')
        closing = self.literal(f"}}\n{self.end}")
        return [f"{rule}: {opening} {json_term(parameters)} {closing}"]

    def name_of(self, match: re.Match) -> str:
        return json_name(match)
