"""`value`: `mean`'s rank times how far the token's value lies from the held ones' mean.

Dropping a key changes the attention output by about p (v - o) (DropKV in
NVIDIA/kvpress: (p / (1 - p))^2 ||v - o||^2; CriticalKV weighs by ||W_o v||): a key
whose value repeats what the output already is costs little to lose, however much
attention it draws. Here o is approximated by the mean of the held values per head
(the output of a query that attends evenly), so the rank is attention per query times
||v - mean(v)||: training-free, read from the held values at each eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.mean import MeanAttnScore


@dataclass(frozen=True)
class ValueScore(MeanAttnScore):
    name = "value"
    reads_kv = True

    def rank(self, importance: mx.array, positions: mx.array, offset, kv=None) -> mx.array:
        value = super().rank(importance, positions, offset)
        if kv is None:
            return value
        values = kv[1].astype(mx.float32)
        spread = values - values.mean(axis=2, keepdims=True)
        return value * mx.sqrt((spread * spread).sum(axis=-1))
