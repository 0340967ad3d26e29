"""The `rotating` policy's cache: mlx-lm's sliding window with sink tokens that stay visible.

mlx-lm's `RotatingKVCache(keep=k)` stores the k first (sink) tokens and a ring
of the most recent ones. A multi-token chunk after the ring has wrapped gets
keys laid out as [sinks, the last max_size - 1 - k tokens, the chunk], but its
mask is a plain sliding window of max_size over that layout: query i of the
chunk loses the first i keys, i.e. the sinks first. Chunked prefill (the
server's) and chunked evaluation through it were wrong (DESIGN.md).

This subclass changes only the multi-token mask: every query sees the sinks
plus the last max_size - k tokens up to itself, which is exactly what one
token at a time (mlx-lm's decode path, unchanged) sees.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache


class SinkRotatingKVCache(RotatingKVCache):
    """RotatingKVCache whose chunk masks keep the `keep` sink tokens visible to every query."""

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N == 1 or self.keep == 0:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        window = min(window_size or self.max_size, self.max_size)
        # Keys of this chunk's attention: `stored` kept tokens (as _update_concat
        # leaves them: at most max_size - 1, sinks first, in temporal order), then N new.
        stored = min(self.max_size - 1, self.offset)
        if stored + N <= window and not return_array:
            return "causal"  # no query has anything outside its window
        query = mx.arange(stored, stored + N)[:, None]
        key = mx.arange(stored + N)[None]
        recent = query - key < window - self.keep
        return (query >= key) & ((key < self.keep) | recent)
