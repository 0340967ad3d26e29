"""H2OKVCache: a per-layer KV cache bounded by heavy-hitter eviction.

It speaks mlx-lm's cache protocol (`update_and_fetch`, `state`, `meta_state`,
`offset`, `nbytes`, `make_mask`, `is_trimmable`/`trim`) plus `update_scores`,
which the attention router calls with each attention call's logits.

Layout: slots [0, size) of preallocated buffers hold one token each, per KV
head (heads keep different tokens). `positions` records each slot's token
index, which is all eviction needs; attention itself is order-free because
keys carry RoPE already. `seen` counts every token ever seen and never drops;
the physical length `size()` does. `offset` (what the model gives RoPE) equals
`seen` until the conversation nears the model's context (`wall`): then the held
keys are re-rotated to positions 0..n-1 in token order (StreamingLLM's
re-indexing, llama.cpp's context shift), so no query is ever further from a key
than the model was trained on; `offset` then runs `shift` behind `seen`.

Eviction runs after scoring, when the cache holds more than max_size tokens.
It drops the lowest-scored middle tokens (neither sink nor recent) per head,
down to max_size + 1 - evict_batch, with one argpartition and one gather into
buffers of max_size + 1 slots. The next evict_batch - 1 decode steps only
append (two slice writes, like mlx-lm's KVCache), so the gather is amortized;
evict_batch=1 is H2O evicting one token per step. Free slots always hold
score 0 and the position the next appended token will have, so appending
writes keys and values only.

Subclasses change how K/V are stored (cache/quantized.py) by overriding the
`_encode`/`_fetch`/`_grow_kv`/`_gather_kv`/`_kv_state`/`_kv_loaded` hooks; buffers may be
lists of arrays (mx.quantize's packed weights, scales, biases), every one
with the sequence on axis 2, so scoring and eviction never look inside them.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_causal_mask

from cache.attention import DENSE, KVFormat
from cache.scores import ScoreRule, make_score_rule
from config.cache_spec import DEFAULT_SCORE, default_evict_batch, split_segments


class ScoresMissing(RuntimeError):
    """An H2O cache was fed tokens, but its layer's attention never reported scores."""


