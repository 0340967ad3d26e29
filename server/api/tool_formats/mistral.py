"""Mistral: `[TOOL_CALLS]NAME[ARGS]{...}` per call (templates that name `[ARGS]`, from
Small 3.2 / v11 on), or one JSON list `[TOOL_CALLS][{"name": ..., "arguments": ...}]`
(older ones). No closing marker: the calls run to the reply's end."""

from __future__ import annotations

import json
import re

from server.api.tool_formats import ToolFormat, json_term
from server.api.tool_formats.hermes import JSON_HEAD, json_name

HEADER = re.compile(r"(?P<name>[\w-]+)\[ARGS\]")


class Mistral(ToolFormat):
    name = "mistral"
    json_arguments = True
    has_grammar = True
    headers = True  # NAME[ARGS]{...}; False: a JSON list

    def configure(self, template: str) -> None:
        self.headers = "[ARGS]" in template
        self.head = HEADER if self.headers else JSON_HEAD

    def name_of(self, match: re.Match) -> str:
        return match.group("name") if self.headers else json_name(match)

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        if self.headers:
            opening = self.literal(f"{self.start}{name}[ARGS]")
            return [f"{rule}: {opening} {json_term(parameters)}"]
        opening = self.literal(f'{{"name": {json.dumps(name)}, "arguments": ')
        return [f'{rule}: {opening} {json_term(parameters)} "}}"']

    def calls_lines(self, functions: list, many: int, forced: bool) -> list[str]:
        lines = super().calls_lines(functions, many, forced)
        more = f"{{0,{many - 1}}}"
        if self.headers:
            calls = f"calls: call call{more}" if many > 1 else "calls: call"
        else:
            calls = f'calls: {self.literal(self.start)} "[" call (", " call){more} "]"'
        return [calls, *lines[1:]]
