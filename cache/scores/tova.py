"""`tova`: keep the keys the newest query attends to (TOVA, Oren et al. 2024).

A key's importance is the attention probability it gets from the last query row
of the latest forward pass, pooled over the heads of its KV group; older
queries are forgotten. TOVA evicts by that alone; here it ranks the middle
segment while sinks and the recent window stay protected.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.base import ScoreRule, per_kv_head


@dataclass(frozen=True)
class TovaScore(ScoreRule):
    name = "tova"

    def accumulate(
        self, held: mx.array, logits: mx.array, n_kv_heads: int, probs: mx.array | None = None
    ) -> mx.array:
        # The newest row only; a prompt chunk's later query block replaces this one's.
        newest = (
            mx.softmax(logits[:, :, -1:, :], axis=-1, precise=True)
            if probs is None
            else (probs[:, :, -1:, :])
        )
        return per_kv_head(newest, n_kv_heads)
