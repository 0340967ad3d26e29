"""H2O inside a sliding window: the cache of a sliding-window layer under a bounded policy.

A sliding-window layer (Gemma 3: 5 of every 6) attends to the last `window`
tokens only. When max_kv is smaller than the window, its cache must drop
tokens inside the window too. On Gemma 3 270M H2O restricted to the window
is the best bounded option at max_kv 64/128/256, and anything that lets such a
layer see tokens older than its window (the rotating policy's sinks, or plain
H2O keeping old heavy hitters) breaks the model (perplexity x3);
docs/sliding_layers.md (bench/sliding_layers.py). docs/RESULTS.md has the h2o
policy built on this against rotating and full.

So these caches (dense, packed, mixed: the policy's H2O class with this mixin, named by
its record's `window_cache`, config/policies.py)
- mask every key older than the window, per layer and head, from the stored
  tokens' positions (`attention_mask`, which cache/router.py asks every scored cache
  for in place of the model's mask; mlx-lm's one sliding mask shared across layers cannot
  follow per-layer eviction, so the mask the model passes is ignored);
- evict expired tokens (sinks included) before any other.
"""

from __future__ import annotations

import json

import mlx.core as mx

from cache.policies.h2o import H2OKVCache
from cache.policies.mixed import MIXED_LAYOUTS, MixedH2OKVCache
from cache.policies.quantized import QuantizedH2OKVCache
from cache.scores.heavy_hitters import segment_knobs
from config.cache_spec import CacheSpec


class SlidingWindowMixin:
    """For an H2O cache class: keys older than `window` are invisible and evicted first."""

    def __init__(self, max_size: int, *, window: int, **kwargs):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        super().__init__(max_size, **kwargs)
        self.window = window

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None):
        """max_kv tokens of the policy's H2O inside the layer's `window`."""
        if window is None:
            raise ValueError(f"{cls.__name__} is built for a sliding-window layer")
        return cls(spec.max_kv, window=window, **segment_knobs(spec), **cls.spec_knobs(spec))

    def attention_mask(self, n_q_heads: int, n_queries: int, mask=None) -> mx.array:
        """[B, n_q_heads or 1, N, C] bool: key slot visible to each of the N newest queries.

        Replaces the model's shared sliding mask, which cannot follow this layer's evictions.
        """
        pos = self.positions[..., : self.used][:, :, None, :]  # [B, H_kv, 1, C]
        query = mx.arange(self.seen - n_queries, self.seen)[:, None]
        visible = (pos <= query) & (pos > query - self.window)
        n_kv = visible.shape[1]
        return visible if n_kv in (1, n_q_heads) else mx.repeat(visible, n_q_heads // n_kv, 1)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The model's shared mask; unused here (attention_mask builds this layer's own)."""
        return super().make_mask(N, return_array=return_array)

    def eviction_ranks(self, pos: mx.array) -> mx.array:
        expired = pos <= self.seen - self.window  # outside the next query's window
        return mx.where(expired, -mx.inf, super().eviction_ranks(pos))

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta["window"] = self.window
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        super(SlidingWindowMixin, type(self)).meta_state.fset(self, v)
        self.window = json.loads(v[0])["window"]


class WindowedH2OKVCache(SlidingWindowMixin, H2OKVCache):
    """Dense H2O inside a sliding window."""

    # Its mask follows each query's own position, and expired tokens go only at eviction,
    # which waits for a draft's verdict as dense H2O's does.
    verifies_drafts = True


class WindowedQuantizedH2OKVCache(SlidingWindowMixin, QuantizedH2OKVCache):
    """Packed (h2o-q8, h2o-q4, h2o-mixed k8v4) H2O inside a sliding window."""

    dense_sinks = dense_tail = False  # its sinks leave with the window; no pools
    verifies_drafts = True  # no dense tail (QuantizedH2OKVCache.verifies_drafts)


class WindowedMixedH2OKVCache(SlidingWindowMixin, MixedH2OKVCache):
    """The paper's mixed-precision H2O inside a sliding window."""

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None):
        """The layout `spec.mixed` names: k8v4 is the packed cache's twin."""
        if MIXED_LAYOUTS[spec.mixed][0] is QuantizedH2OKVCache:
            return WindowedQuantizedH2OKVCache.from_spec(spec, window)
        return super().from_spec(spec, window)
