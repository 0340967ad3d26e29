"""Tool-call formats: how a model writes a call, as its chat template taught it.

The format comes from the model: mlx-lm's tokenizer loader reads the chat template (and
the vocabulary) and names a parser in `mlx_lm/tool_parsers/` (`TokenizerWrapper.
tool_parser`, `tool_call_start`, `tool_call_end`); gpt-oss's Harmony is recognised by
its vocabulary, Llama 3's bare JSON by its template (mlx-lm has no parser for either).
`format_for` turns that into a `ToolFormat`: mlx-lm's own parser reads
a call back, and the format adds what a server needs beyond it: the Lark grammar of a
forced call in the model's own words (`call_rule`), and where a forced call's name and
JSON arguments begin, so they stream as they are generated (`head`). A template that
renders no tools gets `PromptedJSON`: the tools described in a system message and the
Hermes convention, as before formats were read from the model.

One format per module, each a subclass with its markers and rules; a format with no
grammar of its own here still parses (a forced call then gets the marker and free text
in between, parsed back like an auto one). Plain Python: the API floor imports no MLX
(the parser function arrives from the engine, which loaded mlx-lm).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger("h2o_server.tool_formats")

# Replies look like OpenAI's: ", " and ": " between items, no other whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Parser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools)


class ToolFormat:
    """One family's tool calls. `start` opens a reply's calls, `end` closes one ("": the
    call runs to the reply's end); what lies between is `parse`d (mlx-lm's parser)."""

    name = "generic"
    native = True  # the template renders `tools` and earlier calls itself
    separator = "\n"  # between a forced reply's calls
    head: re.Pattern | None = None  # a forced call's name (group "name"); its end: where
    json_arguments = False  # ... the JSON arguments start, when they are JSON text
    has_grammar = False
    element: re.Pattern | None = None  # XML formats: one parameter (groups key, value)

    def value_of(self, text: str) -> str:
        """An XML parameter's value as the parser reads it (Qwen3-Coder: one newline off
        each end)."""
        return text

    def __init__(self, parser: Parser | None, start: str, end: str, specials: dict[str, int]):
        self.parser, self.start, self.end = parser, start, end
        self.specials = specials  # special tokens' text -> id: grammars name them by id

    def __repr__(self) -> str:
        return f"{self.name} ({self.start!r}...{self.end!r})"

    def configure(self, template: str) -> None:
        """Details the chat template settles (Mistral's two call shapes, GLM's spacing)."""

    # ------------------------------------------------------------------ reading

    def parse(self, body: str, tools: list[dict]) -> list[dict]:
        """The calls ({"name", "arguments"}) in the text between the markers; raises
        ValueError (or whatever the parser raises) when it is not a call."""
        if self.parser is None:
            raise ValueError("no parser")
        found = self.parser(body, tools)
        return found if isinstance(found, list) else [found]

    # ------------------------------------------------------------------ grammar

    def answer_prefix(self) -> str:
        """What the model writes before an answer's text (Harmony's final channel)."""
        return ""

    def literal(self, text: str) -> str:
        """A Lark term for fixed text: a special token by its id (llguidance matches
        special tokens only so), the rest as quoted strings."""
        if not text:
            return '""'
        names = sorted(self.specials, key=len, reverse=True)
        if not names:
            return json.dumps(text, ensure_ascii=False)
        pattern = "(" + "|".join(re.escape(n) for n in names) + ")"
        terms = []
        for part in re.split(pattern, text):
            if part in self.specials:
                terms.append(f"<[{self.specials[part]}]>")
            elif part:
                terms.append(json.dumps(part, ensure_ascii=False))
        return " ".join(terms)

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        """Lark lines defining `rule`: one call of `name` whose arguments follow
        `parameters` (a closed JSON schema), wrapper included. The base: the start marker,
        then text the parser reads back, up to the end marker."""
        if self.end in self.specials:  # any tokens but it, special ones too (Gemma 4's <|"|>)
            end = self.specials[self.end]
            return [f"{rule}: {self.literal(self.start)} <[^{end}]>* <[{end}]>"]
        text, lines = self.text_until(self.end, f"{rule}_text")
        return [f"{rule}: {self.literal(self.start)} {text}", *lines]

    def text_until(self, closer: str, rule: str, span: str = "*") -> tuple[str, list[str]]:
        """(a Lark term for text of `span` characters then `closer`, the lines it needs).
        llguidance lexes greedily, so text and a closer spelled in text are one lexeme:
        whatever ends with the closer and holds it nowhere else. A closer that is a special
        token cannot be spelled by text: there the text is anything before it."""
        if not closer:
            return f"/(?s:.{span})/", []
        if any(s in closer for s in self.specials):
            return rule, [f"{rule}: /(?s:.{span})/ {self.literal(closer.lstrip())}"]
        c = re.escape(closer).replace("\\\n", "\\n").replace("/", "\\/")
        token = rule.upper()
        return token, [f"{token}: /(?s:.{span}{c})/ & ~/(?s:.*{c}.+)/"]

    def calls_lines(self, functions: list, many: int, forced: bool) -> list[str]:
        """Lark lines for `calls`: a call of one of `functions` (each with .name and
        .parameters, a closed object schema), up to `many` of them."""
        lines, rules = [], []
        for i, function in enumerate(functions):
            rules.append(f"call{i}")
            lines += self.call_rule(function.name, function.parameters, f"call{i}")
        more = f" ({self.literal(self.separator)}? call){{0,{many - 1}}}" if many > 1 else ""
        return [f"calls: call{more}", f"call: {' | '.join(rules)}", *lines]

    def name_of(self, match: re.Match) -> str:
        """The function name a `head` match holds."""
        return match.group("name")


def json_term(schema: dict, lenient: bool = True) -> str:
    """A Lark term for JSON text valid against `schema` (llguidance's %json)."""
    options = {**JSON_OPTIONS, "lenient": lenient}
    return f"%json {json.dumps({**schema, 'x-guidance': options})}"


def special_tokens(hf_tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens (text -> id), which a grammar names by id."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    return {t.content: i for i, t in decoder.items() if getattr(t, "special", False)}


def format_for(tokenizer) -> ToolFormat:
    """The tool format of a loaded model (mlx-lm's TokenizerWrapper)."""
    from server.api.tool_formats.harmony import Harmony, is_harmony
    from server.api.tool_formats.llama3_json import Llama3JSON, is_llama3_json
    from server.api.tool_formats.prompted import PromptedJSON

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    specials = special_tokens(hf)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    if is_harmony(specials):
        return Harmony(None, Harmony.start, "", specials)
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None and "tools" in template and is_llama3_json(template):
        return Llama3JSON(None, "", "", specials)
    if parser is None or "tools" not in template:
        return PromptedJSON(None, "<tool_call>", "</tool_call>", specials)
    name = parser.__module__.rsplit(".", 1)[-1]
    kind = _formats().get(name, ToolFormat)
    fmt = kind(parser, tokenizer.tool_call_start or "", tokenizer.tool_call_end or "", specials)
    fmt.configure(template)
    if kind is ToolFormat:
        fmt.name = name
    return fmt


def _formats() -> dict[str, type[ToolFormat]]:
    from server.api.tool_formats.glm47 import GLM47
    from server.api.tool_formats.hermes import HermesJSON
    from server.api.tool_formats.kimi_k2 import KimiK2
    from server.api.tool_formats.mistral import Mistral
    from server.api.tool_formats.qwen3_coder import Qwen3Coder

    return {f.name: f for f in (HermesJSON, Qwen3Coder, GLM47, Mistral, KimiK2)}
