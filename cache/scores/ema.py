"""`ema`, the MLX H2O paper's rule: C = a*C + (1-a)*|s| on pre-softmax logits.

One step per query row, so a chunk of L rows equals L single steps: row i of L
is weighted (1-a) * a^(L-1-i) and the held importance decays by a^L. Masked
logits (-inf: causal rows of a chunk, keys outside a sliding window) count as 0.
|logit| also rewards keys a query strongly avoids, which is why `attn` is the
default (docs/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.base import ScoreRule, per_kv_head

EMA_ALPHA = 0.95


@dataclass(frozen=True)
class EmaScore(ScoreRule):
    name = "ema"
    alpha: float = EMA_ALPHA

    def accumulate(
        self, held: mx.array, logits: mx.array, n_kv_heads: int, probs: mx.array | None = None
    ) -> mx.array:
        a, L = self.alpha, logits.shape[2]
        # -inf: causal rows of a chunk, and keys outside a sliding window
        # (cache/policies/windowed.py)
        magnitude = mx.where(mx.isinf(logits), 0.0, mx.abs(logits))
        if L == 1:
            weighted = magnitude * (1.0 - a)
        else:
            weights = (1.0 - a) * a ** mx.arange(L - 1, -1, -1, dtype=mx.float32)
            weighted = magnitude * weights[:, None]
        return (a**L) * held + per_kv_head(weighted, n_kv_heads)
