"""Qwen3-Coder and Qwen3.5: XML calls, one parameter per element, values as plain text
(strings) or JSON (anything else), as their template renders them:
`<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>`."""

from __future__ import annotations

import re

from server.api.tool_formats import ToolFormat
from server.api.tool_formats.xml_values import parameter_rules


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    head = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\s]+)>")
    has_grammar = True
    element = re.compile(r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)</parameter>", re.S)

    def value_of(self, text: str) -> str:
        text = text[1:] if text.startswith("\n") else text
        return text[:-1] if text.endswith("\n") else text

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        def element(key: str, value: str) -> str:
            opening = self.literal(f"<parameter={key}>\n")
            return f"{opening} {value} {self.literal(chr(10))}"

        params, lines = parameter_rules(self, parameters, rule, element, "\n</parameter>")
        opening = self.literal(f"{self.start}\n<function={name}>\n")
        closing = self.literal(f"</function>\n{self.end}")
        return [f"{rule}: {opening} {params} {closing}", *lines]
