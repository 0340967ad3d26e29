"""A Responses request, with the history of the chain it continues, as the engine's Turn.

Items become chat-template messages: `developer` and `instructions` as system messages,
a reply's `function_call` items as its assistant message's `tool_calls` (after its text,
if any), each `function_call_output` as a tool message answering a call the
conversation made, a `reasoning` item's text as `reasoning_content` of the reply it led
to (a template that thinks renders it where it keeps reasoning; others drop it).

Tools: functions, and a namespace's functions, are offered to the model, a namespace's
under "namespace.name" (the reply's call names the namespace apart, as Codex reads it:
`{"namespace": "ns", "name": "fn"}`); every other tool (web_search, file_search, mcp,
custom, ...) is one this server cannot run: left out and named in the reply's
X-Tools-Not-Offered header, never a failed request.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from server.api.common import temperature_or_default
from server.api.errors import APIError
from server.api.responses.protocol import (
    AdditionalToolsItem,
    AllowedTools,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputItem,
    ItemReference,
    MessageItem,
    NamespaceTool,
    OtherTool,
    ReasoningItem,
    ResponseCreate,
    TextFormat,
)
from server.api.structured import Function, template_call
from server.api.turns import Turn
from server.engine.jobs import SamplingParams

ITEMS = TypeAdapter(InputItem)
ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "additional_tools": "at",
}


def item_id(kind: str) -> str:
    return f"{ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex[:24]}"


@dataclass
class Offered:
    """The tools the model is offered, and those left out."""

    functions: list[Function] = field(default_factory=list)  # as the model sees them
    names: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # -> (ns, name)
    locations: list[str] = field(default_factory=list)  # each function's place in the request
    tools: list[dict] = field(default_factory=list)  # offered, as sent (the Response echoes them)
    left_out: list[str] = field(default_factory=list)  # "type" or "type:name"

    def add(self, tool: FunctionTool, where: str, namespace: str | None = None) -> None:
        name = f"{namespace}.{tool.name}" if namespace else tool.name
        if name in self.names:
            raise APIError(400, f"two tools are named {name!r}", param=where)
        self.functions.append(Function(name, tool.description, tool.schema()))
        self.names[name] = (namespace, tool.name)
        self.locations.append(f"{where}.parameters")


def offer(tool_lists: list[tuple[str, list]]) -> Offered:
    """The functions of (where, tools) lists: `tools` and each `additional_tools` item."""
    offered = Offered()
    for where, tools in tool_lists:
        for i, tool in enumerate(tools):
            at = f"{where}[{i}]"
            if isinstance(tool, FunctionTool):
                offered.add(tool, at)
            elif isinstance(tool, NamespaceTool):
                kept = []
                for j, member in enumerate(tool.tools):
                    if isinstance(member, FunctionTool):
                        offered.add(member, f"{at}.tools[{j}]", tool.name)
                        kept.append(member)
                    else:
                        offered.left_out.append(f"{tool.name}.{member.label()}")
                if not kept:
                    continue
                tool = tool.model_copy(update={"tools": kept})
            else:
                assert isinstance(tool, OtherTool)
                offered.left_out.append(tool.label())
                continue
            offered.tools.append(tool.model_dump(exclude_none=True))
    return offered


def tool_choice(body: ResponseCreate, offered: Offered) -> str:
    """The engine's tool_choice ("none", "auto", "required" or a function's offered name);
    `allowed_tools` narrows `offered` to its functions."""
    choice = body.tool_choice
    if isinstance(choice, str):
        if choice == "required" and not offered.functions:
            raise APIError(
                400, "tool_choice required needs a function in tools", param="tool_choice"
            )
        return choice
    if isinstance(choice, FunctionChoice):
        # a namespace's function by its own name too, where no other function has it
        bare = [name for name, (_, own) in offered.names.items() if own == choice.name]
        if choice.name not in offered.names and len(bare) == 1:
            return bare[0]
        if choice.name not in offered.names:
            raise APIError(
                400,
                f"tool_choice names {choice.name!r}, which is not in tools",
                param="tool_choice",
            )
        return choice.name
    if isinstance(choice, AllowedTools):
        allowed = {t.get("name") for t in choice.tools if t.get("type") == "function"}
        keep = [i for i, f in enumerate(offered.functions) if f.name in allowed]
        if not keep:
            raise APIError(
                400, "tool_choice allowed_tools names no function of tools", param="tool_choice"
            )
        offered.functions = [offered.functions[i] for i in keep]
        offered.locations = [offered.locations[i] for i in keep]
        return choice.mode
    raise APIError(
        400,
        f"tool_choice forces a {choice.type!r} tool, which this server does not run "
        "(it is left out of the tools)",
        param="tool_choice",
    )


def answer_schema(fmt: TextFormat) -> dict | None:
    if fmt.type == "text":
        return None
    return {"type": "object"} if fmt.type == "json_object" else fmt.schema_


# ------------------------------------------------------------------ items


def resolve(body: ResponseCreate, history: list[dict]) -> list:
    """The request's input items, each with an id (kept as given, or new), references
    resolved from the chain's history."""
    known = {item["id"]: item for item in history if "id" in item}
    items = []
    for i, item in enumerate(body.input):
        if isinstance(item, ItemReference):
            if item.id not in known:
                raise APIError(
                    400,
                    f"input[{i}] references item {item.id!r}, which is not in this "
                    "response's conversation",
                    param=f"input[{i}].id",
                )
            items.append(ITEMS.validate_python(known[item.id]))
            continue
        if getattr(item, "id", "") is None:
            item = item.model_copy(update={"id": item_id(item.type)})
        items.append(item)
    return items


