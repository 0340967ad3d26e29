"""`attn`, the original H2O rule: a key's importance is the softmax probability it received."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.base import ScoreRule, per_kv_head, softmax_of


@dataclass(frozen=True)
class AttnScore(ScoreRule):
    name = "attn"
    sums_probabilities = True

    def accumulate(
        self, held: mx.array, logits: mx.array, n_kv_heads: int, probs: mx.array | None = None
    ) -> mx.array:
        return held + per_kv_head(softmax_of(logits, probs), n_kv_heads)