class H2OKVCache:
    step = 256

    def __init__(
        self,
        max_size: int,
        sink: int | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        score: str | ScoreRule = DEFAULT_SCORE,
        evict_batch: int | None = None,
    ):
        segments = split_segments(max_size, sink=sink, heavy=heavy, recent=recent)
        self.max_size, self.sink, self.heavy, self.recent = (
            segments.max_size,
            segments.sink,
            segments.heavy,
            segments.recent,
        )
        if evict_batch is None:
            evict_batch = default_evict_batch(self.max_size, self.heavy)
        if not 1 <= evict_batch <= max(1, self.heavy):
            raise ValueError(
                f"evict_batch must be between 1 and the heavy budget ({self.heavy}), "
                f"got {evict_batch}"
            )
        self.evict_batch = evict_batch
        self.score_rule = make_score_rule(score) if isinstance(score, str) else score
        self.keys = self.values = None  # [B, H, capacity, D] (or a list of such buffers)
        self.scores = None  # float32 [B, H, capacity]: accumulated importance
        self.positions = None  # int32 [B, H, capacity]: token index held by each slot
        self.lags = None  # int32 [B, H, capacity]: token index - RoPE position (once re-indexed)
        self.seen = self.shift = 0
        self.evicted = 0  # tokens evicted (per head; every head evicts as many)
        self._len = 0  # slots in use

    # Context shift: make_cache sets both for policies whose storage can re-rotate keys
    # (PolicyInfo.reindexes: dense and packed H2O).
    wall: int | None = None  # RoPE positions stay below this (the model's context)
    rope = None  # the layer's RoPE module: rope(x, offset=...)

    @property
    def offset(self) -> int:
        """The next token's RoPE position (mlx-lm's models read it): `seen` - `shift`."""
        return self.seen - self.shift

    @offset.setter
    def offset(self, value: int) -> None:
        self.seen = value + self.shift

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store N new tokens (post-RoPE keys) and return every stored key/value."""
        self._check_scored()
        n_new = keys.shape[2]
        end = self._len + n_new
        keys, values = self._encode(keys, values)
        if self.positions is None or end > self.positions.shape[-1]:
            self._grow(keys, values, end)
        # Free slots already hold score 0 and these tokens' positions.
        self._write_slots(keys, values, self._len, end)
        self._len = end
        self.offset += n_new
        return self._fetch()

    def update_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate one attention call's logits [B, n_q_heads, L_q, size], then evict.

        `probs`: the softmax the attention used, when it has it (saves rules a second one).
        """
        if scores.shape[-1] != self._len:
            raise ValueError(
                f"scores cover {scores.shape[-1]} keys but the cache holds {self._len}"
            )
        self.add_scores(scores, probs)
        self.evict_if_full()

    def add_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate logits of some query rows (in order) without evicting yet.

        They may cover the first n slots only: the keys a block of a prompt chunk
        can see (slots of one chunk are stored in order).
        """
        n = scores.shape[-1]
        if n > self._len:
            raise ValueError(f"scores cover {n} keys but the cache holds {self._len}")
        full = n == self.scores.shape[-1]
        held = self.scores if full else self.scores[..., :n]
        updated = self.score_rule.accumulate(held, scores, self.positions.shape[1], probs)
        if full:
            self.scores = updated
        else:
            self.scores[..., :n] = updated

    def evict_if_full(self) -> None:
        """Evict down to max_kv; then re-index if RoPE positions near the wall."""
        if self._len > self._slot_budget:
            self._evict()
        # A quarter of the context is left for the next chunk (the server's is 512 tokens);
        # re-indexing must win back at least an eighth of it to be worth its work.
        near = self.rope is not None and self.offset >= self.wall - self.wall // 4
        if near and self.offset - self.size() >= self.wall // 8:
            self.reindex()

    def reindex(self) -> None:
        """Re-rotate the held keys to RoPE positions 0..n-1 in token order (every head holds
        n); the next token gets position n. Attention between held tokens keeps their order
        but not their distances: what StreamingLLM does past the window, measured better
        than the original positions beyond the context (docs/context_wall.md)."""
        n = self._len
        pos = self.positions[..., :n]
        rank = mx.argsort(mx.argsort(pos, axis=-1), axis=-1).astype(mx.int32)
        rope_pos = pos if self.lags is None else pos - self.lags[..., :n]
        self._rerope_keys(rank - rope_pos)
        if self.lags is None:
            self.lags = mx.zeros(self.positions.shape, dtype=mx.int32)
        self.lags[..., :n] = pos - rank
        self.shift = self.seen - n
        self._reset_free_slots()

    def kv_segments(self, keys, values) -> list[tuple[object, object, KVFormat]]:
        """What update_and_fetch returned, as (keys, values, format) parts for attention."""
        return [(keys, values, self.kv_format)]

    kv_format: KVFormat = DENSE

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
        """Tokens physically stored (per head; on average when heads hold different counts)."""
        return self._len // self._slots_per_token

    def empty(self) -> bool:
        return self.positions is None

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held: keys, values, scores and positions, spare slots included."""
        if self.positions is None:
            return 0
        held = (self.keys, self.values, self.scores, self.positions)
        return sum(a.nbytes for _, a in tree_flatten(held) if a is not None)

    def is_trimmable(self) -> bool:
        return self.trimmable_tokens() > 0

    def trimmable_tokens(self) -> int:
        """How many of the newest tokens every head still holds, all of them: trim's limit.

        Everything after the last eviction is held, and so is the recent window that
        eviction protected (and any heavy hitters right before it); trimming past the
        newest evicted token would need a token the cache no longer has.
        """
        if self.positions is None:
            return 0
        n = self._len
        held = mx.sort(self.positions[..., :n], axis=-1)
        # Sorted positions end at seen - 1; they are contiguous over a suffix only.
        in_order = held == mx.arange(self.seen - n, self.seen, dtype=held.dtype)
        return int(in_order.sum(axis=-1).min().item())

    def trim(self, n: int) -> int:
        """Drop the n newest tokens, never past an evicted one; return how many."""
        n = max(0, min(n, self.trimmable_tokens()))
        if n == 0:
            return 0
        keep = self.positions[..., : self._len] < self.seen - n
        slots = mx.arange(self._len)
        # Kept slots first, in slot order: every head keeps the same count.
        order = mx.sort(mx.where(keep, slots, self._len + slots), axis=-1)
        self.offset -= n
        dropped = n * self._slots_per_token
        self._gather(order[..., : self._len - dropped], capacity=self.positions.shape[-1])
        return n

    @property
    def state(self):
        if self.positions is None:
            return None, None, None, None, self.meta_state[0]
        n = self._len
        positions = self.positions[..., :n]
        if self.lags is not None:  # re-indexed: the lags travel with the positions
            positions = mx.stack([positions, self.lags[..., :n]])
        return (*self._kv_state(), self.scores[..., :n], positions, self.meta_state[0])

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.scores, self.positions, meta = v
        self.lags = None
        if self.positions is not None and self.positions.ndim == 4:
            self.positions, self.lags = self.positions[0], self.positions[1]
        self.meta_state = (meta,)
        self._len = 0 if self.positions is None else self.positions.shape[-1]
        self._kv_loaded()

    def _kv_loaded(self) -> None:
        """After a state is loaded: rebuild what `_kv_state` flattened into the K/V (a hook)."""

    @property
    def meta_state(self) -> tuple[str]:
        meta = {
            "max_size": self.max_size,
            "sink": self.sink,
            "heavy": self.heavy,
            "recent": self.recent,
            "score": self.score_rule.name,
            "score_knobs": self.score_rule.knobs(),
            "evict_batch": self.evict_batch,
            "offset": self.seen,  # tokens seen; RoPE's offset is seen - shift
            "shift": self.shift,
            "evicted": self.evicted,
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
        self.score_rule = make_score_rule(meta["score"], **meta.get("score_knobs", {}))
        self.evict_batch = meta.get("evict_batch", 1)
        self.seen, self.evicted = meta["offset"], meta["evicted"]
        self.shift = meta.get("shift", 0)  # wall and rope: make_cache or adopt_rope

    @classmethod
    def from_state(cls, state) -> H2OKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    # ------------------------------------------------------------ K/V storage hooks

    def _write_slots(self, keys, values, start: int, end: int) -> None:
        """Encoded K/V (`_encode`'s form) into slots [start, end) of every buffer."""
        if isinstance(keys, mx.array):  # dense: no tree walk, once per layer and step
            self.keys[:, :, start:end] = keys
            self.values[:, :, start:end] = values
            return
        stored, fresh = tree_flatten((self.keys, self.values)), tree_flatten((keys, values))
        for (_, buf), (_, new) in zip(stored, fresh, strict=True):
            buf[:, :, start:end] = new

    def _encode(self, keys: mx.array, values: mx.array):
        """New tokens in the form the buffers store (dense: as they come)."""
        return keys, values

    def _fetch(self):
        """What attention reads: every stored key/value, spare slots cut off."""
        n = self._len
        if n == self.positions.shape[-1]:
            return self.keys, self.values
        if isinstance(self.keys, mx.array):
            return self.keys[:, :, :n], self.values[:, :, :n]
        return tree_map(lambda a: a[:, :, :n], (self.keys, self.values))

    def _kv_state(self) -> tuple:
        return tree_map(lambda a: a[:, :, : self._len], (self.keys, self.values))

    def _grow_kv(self, keys, values, capacity: int) -> None:
        """Reallocate the K/V buffers to `capacity` slots (keys/values: encoded new tokens)."""

        def grown(new: mx.array, buf: mx.array | None) -> mx.array:
            return self._grown(buf, new.shape[:2], new.shape[3:], new.dtype, capacity)

        self.keys = tree_map(grown, keys, self.keys)
        self.values = tree_map(grown, values, self.values)

    def _rerope_keys(self, delta: mx.array) -> None:
        """Rotate each held key [B, H, n] by `delta` positions (RoPE composes by adding)."""
        n = self._len
        self.keys[:, :, :n] = turn_keys(self.rope, self.keys[:, :, :n], delta)

    def _gather_kv(self, idx: mx.array, capacity: int) -> None:
        """K/V of slots `idx` [B, H, K] into `capacity` slots."""
        self.keys, self.values = tree_map(
            lambda buf: gather_slots(buf[:, :, : self._len], idx[..., None], capacity),
            (self.keys, self.values),
        )

    # ------------------------------------------------------------------ internals

    # Slots one token takes along the slot axis: one here (a slot row per KV head);
    # a layout whose heads share one slot axis (cache/adaptive.py) takes one per head.
    _slots_per_token = 1

    @property
    def _slot_budget(self) -> int:
        """Slots in use past which eviction runs."""
        return self.max_size * self._slots_per_token

    def _check_scored(self) -> None:
        """Eviction runs when scores arrive; a cache past max_size never got them."""
        if self._len > self._slot_budget:
            raise ScoresMissing(
                f"this H2O cache holds {self._len} tokens (max_kv {self.max_size}): its layer's "
                "attention did not pass scores to update_scores, so nothing was evicted. The "
                "model's attention must call mlx-lm's scaled_dot_product_attention through the "
                "router installed by cache.make_cache; use policy full or rotating otherwise"
            )

    def _grown(
        self, buf: mx.array | None, lead: tuple, tail: tuple, dtype: mx.Dtype, capacity: int
    ) -> mx.array:
        """A [*lead, capacity, *tail] buffer holding `buf`'s used slots."""
        fresh = mx.zeros((*lead, capacity, *tail), dtype=dtype)
        if buf is not None and self._len:
            fresh[:, :, : self._len] = buf[:, :, : self._len]
        return fresh

    def _grow(self, keys, values, needed: int) -> None:
        # Decode needs max_size + 1 slots at most (one for the newest token); a
        # prefill chunk gets exactly what it needs until eviction cuts it back.
        decode_slots = self._slot_budget + self._slots_per_token
        if needed <= decode_slots:
            capacity = min(-(-needed // self.step) * self.step, decode_slots)
        else:
            capacity = needed
        if self.positions is None:  # first tokens: nothing to copy over
            self.keys = tree_map(lambda _: None, keys)
            self.values = tree_map(lambda _: None, values)
        self._grow_kv(keys, values, capacity)
        lead = tree_flatten(keys)[0][1].shape[:2]  # [B, H]
        self.scores = self._grown(self.scores, lead, (), mx.float32, capacity)
        self.positions = self._grown(self.positions, lead, (), mx.int32, capacity)
        if self.lags is not None:
            self.lags = self._grown(self.lags, lead, (), mx.int32, capacity)
        self._reset_free_slots()

    def _reset_free_slots(self) -> None:
        """Free slots get score 0 and the positions (and lag) the next appended tokens will
        have."""
        free = self.positions.shape[-1] - self._len
        if free:
            self.positions[..., self._len :] = mx.arange(
                self.seen, self.seen + free, dtype=mx.int32
            )
            self.scores[..., self._len :] = 0.0
            if self.lags is not None:
                self.lags[..., self._len :] = self.shift

    def _gather(self, idx: mx.array, capacity: int) -> None:
        """Rebuild the buffers from slots `idx` [B, H, K] into `capacity` slots."""
        n = self._len
        self._gather_kv(idx, capacity)
        self.scores = gather_slots(self.scores[:, :, :n], idx, capacity)
        self.positions = gather_slots(self.positions[:, :, :n], idx, capacity)
        if self.lags is not None:
            self.lags = gather_slots(self.lags[:, :, :n], idx, capacity)
        self._len = idx.shape[-1]
        self._reset_free_slots()

    def _evict(self) -> None:
        """Keep sinks, the recent window and the best middle tokens: max_size + 1 - batch."""
        kept, _ = self._eviction_split()
        self._gather(kept, capacity=self.max_size + 1)

    def _eviction_split(self) -> tuple[mx.array, mx.array]:
        """(slots kept, slots leaving) [B, H, *], the leavers counted as evicted: sinks,
        the recent window and the best middle tokens stay, max_size + 1 - batch in all."""
        keep = self.max_size + 1 - self.evict_batch
        ranked = self._eviction_ranks(self.positions[..., : self._len])
        order = mx.argpartition(-ranked, kth=keep - 1, axis=-1)
        self.evicted += self._len - keep
        return order[..., :keep], order[..., keep:]

    def _eviction_ranks(self, pos: mx.array) -> mx.array:
        """What eviction keeps the top of: middle tokens by score, sinks and recent at +inf."""
        value = self.score_rule.rank(self.scores[..., : self._len], pos, self.seen)
        return mx.where(self._in_middle(pos), value, mx.inf)

    def _in_middle(self, pos: mx.array) -> mx.array:
        """Which of these positions are neither sinks nor in the recent window."""
        return (pos >= self.sink) & (pos < self.seen - self.recent)


def gather_slots(buf: mx.array, idx: mx.array, capacity: int) -> mx.array:
    """`buf`'s slots `idx` along axis 2, in a buffer of `capacity` slots (spares zeroed)."""
    picked = mx.take_along_axis(buf, idx, axis=2)
    if capacity == picked.shape[2]:
        return picked
    fresh = mx.zeros((*buf.shape[:2], capacity, *buf.shape[3:]), dtype=buf.dtype)
    fresh[:, :, : picked.shape[2]] = picked
    return fresh


def turn_keys(rope, keys: mx.array, delta: mx.array) -> mx.array:
    """keys [B, H, n, D] each rotated by its own `delta` [B, H, n] positions through `rope`."""
    B, H, n, D = keys.shape
    flat = keys.reshape(B * H * n, 1, 1, D)  # one row per key: RoPE takes one offset per row
    # On the CPU stream: MLX 0.32.4's CUDA RoPE turns rows by negative per-row offsets
    # wrongly (errors of 4-8 on an H100, docs/gpu.md), and re-indexing turns keys back.
    # It runs once per wall / 8 tokens at most.
    with mx.stream(mx.cpu):
        turned = rope(flat, offset=delta.reshape(-1))
    return turned.reshape(B, H, n, D).astype(keys.dtype)
