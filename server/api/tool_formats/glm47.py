"""GLM 4.5-4.7: the name, then key/value pairs, values as plain text (strings) or JSON:
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` (4.5 and 4.6
put a newline after the name and each pair; the grammar allows either)."""

from __future__ import annotations

import re

from server.api.tool_formats import ToolFormat
from server.api.tool_formats.xml_values import parameter_rules


class GLM47(ToolFormat):
    name = "glm47"
    head = re.compile(r"<tool_call>\s*(?P<name>[^<\s]+)(?=[\s<])")
    has_grammar = True

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        newline = f"{self.literal(chr(10))}?"

        def element(key: str, value: str) -> str:
            key_part = self.literal(f"<arg_key>{key}</arg_key>")
            return f"{key_part} {newline} {self.literal('<arg_value>')} {value} {newline}"

        params, lines = parameter_rules(self, parameters, rule, element, "</arg_value>")
        opening = f"{self.literal(self.start + name)} {newline}"
        return [f"{rule}: {opening} {params} {self.literal(self.end)}", *lines]
