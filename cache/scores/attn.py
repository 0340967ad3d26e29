"""`attn`, the original H2O rule: a key's importance is the softmax probability it received."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.base import ScoreRule, per_kv_head


@dataclass(frozen=True)
class AttnScore(ScoreRule):
    name = "attn"

    def accumulate(self, held: mx.array, logits: mx.array, n_kv_heads: int) -> mx.array:
        probs = mx.softmax(logits, axis=-1, precise=True)
        return held + per_kv_head(probs, n_kv_heads)
