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
                self._ll = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab, eos_token=self._eos
                )
            return self._ll

    def constraint(self, grammar: str) -> Constraint:
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab)
