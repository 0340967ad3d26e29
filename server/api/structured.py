"""Structured outputs and tool calls: the grammar a request's reply must follow, the tools
rendered into its prompt, and the tool calls parsed back out of the reply.

The grammar engine is llguidance: it compiles a JSON schema (or Lark) once per request
and, per step, computes the set of allowed next tokens on the host in about a
millisecond from the tokenizer's own vocabulary, with no torch and no GPU code
(server/engine/grammar.py applies it to MLX logits). xgrammar's mask path needs torch;
outlines-core compiles a schema to a token-level automaton up front, which is slower
for large vocabularies and schemas. Plain Python here: the API floor imports no MLX.

Tool calls follow the Hermes/Qwen convention `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`: a template without a tools section gets the tools described in a
system message (`TOOLS_INTRO`), and earlier calls in the history are rendered in that
form. With `tool_choice` "required" or one named function, the reply is constrained to
the call's JSON (an array of calls when `parallel_tool_calls`), its arguments valid
against the function's schema; with "auto" a reply that starts with `<tool_call>` is a
call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

from server.api.errors import APIError

# Replies look like OpenAI's: ", " and ": " between items, no other whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 4  # a forced reply's calls at most (a bounded grammar)
TOOLS_INTRO = (
    "You can call these functions. To call one, reply with only "
    f'{CALL_OPEN}{{"name": <function name>, "arguments": <JSON object>}}{CALL_CLOSE} '
    "(several calls: one after another). The functions:"
)


@dataclass
class Function:
    """A function the reply may call, from any API's tool list."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: {"type": "object"})

    def described(self) -> dict:
        """As a chat template's `tools` and the tools system message show it."""
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        return {**out, "parameters": self.parameters}


@dataclass
class ToolPlan:
    """How the reply may call tools: `forced` (its whole text is the calls' JSON) or not
    (a reply that starts with CALL_OPEN carries calls)."""

    forced: bool
    names: set[str] = field(default_factory=set)


def compile_schema(schema: Any, param: str, lenient: bool = False) -> str:
    """The llguidance grammar of a JSON schema; a 400 naming `param` and the part the engine
    cannot use. `lenient`: keywords the engine does not implement are ignored (a tool's
    parameters: agents' schemas carry `propertyNames` and the like, and a call is
    checked by the tool itself), so what it generates may break them."""
    options = {**JSON_OPTIONS, "lenient": True} if lenient else JSON_OPTIONS
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{param} is not a JSON schema: {e}", param=param) from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if lenient:
        messages = [m for m in messages if not m.startswith("Unimplemented keys")]
    if failed or messages:
        why = "; ".join(messages)
        raise APIError(
            400, f"{param}: the grammar engine cannot use this schema: {why}", param=param
        )
    return grammar


def shape_grammar(
    functions: list,
    choice: str,
    parallel: bool,
    answer: dict | None,
    param: str = "tools[{i}].parameters",
    answer_param: str = "text.format",
) -> tuple[str | None, ToolPlan | None]:
    """The grammar of a reply that may call `functions` (each with .name and
    .parameters) under `choice` ("none", "auto", "required" or a function's name) and
    answers in `answer` (a JSON schema; None: free text); and how it calls tools.

    "auto" with an answer schema: the reply is either calls or the schema's JSON. A
    forced choice: the reply is the call; the answer schema shapes a later, final turn.
    """
    for i, function in enumerate(functions):  # every function's schema, named on error
        compile_schema(closed(function.parameters), param.format(i=i), lenient=True)
    answer_grammar = None if answer is None else compile_schema(closed(answer), answer_param)
    if not functions or choice == "none":
        return answer_grammar, None
    names = {f.name for f in functions}
    if choice == "auto":
        if answer is None:
            return None, ToolPlan(False, names)
        calls = _calls_schema(functions, many=False)
        more = f"~0..{MAX_PARALLEL_CALLS - 1}" if parallel else "~0..0"
        lark = "\n".join(
            [
                "start: calls | answer",
                f'calls: block ("\\n"? block){more}',
                f'block: "{CALL_OPEN}" call "{CALL_CLOSE}"',
                f"call: %json {json.dumps(_with_options(calls, lenient=True))}",
                f"answer: %json {json.dumps(_with_options(closed(answer)))}",
            ]
        )
        return _compile_lark(lark, answer_param), ToolPlan(False, names)
    forced = [f for f in functions if choice in ("required", f.name)]
    many = parallel and choice == "required" and len(forced) > 1
    grammar = compile_schema(_calls_schema(forced, many), "tools", lenient=True)
    return grammar, ToolPlan(True, names)


