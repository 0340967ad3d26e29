"""Structured outputs and tool calls: the grammar a request's reply must follow, the tools
rendered into its prompt, and the tool calls parsed back out of the reply.

The grammar engine is llguidance: it compiles a JSON schema (or Lark) once per request
and, per step, computes the set of allowed next tokens on the host in about a
millisecond from the tokenizer's own vocabulary, with no torch and no GPU code
(server/engine/grammar.py applies it to MLX logits). xgrammar's mask path needs torch;
outlines-core compiles a schema to a token-level automaton up front, which is slower
for large vocabularies and schemas. Plain Python here: the API floor imports no MLX.

Tool calls are written in the model's own format (server/api/tool_formats, chosen from
its chat template): tools reach the model through the template's `tools` (or, where it
has none, a system message), and with `tool_choice` "required" or one named function
the reply is constrained to that format's wrapper around arguments valid against the
function's schema. Reading calls back is server/api/tool_calls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from llguidance import LLMatcher

from server.api.errors import APIError
from server.api.tool_formats import JSON_OPTIONS, ToolFormat
from server.api.tool_formats.prompted import MAX_PARALLEL_CALLS, TOOLS_INTRO


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
    """How the reply may call tools: `forced` (its whole text is calls, the grammar's
    shape) or not (calls may follow text, in the model's format)."""

    forced: bool
    format: ToolFormat
    functions: list[Function] = field(default_factory=list)
    parallel: bool = True  # False: an auto reply's first call only

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}

    @property
    def parameters(self) -> dict[str, dict]:
        return {f.name: f.parameters for f in self.functions}

    @property
    def described(self) -> list[dict]:
        """The tools as mlx-lm's parsers take them (OpenAI's shape)."""
        return [{"type": "function", "function": f.described()} for f in self.functions]


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
    fmt: ToolFormat,
    param: str = "tools[{i}].parameters",
    answer_param: str = "text.format",
) -> tuple[str | None, ToolPlan | None]:
    """The grammar of a reply that may call `functions` under `choice` ("none", "auto",
    "required" or a function's name) in the model's format `fmt`, and answers in `answer`
    (a JSON schema; None: free text); and how it calls tools.

    "auto" with an answer schema: one grammar admits either calls in the model's format
    or the schema's JSON. A forced choice: the reply is the calls; the answer schema
    shapes a later, final turn.
    """
    for i, function in enumerate(functions):  # every function's schema, named on error
        compile_schema(closed(function.parameters), param.format(i=i), lenient=True)
    answer_grammar = None if answer is None else compile_schema(closed(answer), answer_param)
    if answer_grammar is not None and fmt.answer_prefix():
        answer_grammar = _compile_lark(
            f"start: {fmt.literal(fmt.answer_prefix())} {_json(closed(answer))}", answer_param
        )
    if not functions or choice == "none":
        return answer_grammar, None
    plan = ToolPlan(False, fmt, list(functions), parallel)
    typed = [replace(f, parameters={**closed(f.parameters), "type": "object"}) for f in functions]
    if choice == "auto":
        if answer is None:
            return None, plan
        answer_term = f"{fmt.literal(fmt.answer_prefix())} {_json(closed(answer))}"
        many = MAX_PARALLEL_CALLS if parallel else 1
        lark = ["start: calls | answer", *fmt.calls_lines(typed, many, False)]
        return _compile_lark("\n".join([*lark, f"answer: {answer_term}"]), answer_param), plan
    forced = [f for f in typed if choice in ("required", f.name)]
    many = MAX_PARALLEL_CALLS if parallel and choice == "required" and len(forced) > 1 else 1
    grammar = _compile_lark(
        "\n".join(["start: calls", *fmt.calls_lines(forced, many, True)]), "tools"
    )
    return grammar, replace(plan, forced=True)


def _json(schema: dict, lenient: bool = False) -> str:
    """A schema embedded in a Lark grammar, carrying the JSON options itself."""
    return f"%json {json.dumps({**schema, 'x-guidance': {**JSON_OPTIONS, 'lenient': lenient}})}"


def _compile_lark(lark: str, param: str) -> str:
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise APIError(
            400, f"{param}: the grammar engine cannot use it: {e}", param=param
        ) from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    # Tools' schemas are lenient; special tokens (<[id]>) are checked against the
    # vocabulary when the request's matcher is made (server/engine/grammar.py).
    messages = [m for m in messages if not m.startswith(("Unimplemented keys", "no tokenizer"))]
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
    messages: list[dict], functions: list[Function], fmt: ToolFormat
) -> tuple[list[dict], list | None]:
    """(the messages for the chat template, the `tools` argument it takes or None), from
    chat-template messages whose earlier calls are `tool_calls` entries ({"id", "type",
    "function": {"name", "arguments": JSON values}}).

    A format the template renders (`fmt.native`) gets the tools and the calls as the
    template takes them; else the tools go into a system message and earlier calls into
    their assistant turn's text (PromptedJSON).
    """
    template_tools = fmt.native
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
        rendered.append(f"<tool_call>{json.dumps(call)}</tool_call>")
    entry = {k: v for k, v in message.items() if k != "tool_calls"}
    entry["content"] = "\n".join([text] * bool(text) + rendered)
    return entry


def template_call(call_id: str, name: str, arguments: Any) -> dict:
    """An earlier call as chat templates take it (arguments as JSON values)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
