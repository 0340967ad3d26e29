"""Kimi K2: a section of calls, each `functions.NAME:INDEX` and its JSON arguments:
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>`."""

from __future__ import annotations

import re

from server.api.tool_formats import ToolFormat, json_term


class KimiK2(ToolFormat):
    name = "kimi_k2"
    # The call's id is the model's own `functions.NAME:INDEX`, which the template renders.
    head = re.compile(
        r"(?P<id>functions\.(?P<name>[\w.\-]+?):\d+)\s*<\|tool_call_argument_begin\|>"
    )
    json_arguments = True
    has_grammar = True

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        opening = self.literal(f"<|tool_call_begin|>functions.{name}:")
        middle = self.literal("<|tool_call_argument_begin|>")
        closing = self.literal("<|tool_call_end|>")
        return [f"{rule}: {opening} /[0-9]{{1,4}}/ {middle} {json_term(parameters)} {closing}"]

    def calls_lines(self, functions: list, many: int, forced: bool) -> list[str]:
        lines = super().calls_lines(functions, many, forced)
        calls = f"call call{{0,{many - 1}}}" if many > 1 else "call"
        return [f"calls: {self.literal(self.start)} {calls} {self.literal(self.end)}", *lines[1:]]
