"""Llama 3.1-3.3: a call is the reply's bare JSON, `{"name": NAME, "parameters": {...}}`,
as their template renders earlier calls. mlx-lm names no parser for it, so it is read
here from the same template text: a template that renders `tool_call.name` followed by
`"parameters": ` (and names no other format)."""

from __future__ import annotations

import json
import re

from server.api.tool_formats import ToolFormat, json_term

START = '{"name": '


def is_llama3_json(template: str) -> bool:
    return "tool_call.name" in template and '"parameters": ' in template


class Llama3JSON(ToolFormat):
    name = "llama3_json"
    head = re.compile(r'\{"name": "(?P<name>(?:[^"\\]|\\.)*)", "parameters": ')
    json_arguments = True
    has_grammar = True

    def __init__(self, parser, start: str, end: str, specials: dict[str, int]):
        super().__init__(parser, START, "", specials)

    def parse(self, body: str, tools: list[dict]) -> list[dict]:
        call = json.loads(START + body)
        return [{"name": call["name"], "arguments": call.get("parameters", {})}]

    def name_of(self, match: re.Match) -> str:
        return json.loads(f'"{match.group("name")}"')

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        """The call as one JSON schema (beside an answer's JSON, two JSON grammars lex
        together; a literal head and a JSON answer would not)."""
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        return [f"{rule}: {json_term(call)}"]

    def calls_lines(self, functions: list, many: int, forced: bool) -> list[str]:
        return super().calls_lines(functions, 1, forced)  # one call a reply
