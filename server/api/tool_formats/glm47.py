"""GLM 4.5-4.7: the name, then key/value pairs, values as plain text (strings) or JSON:
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` (4.5 and 4.6
put a newline after the name, the key and each pair: the grammar follows the template,
so that the history renders back as the model wrote it)."""

from __future__ import annotations

import re

from server.api.tool_formats import ToolFormat
from server.api.tool_formats.xml_values import parameter_rules


class GLM47(ToolFormat):
    name = "glm47"
    head = re.compile(r"<tool_call>\s*(?P<name>[^<\s]+)(?=[\s<])")
    has_grammar = True
    newlines = False
    element = re.compile(
        r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S
    )

    def configure(self, template: str) -> None:
        self.newlines = "</arg_key>\n<arg_value>" in template

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        newline = self.literal("\n") if self.newlines else ""

        def element(key: str, value: str) -> str:
            key_part = self.literal(f"<arg_key>{key}</arg_key>")
            return f"{key_part} {newline} {self.literal('<arg_value>')} {value} {newline}"

        params, lines = parameter_rules(self, parameters, rule, element, "</arg_value>")
        opening = f"{self.literal(self.start + name)} {newline}"
        return [f"{rule}: {opening} {params} {self.literal(self.end)}", *lines]
