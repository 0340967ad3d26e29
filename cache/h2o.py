"""H2OKVCache: a per-layer KV cache bounded by heavy-hitter eviction.

It speaks mlx-lm's cache protocol (`update_and_fetch`, `state`, `meta_state`,
`offset`, `nbytes`, `make_mask`, `is_trimmable`/`trim`) plus `update_scores`,
which the attention router calls with each attention call's logits.

Layout: slots [0, _len) of preallocated buffers hold one token each, per KV
head (heads keep different tokens). `positions` records each slot's token
index, which is all eviction needs; attention itself is order-free because
keys carry RoPE already. `offset` counts every token ever seen (RoPE uses it)
and never drops; the physical length `size()` does.

Eviction runs after scoring, when the cache holds more than max_size tokens:
- one token over (decode): the lowest-scored middle token's slot becomes a
  hole that the next decoded token overwrites in place: no gather, no copy;
- more (a prefill chunk): keep sinks, the recent window and the top-`heavy`
  middle tokens (argpartition), gathered into fresh buffers.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from cache.presets import split_budget
from cache.scores import EMA_ALPHA, SCORE_RULES, attn_increment, ema_increment


class H2OKVCache:
    step = 256

    def __init__(
        self,
        max_size: int,
        sink: int | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        score: str = "attn",
        alpha: float = EMA_ALPHA,
    ):
        budget = split_budget(max_size, "heavy", sink=sink, heavy=heavy, recent=recent)
        if score not in SCORE_RULES:
            raise ValueError(f"unknown score rule {score!r}; choose from {SCORE_RULES}")
        self.max_size, self.sink, self.heavy, self.recent = (
            budget.max_size,
            budget.sink,
            budget.heavy,
            budget.recent,
        )
        self.score_rule = score
        self.alpha = alpha
        self.keys = self.values = None  # [B, H, capacity, D]
        self.scores = None  # float32 [B, H, capacity]: accumulated importance
        self.positions = None  # int32 [B, H, capacity]: token index held by each slot
        self.offset = 0
        self.evicted = 0  # tokens evicted (per head; every head evicts as many)
        self._len = 0  # slots in use, a hole included
        self._hole = None  # uint32 [B, H, 1]: slot freed by the last single eviction
        self._last_eviction = 0  # offset at the last eviction; trim never crosses it

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store N new tokens (post-RoPE keys) and return every stored key/value."""
        n_new = keys.shape[2]
        if self._hole is not None:
            if n_new == 1:
                self._fill_hole(keys, values)
                self.offset += 1
                return self._fetch()
            self._drop_hole()
        self._append(keys, values)
        self.offset += n_new
        return self._fetch()

    def update_scores(self, scores: mx.array) -> None:
        """Accumulate one attention call's logits [B, n_q_heads, L_q, size], then evict."""
        n = scores.shape[-1]
        if n != self._len:
            raise ValueError(f"scores cover {n} keys but the cache holds {self._len}")
        n_kv = self.keys.shape[1]
        held = self._live(self.scores)
        if self.score_rule == "attn":
            updated = held + attn_increment(scores, n_kv)
        else:
            decay, increment = ema_increment(scores, n_kv, self.alpha)
            updated = decay * held + increment
        if n == self.scores.shape[-1]:
            self.scores = updated
        else:
            self.scores[..., :n] = updated
        self._evict_if_over()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for N new tokens: every stored key visible, the new keys causal.

        Built from the physical length, which is the same in every H2O layer.
        """
        if window_size is not None:
            # A window mask depends on positions, which differ per layer and head
            # after eviction, while mlx-lm shares one mask across layers.
            raise ValueError("H2OKVCache cannot serve a sliding-window attention layer")
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self.size())
        return "causal"

    def size(self) -> int:
        """Tokens physically stored (per head)."""
        return self._len - (1 if self._hole is not None else 0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held: keys, values, scores and positions, spare slots included."""
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (self.keys, self.values, self.scores, self.positions))

    def is_trimmable(self) -> bool:
        return self.offset > self._last_eviction

    def trim(self, n: int) -> int:
        """Drop the n newest tokens, never past the last eviction; return how many."""
        n = max(0, min(n, self.offset - self._last_eviction))
        if n == 0:
            return 0
        self._drop_hole()
        keep = self._live(self.positions) < self.offset - n
        self._select(keep, self._len - n)
        self.offset -= n
        return n

    @property
    def state(self):
        if self.keys is None:
            return None, None, None, None, self.meta_state[0]
        self._drop_hole()
        n = self._len
        return (
            self.keys[..., :n, :],
            self.values[..., :n, :],
            self.scores[..., :n],
            self.positions[..., :n],
            self.meta_state[0],
        )

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.scores, self.positions, meta = v
        self.meta_state = (meta,)
        self._len = 0 if self.keys is None else self.keys.shape[2]
        self._hole = None

    @property
    def meta_state(self) -> tuple[str]:
        meta = {
            "max_size": self.max_size,
            "sink": self.sink,
            "heavy": self.heavy,
            "recent": self.recent,
            "score": self.score_rule,
            "alpha": self.alpha,
            "offset": self.offset,
            "evicted": self.evicted,
            "last_eviction": self._last_eviction,
        }
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        meta = json.loads(v[0])
        self.max_size, self.sink, self.heavy, self.recent = (
            meta["max_size"],
            meta["sink"],
            meta["heavy"],
            meta["recent"],
        )
        self.score_rule, self.alpha = meta["score"], meta["alpha"]
        self.offset, self.evicted = meta["offset"], meta["evicted"]
        self._last_eviction = meta["last_eviction"]

    @classmethod
    def from_state(cls, state) -> H2OKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    # ------------------------------------------------------------------ internals

    def _fetch(self) -> tuple[mx.array, mx.array]:
        if self._len == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self._len, :], self.values[..., : self._len, :]

    def _append(self, keys: mx.array, values: mx.array) -> None:
        B, H, n_new, _ = keys.shape
        end = self._len + n_new
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        self.keys[..., self._len : end, :] = keys
        self.values[..., self._len : end, :] = values
        new_pos = mx.arange(self.offset, self.offset + n_new, dtype=mx.int32)
        self.positions[..., self._len : end] = mx.broadcast_to(new_pos, (B, H, n_new))
        self.scores[..., self._len : end] = 0.0
        self._len = end

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        # Decode needs max_size + 1 slots at most (one spare for the newest
        # token); a prefill chunk gets exactly what it needs until it is evicted.
        if needed <= self.max_size + 1:
            capacity = min(-(-needed // self.step) * self.step, self.max_size + 1)
        else:
            capacity = needed
        B, H = keys.shape[:2]

        def grown(buf: mx.array | None, tail: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
            fresh = mx.zeros((B, H, capacity, *tail), dtype=dtype)
            if buf is not None and self._len:
                fresh[:, :, : self._len] = buf[:, :, : self._len]
            return fresh

        self.keys = grown(self.keys, (keys.shape[3],), keys.dtype)
        self.values = grown(self.values, (values.shape[3],), values.dtype)
        self.scores = grown(self.scores, (), mx.float32)
        self.positions = grown(self.positions, (), mx.int32)

    def _fill_hole(self, keys: mx.array, values: mx.array) -> None:
        slot = self._hole
        self.keys = mx.put_along_axis(self.keys, slot[..., None], keys, axis=2)
        self.values = mx.put_along_axis(self.values, slot[..., None], values, axis=2)
        # Scalars broadcast into the slot: no per-step fill ops.
        self.positions = mx.put_along_axis(
            self.positions, slot, mx.array(self.offset, dtype=mx.int32), axis=2
        )
        self.scores = mx.put_along_axis(self.scores, slot, mx.array(0.0), axis=2)
        self._hole = None

    def _drop_hole(self) -> None:
        if self._hole is None:
            return
        keep = mx.arange(self._len) != self._hole
        self._hole = None
        self._select(keep, self._len - 1)

    def _select(self, keep: mx.array, count: int) -> None:
        """Keep `count` slots per head where `keep` [B, H, _len] is true, in slot order."""
        slots = mx.arange(self._len)
        order = mx.sort(mx.where(keep, slots, self._len + slots), axis=-1)[..., :count]
        self._gather(order)

    def _gather(self, idx: mx.array) -> None:
        """Rebuild the buffers from slots `idx` [B, H, K] (compacts; drops spare capacity)."""
        n = self._len
        self.keys = mx.take_along_axis(self.keys[:, :, :n], idx[..., None], axis=2)
        self.values = mx.take_along_axis(self.values[:, :, :n], idx[..., None], axis=2)
        self.scores = mx.take_along_axis(self.scores[..., :n], idx, axis=-1)
        self.positions = mx.take_along_axis(self.positions[..., :n], idx, axis=-1)
        self._len = idx.shape[-1]

    def _live(self, buf: mx.array) -> mx.array:
        """The used slots [..., :_len] of a [B, H, capacity] buffer (no slice when full)."""
        return buf if self._len == buf.shape[-1] else buf[..., : self._len]

    def _middle(self) -> mx.array:
        """[B, H, _len] true for evictable slots: neither sink nor in the recent window."""
        pos = self._live(self.positions)
        return (pos >= self.sink) & (pos < self.offset - self.recent)

    def _evict_if_over(self) -> None:
        excess = self._len - self.max_size
        if excess <= 0:
            return
        # Protected slots score +inf so they always win.
        ranked = mx.where(self._middle(), self._live(self.scores), mx.inf)
        if excess == 1:
            self._hole = mx.argmin(ranked, axis=-1, keepdims=True)
        else:
            top = mx.argpartition(-ranked, kth=self.max_size - 1, axis=-1)
            self._gather(mx.sort(top[..., : self.max_size], axis=-1))
        self.evicted += excess
        self._last_eviction = self.offset
