"""A reply's text, token by token, exactly as the tokens spell it after their prompt.

mlx-lm's streaming detokenizers drop the first token's leading space (a reply decoded
on its own), so a completion of "The capital of France is" read "Paris." for the tokens
" Paris", "."; a client that appends the reply to its prompt got "isParis". Here each
piece is the text a token adds to the ones before it, the prompt's last tokens
included: decode(before + new) minus decode(before), as vLLM's incremental
detokenizer does, which is right for byte-level BPE and SentencePiece alike (a
SentencePiece token's "▁" is a space only after another token). Bytes of a character
split over tokens wait for the rest. Plain Python: the API floor uses it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT = 4  # prompt tokens decoded before the reply's first (a few settle its first piece)
INCOMPLETE = "\ufffd"  # what a decoder makes of a character's first bytes alone


def decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """Token ids -> text, special tokens spelled out, no clean-up of spaces."""

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)

    return decode


class IncrementalText:
    """The text each new token adds, after `context` (tokens never part of the output)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
        self.decode = decode
        self.ids = list(context[-CONTEXT:])
        self.prefix = 0  # ids[prefix:read]: the last decoded window, already sent
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        """The text `token` completes (empty while a character's bytes are incomplete)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left of an incomplete character at the end of the reply."""
        return self._advance(final=True) if self.read < len(self.ids) else ""

    def _advance(self, final: bool) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if not final and after.endswith(INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


def piece(decode: Callable[[Sequence[int]], str], before: int | None, token: int) -> str:
    """The text `token` adds after token `before` (None: at the start of the text)."""
    if before is None:
        return decode([token])
    return decode([before, token])[len(decode([before])) :]