def _calls_schema(functions: list, many: bool) -> dict:
    """A call of one of `functions` (an array of up to MAX_PARALLEL_CALLS when `many`),
    each function's arguments at `$defs` f{i}."""
    calls = [_call_schema(f.name, i) for i, f in enumerate(functions)]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = (
        {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        if many
        else one
    )
    defs = {f"f{i}": _arguments_schema(f.parameters, i) for i, f in enumerate(functions)}
    return {**schema, "$defs": defs}


def _with_options(schema: dict, lenient: bool = False) -> dict:
    """A schema embedded in a Lark grammar carries the JSON options itself."""
    return {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": lenient}}


def _compile_lark(lark: str, param: str) -> str:
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise APIError(
            400, f"{param}: the grammar engine cannot use it: {e}", param=param
        ) from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    messages = [m for m in messages if not m.startswith("Unimplemented keys")]  # tools' (lenient)
    if failed or messages:
        why = "; ".join(messages)
        raise APIError(400, f"{param}: the grammar engine cannot use it: {why}", param=param)
    return grammar


def closed(schema: Any) -> Any:
    """`schema` with every object that names its properties closed to other keys
    (`additionalProperties: false`) unless it gives extra keys a schema of its own.

    JSON Schema leaves objects open by default, and a small model fills an open object
    with made-up keys (schema words copied in as keys) until max_tokens. What the
    grammar generates still validates against the schema as written. An object composed
    with others (`allOf`, a `$ref` beside its properties, ...) stays open, and so do the
    branches of an `allOf`: each names only part of the object's keys.
    """
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_closed_inside(v) for v in value]
        elif key in _VALUES:
            out[key] = value
        else:
            out[key] = closed(value)
    opens = schema.get("additionalProperties", True) is True
    if "properties" in schema and opens and not any(k in schema for k in _COMPOSED):
        out["additionalProperties"] = False
    return out


# Keys that give an object more properties than its own `properties` name.
_COMPOSED = ("patternProperties", "allOf", "anyOf", "oneOf", "$ref", "unevaluatedProperties")


def _closed_inside(schema: Any) -> Any:
    """An allOf branch: its own keys left open, the objects inside it closed."""
    if not isinstance(schema, dict):
        return schema
    inner = closed(schema)
    if "additionalProperties" not in schema:
        inner.pop("additionalProperties", None)
    return inner


def _call_schema(name: str, i: int) -> dict:
    """One call of forced function i: its name, then its arguments (`$defs` f{i})."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/f{i}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _arguments_schema(parameters: dict, i: int) -> dict:
    """Function i's parameters where the call schema keeps them, at `#/$defs/f{i}`: its
    local `$ref`s re-pointed there (pydantic's `#/$defs/...` and a recursive `#`
    would otherwise resolve against the call schema), and typed object (a schema
    without a type, e.g. {}, would let the arguments be any JSON value)."""
    return {**_repointed(closed(parameters), f"#/$defs/f{i}"), "type": "object"}


def _repointed(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` pointer ("#", "#/...") resolved from `root`."""
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
        elif key in _VALUES:
            out[key] = value
        else:
            out[key] = _repointed(value, root)
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples")


# ---------------------------------------------------------------------- prompt


ANSWER_FORMAT = "Answer format: a JSON object of this schema: {schema}"


def answer_hint(functions: list, choice: str, answer: dict | None) -> dict | None:
    """The system message that closes the prompt when the reply may be calls or an answer
    of a schema (tools under "auto" with a response format): the model is told the
    answer's format, as OpenAI's own models are, where it has to choose. Stated last,
    after the tools' results: a small model told only at the top calls the same function
    again and again (the default model after a result: the call's first token 4.1 nats
    likelier than the answer's; with this message the answer's 3.9 nats likelier; in the
    system message at the top, still the call's). None otherwise."""
    if answer is None or not functions or choice != "auto":
        return None
    return {"role": "system", "content": ANSWER_FORMAT.format(schema=json.dumps(answer))}


def render_tools(
    messages: list[dict], functions: list[Function], template_tools: bool
) -> tuple[list[dict], list | None]:
    """(the messages for the chat template, the `tools` argument it takes or None), from
    chat-template messages whose earlier calls are `tool_calls` entries ({"id", "type",
    "function": {"name", "arguments": JSON values}}).

    `template_tools`: the template has a tools section; else the tools go into a system
    message and earlier calls into their assistant turn's text.
    """
    if not template_tools:
        messages = [_calls_as_text(m) for m in messages]
    if not functions:
        return messages, None
    tools = [{"type": "function", "function": f.described()} for f in functions]
    if template_tools:
        return messages, tools
    described = "\n".join(json.dumps(t["function"]) for t in tools)
    intro = f"{TOOLS_INTRO}\n{described}"
    if messages and messages[0]["role"] == "system":
        messages = [
            {**messages[0], "content": f"{messages[0]['content']}\n\n{intro}"},
            *messages[1:],
        ]
    else:
        messages = [{"role": "system", "content": intro}, *messages]
    return messages, None


def _calls_as_text(message: dict) -> dict:
    """An assistant turn's calls in its text, as a template without tools shows them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = message.get("content") or ""
    rendered = []
    for c in calls:
        call = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        rendered.append(f"{CALL_OPEN}{json.dumps(call)}{CALL_CLOSE}")
    entry = {k: v for k, v in message.items() if k != "tool_calls"}
    entry["content"] = "\n".join([text] * bool(text) + rendered)
    return entry


def template_call(call_id: str, name: str, arguments: Any) -> dict:
    """An earlier call as chat templates take it (arguments as JSON values)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------- reply


def parse_calls(
    text: str, plan: ToolPlan, cut: bool = False
) -> tuple[list[dict], str | None] | None:
    """(tool calls as OpenAI's message.tool_calls, the content left) from a reply's text;
    None when the reply calls nothing (or its calls do not parse). `cut`: the reply ran
    into max_tokens, so a call left open at its end is dropped."""
    if cut and not plan.forced and text.rfind(CALL_OPEN) > text.rfind(CALL_CLOSE):
        text = text[: text.rfind(CALL_OPEN)]
    if plan.forced:
        try:
            found = json.loads(text)
        except json.JSONDecodeError:
            return None
        found, rest = (found if isinstance(found, list) else [found]), None
    else:
        if not text.lstrip().startswith(CALL_OPEN):
            return None
        pattern = re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE)
        found = []
        for body in re.findall(pattern, text, flags=re.S):
            try:
                found.append(json.loads(body))
            except json.JSONDecodeError:
                return None
        rest = re.sub(pattern, "", text, flags=re.S).strip() or None
    calls = []
    for call in found:
        if not isinstance(call, dict) or call.get("name") not in plan.names:
            return None
        calls.append(tool_call(call["name"], json.dumps(call.get("arguments", {}))))
    return (calls, rest) if calls else None


