"""The scoring hook every rule implements, and the GQA pooling they share."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import mlx.core as mx


def per_kv_head(x: mx.array, n_kv_heads: int) -> mx.array:
    """[B, n_q, L_q, L_k] -> [B, n_kv, L_k], summing the query rows and the heads of a group.

    GQA: a KV head's importance pools its query heads; the sum ranks keys exactly
    as the average would and saves an op per layer per step.
    """
    B, n_q, L_q, L_k = x.shape
    return x.reshape(B, n_kv_heads, (n_q // n_kv_heads) * L_q, L_k).sum(axis=2)


@dataclass(frozen=True)
class ScoreRule:
    """Base of every score rule: a frozen dataclass of knobs."""

    name: ClassVar[str]
    # `accumulate` adds each key's softmax probability summed over the rows and heads (the
    # attention's own column sums): a GPU kernel computes that without the logits.
    sums_probabilities: ClassVar[bool] = False
    # `rank` reads the held keys and values (`kv`), which the cache hands it when it can.
    reads_kv: ClassVar[bool] = False
    # ... and ranks each slot by its own key and value alone (no statistic over the held
    # ones), so a pool of every head's slots (h2o-ada) can hand them over too.
    kv_per_slot: ClassVar[bool] = False
    # make_cache binds each layer's rule to the model (`bound(signature, layer)`).
    binds_model: ClassVar[bool] = False

    @property
    def accumulation(self) -> ScoreRule:
        """The rule as a decode step's score update sees it, which keys that compiled step:
        itself, unless binding (`bound`) changes only how it ranks."""
        return self

    def accumulate(
        self, held: mx.array, logits: mx.array, n_kv_heads: int, probs: mx.array | None = None
    ) -> mx.array:
        """New importance [B, n_kv, L_k] from the held one and logits [B, n_q, L_q, L_k].

        `logits` are pre-softmax, masked keys at -inf; the L_q query rows are tokens
        in order (a prompt chunk arrives in several calls, one per query block).
        `probs`, when given, is softmax(logits) as the attention computed it.
        """
        raise NotImplementedError

    def rank(self, importance: mx.array, positions: mx.array, offset: int, kv=None) -> mx.array:
        """What eviction keeps the largest of (default: the importance itself); >= 0, since
        h2o-merge weighs merged slots by it.

        positions: the token index each slot holds; offset: tokens seen so far; kv: the
        held (keys, values), dense [B, H, n, D] in slot order, for rules that read them
        (`reads_kv`; None where the cache cannot hand them over). A `kv_per_slot` rule may
        get a pool of every head's slots, [B, 1, n, D], and return [B, H, n]: each slot
        ranked under every head's knobs (h2o-ada keeps each slot's own head's row).
        """
        return importance

    def knobs(self) -> dict:
        """The rule's settings, saved with a cache so that a restored one scores alike."""
        return asdict(self)


def softmax_of(logits: mx.array, probs: mx.array | None) -> mx.array:
    """The attention's own probabilities when it passed them, else softmax(logits)."""
    return probs if probs is not None else mx.softmax(logits, axis=-1, precise=True)