def dumped(item) -> dict:
    """An item as stored and listed (GET .../input_items)."""
    out = item.model_dump(mode="json", exclude_none=True, by_alias=True)
    if out.get("type") == "message" and out.get("role") == "assistant":
        out.setdefault("status", "completed")  # an output message's status is required
    return out


def messages(instructions: str | None, items: list, first_new: int) -> list[dict]:
    """Chat-template messages from the conversation's items; items from `first_new` on
    are the request's (a 400 names their place)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    reasoning: list[str] = []  # reasoning waiting for the reply it led to

    def reply() -> dict:
        """The assistant message a call or a reasoning joins: the last one, if calls may
        still follow its text; else a new one."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if reasoning:
            out[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return out[-1]

    for n, item in enumerate(items):
        where = f"input[{n - first_new}]" if n >= first_new else "the conversation"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
            if role == "assistant":
                reply()  # takes the reasoning that led to it
        elif isinstance(item, ReasoningItem):
            reasoning.append(item.text())
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            if isinstance(item, FunctionCallItem):
                name = f"{item.namespace}.{item.name}" if item.namespace else item.name
                arguments = _json_or_text(item.arguments)
            else:
                name, arguments = item.name, {"input": item.input}
            entry = reply()
            entry.setdefault("tool_calls", []).append(template_call(item.call_id, name, arguments))
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            if item.call_id not in calls:
                raise APIError(
                    400,
                    f"{where} is a {item.type} for call_id {item.call_id!r}, which no call "
                    "before it in this conversation made",
                    param=f"{where}.call_id" if n >= first_new else "previous_response_id",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        # additional_tools items carry tools (offered with the rest), no message
    return out


def _json_or_text(arguments: str) -> Any:
    """A call's arguments as JSON values for the template, or the text if not JSON."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments


# ------------------------------------------------------------------ the Turn


@dataclass
class ResponsesTurn:
    turn: Turn
    items: list  # the request's input items, resolved and with ids
    offered: Offered

    def located(self, e: APIError) -> APIError:
        """An error the engine raised about function i, named where the request has it."""
        found = re.search(r"functions\[(\d+)\]\.parameters", e.param or "")
        if found is None:
            return e
        where = self.offered.locations[int(found.group(1))]
        message = e.message.replace(found.group(0), where)
        return APIError(e.status, message, e.code, where)


def responses_turn(
    body: ResponseCreate,
    history: list[dict],
    session_key: str | None,
    owner: str,
    default_temperature: float | None = None,
) -> ResponsesTurn:
    """The Turn of `body`, continuing the conversation `history` (stored items);
    `default_temperature` for a request that sends none (else OpenAI's 1.0)."""
    items = resolve(body, history)
    context = [ITEMS.validate_python(item) for item in history]
    extra = [
        (
            f"input[{i - len(context)}].tools" if i >= len(context) else "additional_tools",
            item.tools,
        )
        for i, item in enumerate([*context, *items])
        if isinstance(item, AdditionalToolsItem)
    ]
    offered = offer([("tools", body.tools), *extra])
    choice = tool_choice(body, offered)
    temperature = temperature_or_default(body.temperature, default_temperature)
    sampling = SamplingParams(
        max_tokens=0, temperature=temperature, top_p=body.top_p, speculation=body.speculation
    )
    fmt = body.text.format
    turn = Turn(
        model=body.model,
        messages=messages(body.instructions, [*context, *items], len(context)),
        sampling=sampling,
        max_tokens=body.max_output_tokens,
        functions=offered.functions,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        answer=answer_schema(fmt),
        thinking=body.thinking(),
        effort=body.reasoning.effort if body.reasoning else None,
        session_key=session_key,
        owner=owner,
        kv_cache=body.kv_cache,
        keep_alive=body.keep_alive,
        prompt_field="input",
        params={
            "parameters": "functions[{i}].parameters",
            "answer": "text.format.schema",
            "max_tokens": "max_output_tokens",
        },
    )
    return ResponsesTurn(turn, items, offered)
