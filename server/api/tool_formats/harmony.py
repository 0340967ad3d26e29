"""gpt-oss's Harmony: the reply is messages on channels, each
`<|channel|>NAME[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` and an end
(`<|end|>`, or `<|call|>` / `<|return|>`, which end generation), the next one opened by
`<|start|>assistant`. `analysis` is reasoning, `final` the answer, and a `commentary`
message to `functions.NAME` a call with JSON arguments.

mlx-lm has no Harmony parser, and openai-harmony reads the reply's token ids through an
encoding it downloads on first use (no network here or on many users' machines); the
channel markers are special tokens the detokenizer spells out, so the text alone says
it all. `HarmonySplit` turns the messages into the reasoning and content pieces the
thinking splitter gives (server/api/reasoning.py); a call comes out as content in one
normalized form, `to=functions.NAME<|message|>{...}<|call|>`, which `Harmony` reads.
"""

from __future__ import annotations

import json
import re

from server.api.reasoning import CONTENT, REASONING, partial_tag
from server.api.tool_formats import ToolFormat, json_term

MARKERS = ("<|channel|>", "<|message|>", "<|constrain|>", "<|call|>")
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
CALL = "<|call|>"


def is_harmony(specials: dict[str, int]) -> bool:
    return all(m in specials for m in MARKERS)


class Harmony(ToolFormat):
    name = "harmony"
    start = "to=functions."
    head = re.compile(r"to=functions\.(?P<name>[^<\s]+)<\|message\|>")
    json_arguments = True
    has_grammar = True

    def __init__(self, parser, start: str, end: str, specials: dict[str, int]):
        super().__init__(parser, self.start, CALL, specials)

    def parse(self, body: str, tools: list[dict]) -> list[dict]:
        name, _, arguments = body.partition("<|message|>")
        return [{"name": name.strip(), "arguments": json.loads(arguments)}]

    def call_rule(self, name: str, parameters: dict, rule: str) -> list[str]:
        header = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        return [f"{rule}: {self.literal(header)} {json_term(parameters)}"]

    def calls_lines(self, functions: list, many: int, forced: bool) -> list[str]:
        return super().calls_lines(functions, 1, forced)  # <|call|> ends generation

    def answer_prefix(self) -> str:
        return "<|channel|>final<|message|>"


class HarmonySplit:
    """A Harmony reply's messages as (kind, text) pieces, as ThinkingSplit gives them."""

    def __init__(self):
        self.pending = ""
        self.kind: str | None = None  # the open message's: REASONING, CONTENT, "call"
        self.reasoning_deltas = 0

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while self.pending:
            if self.kind is None:
                if not self._header(out, final):
                    break
                continue
            at = min((i for e in ENDS if (i := self.pending.find(e)) >= 0), default=-1)
            if at < 0:
                keep = 0 if final else max(partial_tag(self.pending, e) for e in ENDS)
                self._emit(out, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            self._emit(out, self.pending[:at])
            end = next(e for e in ENDS if self.pending.startswith(e, at))
            self.pending = self.pending[at + (0 if end == "<|start|>" else len(end)) :]
            self._close(out)
        if final and self.kind is not None:
            self._close(out)
        if any(kind == REASONING for kind, _ in out):
            self.reasoning_deltas += 1
        return [(kind, piece) for kind, piece in out if piece]

    def _header(self, out: list, final: bool) -> bool:
        """Reads a message's header once it is whole; False: wait for more text."""
        head = self.pending.lstrip()
        if not head.startswith("<|") and not "<|".startswith(head):
            self.kind, self.pending = CONTENT, head  # text outside any channel
            return True
        at = head.find("<|message|>")
        if at < 0:
            if final:
                self.pending = ""
            return False
        header, self.pending = head[:at], head[at + len("<|message|>") :]
        recipient = re.search(r"to=(\S+?)(?=\s|<\||$)", header)
        channel = re.search(r"<\|channel\|>(\w+)", header)
        if recipient and recipient.group(1).startswith("functions."):
            self.kind = "call"
            out.append((CONTENT, f"to={recipient.group(1)}<|message|>"))
        elif channel and channel.group(1) == "analysis":
            self.kind = REASONING
        else:
            self.kind = CONTENT
        return True

    def _emit(self, out: list, piece: str) -> None:
        out.append((REASONING if self.kind == REASONING else CONTENT, piece))

    def _close(self, out: list) -> None:
        if self.kind == "call":
            out.append((CONTENT, CALL))
        self.kind = None
