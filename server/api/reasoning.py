"""A thinking model's reply, split into its reasoning and its content as it streams.

Templates that think (Qwen3's `<think>...</think>`, DeepSeek-R1's) have the model open
its reply with a thinking block, or open it themselves at the end of the prompt. The
tags come from the tokenizer (mlx-lm's TokenizerWrapper: `think_start`, `think_end`);
each API sends the reasoning apart: `reasoning_content` in chat completions, `reasoning`
items in Responses, `thinking` blocks in Messages. Text that could still become a tag
is held back until it cannot. Plain Python: the API floor imports no MLX.
"""

from __future__ import annotations

REASONING, CONTENT = "reasoning", "content"


class ThinkingSplit:
    """Feeds a reply's text; returns (kind, text) pieces in order, kind REASONING or
    CONTENT. `opened`: the prompt ends inside a thinking block (the template opened it)."""

    def __init__(self, start: str, end: str, opened: bool = False):
        self.start, self.end = start, end
        self.state = REASONING if opened else "before"  # before: the reply may open one
        self.pending = ""  # text not yet placed: part of a tag, or leading whitespace
        self.reasoning_deltas = 0  # deltas that were (partly) reasoning: reasoning tokens

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        was_reasoning = self.state != CONTENT and (
            self.state == REASONING or self.start in (self.pending + text)
        )
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "before":
                head = self.pending.lstrip()
                if head.startswith(self.start):
                    self.state, self.pending = REASONING, head[len(self.start) :].lstrip("\n")
                    continue
                if (self.start.startswith(head) and not final) or (not head and not final):
                    break  # may still open (or nothing but whitespace yet)
                self.state = CONTENT
                continue
            if self.state == REASONING:
                at = self.pending.find(self.end)
                if at >= 0:
                    out.append((REASONING, self.pending[:at]))
                    self.state, self.pending = "after", self.pending[at + len(self.end) :]
                    continue
                keep = 0 if final else partial_tag(self.pending, self.end)
                out.append((REASONING, self.pending[: len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep :]
                break
            if self.state == "after":  # the blank lines between reasoning and content
                stripped = self.pending.lstrip()
                if not stripped and not final:
                    break
                self.state, self.pending = CONTENT, stripped
                continue
            out.append((CONTENT, self.pending))
            self.pending = ""
            break
        if was_reasoning:
            self.reasoning_deltas += 1
        return [(kind, piece) for kind, piece in out if piece]


def partial_tag(text: str, tag: str) -> int:
    """Characters at the end of `text` that begin `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def opened_in_prompt(prompt_tail: str, start: str, end: str) -> bool:
    """Whether a prompt's last text leaves a thinking block open (the template opened it)."""
    at = prompt_tail.rfind(start)
    return at >= 0 and prompt_tail.find(end, at) < 0
