"""`snap`: SnapKV-style prefill scoring (Li et al. 2024): an observation window, pooled.

A prompt chunk's importance comes from its last `window` query rows only (the
observation window: the queries closest to what will be generated); earlier
rows of the chunk add nothing. Decode rows accumulate as in `attn`. Eviction
ranks a key by the max of its score and its `kernel - 1` position neighbours',
so a phrase is kept or dropped together rather than one token of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cache.scores.base import ScoreRule, per_kv_head, softmax_of

SNAP_WINDOW = 32  # SnapKV's observation window
SNAP_KERNEL = 5  # SnapKV's pooling kernel (odd)


@dataclass(frozen=True)
class SnapScore(ScoreRule):
    name = "snap"
    window: int = SNAP_WINDOW
    kernel: int = SNAP_KERNEL

    def accumulate(
        self, held: mx.array, logits: mx.array, n_kv_heads: int, probs: mx.array | None = None
    ) -> mx.array:
        probs = softmax_of(logits, probs)
        # The rows of one call are its chunk's newest; a prompt split in query blocks
        # still counts rows before the last window (a block cannot see the chunk's end).
        return held + per_kv_head(probs[:, :, -self.window :], n_kv_heads)

    def rank(self, importance: mx.array, positions: mx.array, offset, kv=None) -> mx.array:
        """Each slot's score max-pooled over its neighbours in position order, per head."""
        if self.kernel // 2 == 0:
            return importance
        order = mx.argsort(positions, axis=-1)
        pooled = sliding_max(mx.take_along_axis(importance, order, axis=-1), self.kernel)
        return mx.take_along_axis(pooled, mx.argsort(order, axis=-1), axis=-1)


def sliding_max(x: mx.array, kernel: int) -> mx.array:
    """Max over a centred window of `kernel` (odd) along the last axis, same length."""
    half = kernel // 2
    n = x.shape[-1]
    padded = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], constant_values=-mx.inf)
    pooled = x
    for shift in range(kernel):
        pooled = mx.maximum(pooled, padded[..., shift : shift + n])
    return pooled
