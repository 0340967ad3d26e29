"""`mean`: attention per query that has seen the key (length-normalized H2O).

H2O's sum grows with a key's age: a token that has been visible to 900 queries
outranks one visible to 40 even when each query gave the newer one more. The
mean divides the sum by the number of queries that could attend to the key
(offset - position, by causality), so old and new keys compete on the same
footing. `power` < 1 divides by age**power instead: part of the sum's memory
kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.attn import AttnScore


@dataclass(frozen=True)
class MeanAttnScore(AttnScore):
    name = "mean"
    power: float = 1.0

    def rank(self, importance: mx.array, positions: mx.array, offset, kv=None) -> mx.array:
        seen_by = (offset - positions).astype(mx.float32)  # >= 1: a key sees its own query
        return importance / (seen_by if self.power == 1.0 else seen_by**self.power)
