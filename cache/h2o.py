"""H2OKVCache: a per-layer KV cache bounded by heavy-hitter eviction.

It speaks mlx-lm's cache protocol (`update_and_fetch`, `state`, `meta_state`,
`offset`, `nbytes`, `make_mask`, `is_trimmable`/`trim`) plus `update_scores`,
which the attention router calls with each attention call's logits.

Layout: slots [0, size) of preallocated buffers hold one token each, per KV
head (heads keep different tokens). `positions` records each slot's token
index, which is all eviction needs; attention itself is order-free because
keys carry RoPE already. `offset` counts every token ever seen (RoPE uses it)
and never drops; the physical length `size()` does.

Eviction runs after scoring, when the cache holds more than max_size tokens.
It drops the lowest-scored middle tokens (neither sink nor recent) per head,
down to max_size + 1 - evict_batch, with one argpartition and one gather into
buffers of max_size + 1 slots. The next evict_batch - 1 decode steps only
append (two slice writes, like mlx-lm's KVCache), so the gather is amortized;
evict_batch=1 is H2O evicting one token per step. Free slots always hold
score 0 and the position the next appended token will have, so appending
writes keys and values only.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from cache.presets import split_budget
from cache.scores import EMA_ALPHA, SCORE_RULES, attn_increment, ema_increment


def default_evict_batch(max_size: int, heavy: int) -> int:
    """Tokens evicted at once: 1/16 of the cache, at most the heavy segment (>= 1)."""
    return max(1, min(heavy, max_size // 16))


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
        evict_batch: int | None = None,
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
        if evict_batch is None:
            evict_batch = default_evict_batch(self.max_size, self.heavy)
        if not 1 <= evict_batch <= max(1, self.heavy):
            raise ValueError(
                f"evict_batch must be between 1 and the heavy budget ({self.heavy}), "
                f"got {evict_batch}"
            )
        self.evict_batch = evict_batch
        self.score_rule = score
        self.alpha = alpha
        self.keys = self.values = None  # [B, H, capacity, D]
        self.scores = None  # float32 [B, H, capacity]: accumulated importance
        self.positions = None  # int32 [B, H, capacity]: token index held by each slot
        self.offset = 0
        self.evicted = 0  # tokens evicted (per head; every head evicts as many)
        self._len = 0  # slots in use
        self._last_eviction = 0  # offset at the last eviction; trim never crosses it

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store N new tokens (post-RoPE keys) and return every stored key/value."""
        n_new = keys.shape[2]
        end = self._len + n_new
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        # Free slots already hold score 0 and these tokens' positions.
        self.keys[..., self._len : end, :] = keys
        self.values[..., self._len : end, :] = values
        self._len = end
        self.offset += n_new
        if end == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., :end, :], self.values[..., :end, :]

    def update_scores(self, scores: mx.array) -> None:
        """Accumulate one attention call's logits [B, n_q_heads, L_q, size], then evict."""
        n = scores.shape[-1]
        if n != self._len:
            raise ValueError(f"scores cover {n} keys but the cache holds {self._len}")
        n_kv = self.keys.shape[1]
        full = n == self.scores.shape[-1]
        held = self.scores if full else self.scores[..., :n]
        if self.score_rule == "attn":
            updated = held + attn_increment(scores, n_kv)
        else:
            decay, increment = ema_increment(scores, n_kv, self.alpha)
            updated = decay * held + increment
        if full:
            self.scores = updated
        else:
            self.scores[..., :n] = updated
        if self._len > self.max_size:
            self._evict()

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
        return self._len

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
        keep = self.positions[..., : self._len] < self.offset - n
        slots = mx.arange(self._len)
        # Kept slots first, in slot order: every head keeps the same count.
        order = mx.sort(mx.where(keep, slots, self._len + slots), axis=-1)
        self.offset -= n
        self._gather(order[..., : self._len - n], capacity=self.keys.shape[2])
        return n

    @property
    def state(self):
        if self.keys is None:
            return None, None, None, None, self.meta_state[0]
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

    @property
    def meta_state(self) -> tuple[str]:
        meta = {
            "max_size": self.max_size,
            "sink": self.sink,
            "heavy": self.heavy,
            "recent": self.recent,
            "score": self.score_rule,
            "alpha": self.alpha,
            "evict_batch": self.evict_batch,
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
        self.evict_batch = meta.get("evict_batch", 1)
        self.offset, self.evicted = meta["offset"], meta["evicted"]
        self._last_eviction = meta["last_eviction"]

    @classmethod
    def from_state(cls, state) -> H2OKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    # ------------------------------------------------------------------ internals

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        # Decode needs max_size + 1 slots at most (one for the newest token); a
        # prefill chunk gets exactly what it needs until eviction cuts it back.
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
        self._reset_free_slots()

    def _reset_free_slots(self) -> None:
        """Free slots get score 0 and the positions the next appended tokens will have."""
        free = self.positions.shape[-1] - self._len
        if free:
            self.positions[..., self._len :] = mx.arange(
                self.offset, self.offset + free, dtype=mx.int32
            )
            self.scores[..., self._len :] = 0.0

    def _gather(self, idx: mx.array, capacity: int) -> None:
        """Rebuild the buffers from slots `idx` [B, H, K] into `capacity` slots."""
        n = self._len

        def gathered(buf: mx.array, idx: mx.array) -> mx.array:
            picked = mx.take_along_axis(buf[:, :, :n], idx, axis=2)
            if capacity == picked.shape[2]:
                return picked
            fresh = mx.zeros((*buf.shape[:2], capacity, *buf.shape[3:]), dtype=buf.dtype)
            fresh[:, :, : picked.shape[2]] = picked
            return fresh

        self.keys = gathered(self.keys, idx[..., None])
        self.values = gathered(self.values, idx[..., None])
        self.scores = gathered(self.scores, idx)
        self.positions = gathered(self.positions, idx)
        self._len = idx.shape[-1]
        self._reset_free_slots()

    def _evict(self) -> None:
        """Keep sinks, the recent window and the best middle tokens: max_size + 1 - batch."""
        keep = self.max_size + 1 - self.evict_batch
        pos = self.positions[..., : self._len]
        middle = (pos >= self.sink) & (pos < self.offset - self.recent)
        # Protected slots score +inf so they always win.
        ranked = mx.where(middle, self.scores[..., : self._len], mx.inf)
        top = mx.argpartition(-ranked, kth=keep - 1, axis=-1)[..., :keep]
        self.evicted += self._len - keep
        self._last_eviction = self.offset
        self._gather(top, capacity=self.max_size + 1)
