"""What a layer's KV cache still holds: token positions per KV head, and their scores.

For the cache view (`GET /v1/sessions/{id}/cache`): which tokens of a conversation
the model can still attend to. Reads MLX arrays, so only the thread that owns MLX
may call it (the worker, between rounds: a batched round wraps each session's own
caches and leaves them consistent with `session.tokens` once it is over).

Each cache class builds its own (`LayerCache.contents`, cache/contract.py) with the
helpers below:
- evicting caches record each slot's token position and accumulated score per KV head;
  heads evict independently (a pooled layer's heads hold different counts);
- full and KVarN caches (packed, never evicting) hold every token seen;
- a rotating cache holds its `keep` sink tokens and the newest rest of its buffer
  (after a multi-token chunk the buffer briefly holds more than max_size; after a
  decode step exactly max_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from config.policies import FULL, H2O, ROTATING


@dataclass(frozen=True)
class LayerContents:
    """One layer's cache: `positions[h]` are the token positions KV head h holds."""

    kind: str  # config.policies.VIEW_KINDS: h2o (scored eviction), full and kvarn, rotating
    offset: int  # tokens the layer has seen
    positions: list[np.ndarray]  # int32 per KV head, sorted (heads may hold different counts)
    scores: list[np.ndarray] | None  # float32 per KV head, aligned with positions (H2O only)
    sink: int  # positions below this are protected sink tokens
    recent: int  # positions >= offset - recent are the protected recent window


def every_token(offset: int, heads: int, kind: str = FULL.name) -> LayerContents:
    """A cache that holds every token it has seen, in each of its heads."""
    row = np.arange(offset, dtype=np.int32)
    return LayerContents(kind, offset, [row] * heads, None, 0, 0)


def scored_contents(cache, n: int, positions=None, scores=None) -> LayerContents:
    """An H2O cache's: per KV head, the positions its first `n` slots hold and their
    scores (or the given per-head `positions` and `scores`), sorted by position."""
    if positions is None:
        positions, scores = [], []
        if cache.positions is not None and n:
            # Sessions run at batch 1; slot order is arbitrary, so sort by position.
            pos, score = cache.positions[0, :, :n], cache.scores[0, :, :n]
            order = mx.argsort(pos, axis=-1)
            pos, score = mx.take_along_axis(pos, order, -1), mx.take_along_axis(score, order, -1)
            mx.eval(pos, score)
            positions = list(np.array(pos, np.int32))
            scores = list(np.array(score, np.float32))
    else:
        orders = [np.argsort(p, kind="stable") for p in positions]
        positions = [np.asarray(p, np.int32)[o] for p, o in zip(positions, orders, strict=True)]
        scores = [np.asarray(s, np.float32)[o] for s, o in zip(scores, orders, strict=True)]
    return LayerContents(H2O.name, cache.tokens_seen, positions, scores, cache.sink, cache.recent)


def window_contents(cache) -> LayerContents:
    """A rotating cache's (mlx-lm's RotatingKVCache): its `keep` sink tokens and the newest
    rest of its buffer."""
    offset, keep = cache.offset, cache.keep
    heads = 0 if cache.keys is None else cache.keys.shape[1]
    held = 0 if cache.keys is None else min(offset, cache.keys.shape[2])
    if held < offset:  # wrapped: the sinks plus the newest held - keep tokens
        sinks = np.arange(min(keep, held), dtype=np.int32)
        newest = np.arange(offset - (held - len(sinks)), offset, dtype=np.int32)
        row = np.concatenate([sinks, newest])
    else:
        row = np.arange(offset, dtype=np.int32)
    return LayerContents(ROTATING.name, offset, [row] * heads, None, keep, cache.max_size - keep)
