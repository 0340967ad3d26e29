"""Constrained decoding: llguidance's token mask applied to a generation's logits.

server/api/structured.py turns a request's `response_format` or forced tool call into
a grammar; each constrained Generation holds a `Constraint`, a matcher over the model's
vocabulary that advances with every token the reply takes. Its mask is computed on the
host while the step's forward pass runs (server/engine/batcher.py launches the pass
before it samples) and applied before sampling, so penalties, logit bias, temperature
and seeds work as in a free reply.
"""

from __future__ import annotations

import threading

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


class Constraint:
    """One reply's matcher: the tokens it may take next, and the ones it took."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self._bits = allocate_token_bitmask(1, vocab)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def advance(self, token: int) -> bool:
        """Take `token` if the grammar allows it (a draft's); False, and nothing taken, if not."""
        return self.matcher.try_consume_tokens([token]) == 1

    def rollback(self, n: int) -> None:
        """Forget the last n tokens taken (drafted ones the model refused)."""
        if not self.matcher.rollback(n):
            raise RuntimeError(f"the grammar could not roll back: {self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows one way only from here (llguidance's fast-forward)."""
        return list(self.matcher.compute_ff_tokens())

    def allowed(self) -> mx.array:
        """[vocab] bool: the tokens the grammar allows next (only end-of-sequence once the
        reply is complete)."""
        fill_next_token_bitmask(self.matcher, self._bits)
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab]
        return mx.array(bits.astype(np.bool_))

    def apply(self, logits: mx.array) -> mx.array:
        return mx.where(self.allowed(), logits, -mx.inf)


class Grammars:
    """The model's vocabulary as llguidance reads it, built once (about a second) on the
    first constrained request."""

    def __init__(self, tokenizer, vocab_size: int):
        self._hf = tokenizer._tokenizer  # mlx-lm's TokenizerWrapper around the HF one
        self._eos = sorted(tokenizer.eos_token_ids)
        self.vocab = vocab_size
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=self.vocab, eos_token=self._eos
                    )
                except ValueError:  # a decoder it cannot read (Fuse, ...): token by token
                    wrapper = llguidance.TokenizerWrapper(DecodedVocabulary(self._hf, self.vocab))
                    self._ll = llguidance.LLTokenizer(
                        wrapper, n_vocab=self.vocab, eos_token=self._eos
                    )
            return self._ll

    def constraint(self, grammar: str) -> Constraint:
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab)


class DecodedVocabulary:
    """A vocabulary as llguidance's TokenizerWrapper reads it, each token's bytes what it
    decodes to alone: right for decoders that only join tokens (Fuse, SentencePiece's
    replace-and-join), which llguidance's own reader of tokenizer.json does not know.
    SentencePiece's byte tokens (<0xNN>) are their byte."""

    def __init__(self, hf, vocab: int):
        self._hf = hf
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = hf.bos_token_id
        decoder = getattr(hf, "added_tokens_decoder", {}) or {}
        self.special_token_ids = [i for i, t in decoder.items() if t.special and i < vocab]
        pieces = hf.convert_ids_to_tokens(list(range(vocab)))
        self.tokens = [_bytes_of(hf, i, piece) for i, piece in enumerate(pieces)]
        special = set(self.special_token_ids)
        self._ids = {t: i for i, t in enumerate(self.tokens) if t and i not in special}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str) -> list[int]:
        """The tokenizer's own ids; where it cannot spell the text (an unknown token), the
        longest tokens that do, left to right (llguidance tokenizes a grammar's fixed text
        with this, and then allows only its first token)."""
        ids = self._hf.encode(text, add_special_tokens=False)
        unknown = self._hf.unk_token_id
        if unknown is None or unknown not in ids:
            return ids
        data, out, at = text.encode(), [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if (token := self._ids.get(data[at:end])) is not None:
                    out.append(token)
                    at = end
                    break
            else:
                return ids  # not even one byte spells: the tokenizer's own answer
        return out


def _bytes_of(hf, token: int, piece: str | None) -> bytes:
    if piece and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return hf.decode([token], clean_up_tokenization_spaces=False).encode()
