"""A reply's tool calls read as it streams, in the model's own format, the same way for
every API.

`ToolCallReader.feed` takes the reply's content (reasoning already split off) and
returns events: ("text", piece) for content, ("call", index, id, name) when a call's
name is known, ("arguments", index, piece) for its JSON arguments, ("done", index) when
it is whole. Each API turns them into its own deltas: `tool_calls` in chat chunks,
`function_call` items in Responses, `tool_use` blocks in Messages.

- Forced (`tool_choice` required, a named tool, Anthropic's `any`): the grammar fixes
  the text, so a call's name goes out once whole and its arguments as generated: JSON
  text as it comes, an XML format's parameters each as it closes.
- "auto": content streams until the format's start marker; from there the text is held
  until the call is whole, then read with the format's parser (mlx-lm's), its arguments
  coerced to the types the schema names, and sent whole. A call that does not parse, or
  names a function not offered, goes out as the text it was, never an error. A reply
  cut by max_tokens drops a call left open.

Plain Python: the API floor imports no MLX.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.api.reasoning import partial_tag
from server.api.structured import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """One reply's (one choice's) content, read into text and calls under `plan`."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.fmt = plan, plan.format
        self.pending = ""  # text not yet placed
        self.content = ""  # what went out as text
        self.calls: list[dict] = []  # OpenAI's tool_calls, as they stand
        self.open = False  # a forced call's arguments are streaming
        # A format with no head to stream from (marker-only grammars) reads a forced reply
        # as an auto one: whole calls between its markers.
        self.forced = plan.forced and plan.format.head is not None
        self.depth = 0
        self.in_string = self.escaped = False

    # ------------------------------------------------------------------ events

    def feed(self, text: str, final: bool = False, cut: bool = False) -> list[tuple]:
        self.pending += text
        events = self._forced(final) if self.forced else self._auto(final, cut)
        for e in events:
            if e[0] == "text":
                self.content += e[1]
        return events

    def result(self) -> tuple[list[dict], str | None] | None:
        """(the calls, the content beside them) once the reply is read; None: no calls."""
        if not self.calls:
            return None
        return self.calls, self.content.strip() or None

    def _new_call(self, name: str, given: str | None = None) -> tuple:
        """A call opens; `given`: the id the model wrote (Kimi's `functions.NAME:0`), kept
        so that the template renders the history back as the model wrote it."""
        self.calls.append({"id": given or call_id(), "type": "function",
                           "function": {"name": name, "arguments": ""}})  # fmt: skip
        return ("call", len(self.calls) - 1, self.calls[-1]["id"], name)

    def _arguments(self, piece: str) -> tuple:
        self.calls[-1]["function"]["arguments"] += piece
        return ("arguments", len(self.calls) - 1, piece)

    # ------------------------------------------------------------------ auto

    def _auto(self, final: bool, cut: bool) -> list[tuple]:
        fmt, out = self.fmt, []
        while self.pending:
            at = self.pending.find(fmt.start)
            if at < 0:
                keep = 0 if final else partial_tag(self.pending, fmt.start)
                out += self._text(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            out += self._text(self.pending[:at])
            self.pending = self.pending[at:]
            body_at = len(fmt.start)
            end = self.pending.find(fmt.end, body_at) if fmt.end else -1
            if end < 0 and not final:
                break  # the call is still being written
            if end < 0 and cut:
                self.pending = ""  # a call cut by max_tokens: dropped
                break
            stop = end if end >= 0 else len(self.pending)
            raw = self.pending[: stop + (len(fmt.end) if end >= 0 else 0)]
            calls = self._parsed(self.pending[body_at:stop])
            self.pending = self.pending[len(raw) :]
            if calls is None:
                out += self._text(raw)
                continue
            for name, arguments, given in calls:
                if self.calls and not self.plan.parallel:
                    break  # one call asked for: the rest are dropped
                out += [self._new_call(name, given), self._arguments(arguments)]
                out.append(("done", len(self.calls) - 1))
        return out

    def _text(self, piece: str) -> list[tuple]:
        """Content; whitespace right after a call waits to see if more calls follow."""
        if self.calls and not self.content.strip() and not piece.strip():
            return []
        return [("text", piece)] if piece else []

    def _parsed(self, body: str) -> list[tuple[str, str, str | None]] | None:
        """(name, JSON arguments, the model's id if it wrote one) per call in `body`; None
        when it is not calls of offered functions."""
        try:
            found = self.fmt.parse(body, self.plan.described)
        except Exception:  # noqa: BLE001 - a parser's error is the model's malformed call
            return None
        calls = []
        for call in found:
            name = call.get("name") if isinstance(call, dict) else None
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            if name not in self.plan.names or not isinstance(arguments, dict):
                return None
            schema = self.plan.parameters.get(name, {})
            given = call.get("id") if isinstance(call.get("id"), str) else None
            arguments = json.dumps(coerce(arguments, schema), ensure_ascii=False)
            calls.append((name, arguments, given))
        return calls or None

    # ------------------------------------------------------------------ forced

    def _forced(self, final: bool) -> list[tuple]:
        fmt, out = self.fmt, []
        while True:
            if not self.open:
                head = fmt.head.search(self.pending) if fmt.head else None
                if head is None:
                    break
                out.append(self._new_call(fmt.name_of(head), head.groupdict().get("id")))
                self.open, self.depth = True, 0
                self.in_string = self.escaped = False
                self.pending = self.pending[head.end() :]
                self.xml_count = self.xml_at = 0
            if fmt.json_arguments:
                n = self._scan_json()
                if n:
                    out.append(self._arguments(self.pending[:n]))
                self.pending = self.pending[n:]
                if self.depth is not None:
                    break
            else:
                out += self._xml_parameters()
                end = self.pending.find(fmt.end, self.xml_at)
                if end < 0:
                    break
                out.append(self._arguments("}" if self.xml_count else "{}"))
                self.pending = self.pending[end + len(fmt.end) :]
            out.append(("done", len(self.calls) - 1))
            self.open = False
        if final and self.open:  # cut by max_tokens: the arguments as far as they got
            out.append(("done", len(self.calls) - 1))
            self.open = False
        return out

    def _xml_parameters(self) -> list[tuple]:
        """A forced XML call's parameters whole so far, each the next piece of its JSON
        arguments, typed as the schema says (`{"city": "Oslo"`, then `, "days": 3`, ...)."""
        out = []
        schema = self.plan.parameters.get(self.calls[-1]["function"]["name"], {})
        for element in self.fmt.element.finditer(self.pending, self.xml_at):
            key, value = element.group("key"), self.fmt.value_of(element.group("value"))
            value = coerce({key: value}, schema)[key]
            lead = ", " if self.xml_count else "{"
            text = json.dumps(value, ensure_ascii=False)
            out.append(self._arguments(f"{lead}{json.dumps(key, ensure_ascii=False)}: {text}"))
            self.xml_count, self.xml_at = self.xml_count + 1, element.end()
        return out

    def _scan_json(self) -> int:
        """Characters of pending text that belong to the JSON arguments; depth None once
        they are whole."""
        n = 0
        for ch in self.pending:
            n += 1
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
                    return n
        return n


def coerce(arguments: dict, schema: dict) -> dict:
    """Top-level arguments as the schema types them: a parser that read text (XML formats)
    may leave "3" where the schema says integer, or 3 where it says string."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not properties:
        return arguments
    return {k: _as_type(v, properties.get(k)) for k, v in arguments.items()}


def _as_type(value: Any, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    if kind == "boolean" and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"  # JSON's, or Python's as Qwen3-Coder's template writes
    if isinstance(value, str) and kind in ("integer", "number", "object", "array"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        if kind == "integer" and isinstance(parsed, float) and parsed.is_integer():
            return int(parsed)
        return parsed
    return value