def partial_calls(text: str) -> tuple[list[dict], None] | None:
    """The calls of a forced reply cut short (max_tokens), arguments as far as they got;
    None when not even the first call's name is whole."""
    calls: list[dict] = []
    for delta in CallStream().feed(text):
        if "id" in delta:
            calls.append(tool_call(delta["function"]["name"], ""))
        else:
            calls[-1]["function"]["arguments"] += delta["function"]["arguments"]
    return (calls, None) if calls else None


def tool_call(name: str, arguments: str) -> dict:
    """One call as OpenAI's `tool_calls` carry it, with a new id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


CALL_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


class CallStream:
    """A forced reply's calls as they are generated, as OpenAI streams them: per call, its
    index, id and name once the name is whole, then its arguments in fragments.

    The grammar fixes the text's shape (JSON_OPTIONS, "name" before "arguments"), so a
    call starts at CALL_HEAD and its arguments end where their braces balance.
    """

    def __init__(self):
        self.index = -1  # the call being streamed
        self.at = 0  # where the text is read up to
        self.depth = None  # brace depth inside the arguments; None: between calls
        self.in_string = self.escaped = False

    def feed(self, text: str) -> list[dict]:
        """The tool_call deltas that `text` (the whole reply so far) adds."""
        deltas: list[dict] = []
        while self.at < len(text):
            if self.depth is None:
                head = CALL_HEAD.search(text, self.at)
                if head is None:
                    break
                self.index += 1
                self.at, self.depth = head.end(), 0
                name = json.loads(f'"{head.group(1)}"')
                deltas.append({"index": self.index, **tool_call(name, "")})
                continue
            start = self.at
            while self.at < len(text) and self.depth is not None:
                self._scan(text[self.at])
                self.at += 1
            deltas.append({"index": self.index, "function": {"arguments": text[start : self.at]}})
        return deltas

    def _scan(self, ch: str) -> None:
        """One character of the arguments; depth None once they are whole."""
        if self.escaped:
            self.escaped = False
        elif self.in_string:
            self.escaped = ch == "\\"
            self.in_string = ch != '"'
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.depth = None


def may_become_call(text: str) -> bool:
    """Whether an "auto" reply's text so far could still be a tool call (held back)."""
    head = text.lstrip()
    return head.startswith(CALL_OPEN) or CALL_OPEN.startswith(head)
