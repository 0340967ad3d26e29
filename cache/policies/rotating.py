"""Sliding-window caches: mlx-lm's RotatingKVCache, exact for multi-token chunks and bounded.

mlx-lm's `RotatingKVCache(keep=k)` stores the k first (sink) tokens and a ring
of the most recent ones. A multi-token chunk after the ring has wrapped gets
keys laid out as [sinks, the last max_size - 1 - k tokens, the chunk], but its
mask is a plain sliding window over that layout: query i of the chunk loses
the first i keys, i.e. the sinks first, so chunked prefill (the server's) and
chunked evaluation through it were wrong (tests/test_rotating.py). Its window is also the
model's `window_size` when one is passed, not the cache's own size, so a cache
smaller than a model's window let later queries of a chunk see more than
max_size tokens. And it keeps max_size - 1 + N tokens after a chunk of N until
the next single-token step.

This subclass fixes all three and nothing else: every query of a chunk sees
the sinks plus the last (window - k) tokens up to itself, where window is the
smaller of the cache's size and the model's window, exactly what one token at
a time (mlx-lm's decode path, unchanged) sees; after any update it stores at
most max_size tokens.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from cache.contents import LayerContents, window_contents
from cache.contract import LayerCache


class SinkRotatingKVCache(RotatingKVCache, LayerCache):
    """RotatingKVCache whose chunk masks keep the sinks visible and that stores <= max_size."""

    # A verify pass is a chunk: it stores through concatenation (new arrays), so the ring
    # before it is still there to go back to (`hold_draft`, `settle_draft`).
    verifies_drafts = True
    held: tuple | None = None  # (keys, values, offset, _idx) before a verify pass

    def draft_room(self) -> int:
        """Drafts that fit the window beside the decoding token: the kept ones are read
        back from the newest stored tokens."""
        return 0 if self.keys is None else self.max_size - 1

    def hold_draft(self) -> None:
        self.held = (self.keys, self.values, self.offset, self._idx)

    def settle_draft(self, fed: int, kept: int) -> None:
        """Refused tokens pushed older ones out of the window: go back to the ring before
        the pass and store the kept tokens again (the pass left the fed ones last, in
        order), as decoding them would have."""
        held, self.held = self.held, None
        if held is None or fed == kept:
            return
        keys, values = self.keys, self.values
        self.keys, self.values, self.offset, self._idx = held
        if kept:
            start = keys.shape[2] - fed
            self.update_and_fetch(
                keys[..., start : start + kept, :], values[..., start : start + kept, :]
            )

    @classmethod
    def from_spec(cls, spec, window: int | None = None) -> SinkRotatingKVCache:
        """max_kv tokens; sinks only in global layers: in a sliding-window layer, tokens
        older than its window (sinks included) triple Gemma 3's perplexity
        (cache/policies/windowed.py)."""
        return cls(max_size=spec.max_kv, keep=0 if window else spec.segments().sink)

    @classmethod
    def layer_bytes(cls, shape, spec, window: int | None = None) -> float:
        return spec.max_kv * shape.kv_heads * shape.dense_token_bytes

    def contents(self) -> LayerContents:
        return window_contents(self)

    def compact(self) -> None:
        """Before the ring wraps, slots 0.._idx hold the tokens in order: cut the rest."""
        if self.keys is not None and self.offset == self._idx < self.keys.shape[2]:
            self.keys, self.values = (
                self.keys[..., : self._idx, :],
                self.values[..., : self._idx, :],
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = super().update_and_fetch(keys, values)
        excess = self.keys.shape[2] - self.max_size
        if keys.shape[2] > 1 and excess > 0:
            # The chunk attended over everything; store only what the next query may see.
            # The concatenated layout is in temporal order, so _trim drops the oldest.
            self.keys = self._trim(excess, self.keys)
            self.values = self._trim(excess, self.values)
            self._idx = self.max_size
        return out

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N == 1:
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
