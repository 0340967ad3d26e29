"""What a layer's KV cache still holds: token positions per KV head, and their scores.

For the cache view (`GET /v1/sessions/{id}/cache`): which tokens of a conversation
the model can still attend to. Reads MLX arrays, so only the thread that owns MLX
may call it (the worker, between rounds: a batched round wraps each session's own
caches and leaves them consistent with `session.tokens` once it is over).

- Scored caches (`h2o`, `h2o-q8`/`h2o-q4`, `h2o-mixed`, `h2o-kvarn`) record each
  slot's token position and accumulated score per KV head; heads evict independently.
- mlx-lm's `KVCache` and `KVarNCache` (packed, never evicts) hold every token seen.
- mlx-lm's `RotatingKVCache` holds its `keep` sink tokens and the newest rest of
  its buffer (after a multi-token chunk the buffer briefly holds more than
  max_size; after a decode step exactly max_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from cache.factory import tokens_seen
from cache.h2o import H2OKVCache
from cache.h2o_kvarn import H2OKVarNCache
from cache.kvarn import KVarNCache

SCORED = (H2OKVCache, H2OKVarNCache)  # per-slot `positions` and `scores` [B, H, slots]


@dataclass(frozen=True)
class LayerContents:
    """One layer's cache: `positions[h]` are the token positions KV head h holds."""

    kind: str  # "h2o" (scored eviction), "full", "kvarn" (both keep all) or "rotating"
    offset: int  # tokens the layer has seen
    positions: np.ndarray  # int32 [kv_heads, held], sorted per head
    scores: np.ndarray | None  # float32 [kv_heads, held], aligned with positions (H2O only)
    sink: int  # positions below this are protected sink tokens
    recent: int  # positions >= offset - recent are the protected recent window


def layer_contents(cache) -> LayerContents | None:
    """What `cache` holds, or None for caches that hold no token positions (recurrent state)."""
    if isinstance(cache, SCORED):
        return _scored_contents(cache)
    if isinstance(cache, RotatingKVCache):
        return _rotating_contents(cache)
    if isinstance(cache, KVarNCache):
        heads = 0 if cache.front is None else cache.front[0].shape[1]
        return _every_token("kvarn", cache.offset, heads)
    if type(cache) is KVCache:
        return _every_token("full", cache.offset, 0 if cache.keys is None else cache.keys.shape[1])
    return None


def _every_token(kind: str, offset: int, heads: int) -> LayerContents:
    positions = np.broadcast_to(np.arange(offset, dtype=np.int32), (heads, offset))
    return LayerContents(kind, offset, positions, None, 0, 0)


def _scored_contents(cache: H2OKVCache | H2OKVarNCache) -> LayerContents:
    n = cache.size()
    if cache.positions is None or n == 0:
        positions, scores = np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32)
    else:
        # Sessions run at batch 1; slot order is arbitrary, so sort by position.
        pos, score = cache.positions[0, :, :n], cache.scores[0, :, :n]
        order = mx.argsort(pos, axis=-1)
        pos, score = mx.take_along_axis(pos, order, -1), mx.take_along_axis(score, order, -1)
        mx.eval(pos, score)
        positions, scores = np.array(pos, np.int32), np.array(score, np.float32)
    return LayerContents("h2o", tokens_seen(cache), positions, scores, cache.sink, cache.recent)


def _rotating_contents(cache: RotatingKVCache) -> LayerContents:
    offset, keep = cache.offset, cache.keep
    heads = 0 if cache.keys is None else cache.keys.shape[1]
    held = 0 if cache.keys is None else min(offset, cache.keys.shape[2])
    if held < offset:  # wrapped: the sinks plus the newest held - keep tokens
        sinks = np.arange(min(keep, held), dtype=np.int32)
        newest = np.arange(offset - (held - len(sinks)), offset, dtype=np.int32)
        row = np.concatenate([sinks, newest])
    else:
        row = np.arange(offset, dtype=np.int32)
    positions = np.broadcast_to(row, (heads, len(row)))
    return LayerContents("rotating", offset, positions, None, keep, cache.max_size - keep)
