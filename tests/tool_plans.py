"""Tool plans for reply tests: functions by name, in the format of a template without a
tools section (the default model's)."""

from __future__ import annotations

from server.api.structured import Function, ToolPlan
from server.api.tool_formats.prompted import PromptedJSON

PROMPTED = PromptedJSON(None, "<tool_call>", "</tool_call>", {})


def prompted_plan(forced: bool, names, parallel: bool = True) -> ToolPlan:
    return ToolPlan(forced, PROMPTED, [Function(n) for n in names], parallel)
