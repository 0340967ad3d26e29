"""Dense H2O sessions decoding together: each layer's slots for all of them in one buffer.

Alone in a batched pass (cache/batch.py), an H2O session costs every decode step
one cache update, one scored attention call and one score update per layer. On a
GPU a decode step is launch-bound, so that cost grows with the sessions: 16 of them
decoded at 1.85x one session's rate on an H100, where 16 rows of one KVCache ran
at 8.9x (docs/gpu.md). KVSlab (cache/batch.py) already shares those calls among
plain sessions; this is the same for H2O.

Every member's layer is a row of [rows, kv_heads, max_kv + 1, ...] buffers (keys,
values, scores, positions). A step writes every row's new token into its row's
next free slot with one scatter, attends every row in one call (the slots a row
does not hold are masked), and accumulates every row's scores at once. Rows evict
on their own schedule, each ranked by its own cache's rule and tokens seen,
so a member keeps exactly the positions it would keep alone; rows that overflow in
the same step evict together (one ranking and one gather for all of them).

Members: sessions whose every layer is a dense `H2OKVCache` (not a subclass: packed,
merging and windowed layouts differ), never re-indexed, all with one configuration
(`slab_key`). While in the slab a member's caches keep their counters (length,
tokens seen, evicted) and no arrays; `leave` writes its rows back, `lend` hands out
views until the next step. A member nearing its model's context must leave first
(`near_wall`): re-indexing runs alone.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable

import mlx.core as mx

from cache.attention import DENSE
from cache.h2o import H2OKVCache, gather_slots

_BUFFERS = ("keys", "values", "scores", "positions")


def slab_key(caches: list) -> tuple | None:
    """What the members of one H2OSlab share, or None if these caches cannot join one."""
    if not caches:
        return None
    for c in caches:
        if type(c) is not H2OKVCache or c.positions is None or c.lags is not None:
            return None
    return tuple(
        (c.max_size, c.sink, c.heavy, c.recent, c.evict_batch, c.score_rule, c.keys.dtype)
        + (c.keys.shape[1], c.keys.shape[3], c.values.shape[3])
        for c in caches
    )


def near_wall(caches: list[H2OKVCache], margin: int = 2) -> bool:
    """Whether a cache may re-index within `margin` tokens (H2OKVCache.evict_if_full)."""
    c = caches[0]  # every layer has seen as many tokens
    return c.rope is not None and c.offset + margin >= c.wall - c.wall // 4


class H2OSlabLayer:
    """One layer of an H2OSlab: a part of a BatchedCache, attended by the router."""

    def __init__(self, slab: H2OSlab, index: int, buffers: tuple):
        self.slab, self.index = slab, index
        self.keys, self.values, self.scores, self.positions = buffers
        self._valid = None  # bool [rows, 1, 1, slots]: the slots each row holds this step

    @property
    def rows(self) -> int:
        return len(self.slab.members)

    def _caches(self) -> list[H2OKVCache]:
        return [caches[self.index] for caches in self.slab.caches]

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE positions of the next token."""
        return self.slab.constant("offset", tuple(c.offset for c in self._caches()))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store one new token per row in the row's next free slot; return whole buffers."""
        if keys.shape[2] != 1:
            raise ValueError("an H2O slab decodes one token per row; prefill runs alone")
        caches = self._caches()
        at = self.slab.constant("slot", tuple(c._len for c in caches))
        seen = self.slab.constant("seen", tuple(c.seen for c in caches))
        B, H = keys.shape[:2]

        def put(buf: mx.array, new: mx.array) -> mx.array:
            where = mx.broadcast_to(at.reshape(B, 1, 1, *[1] * (new.ndim - 3)), new.shape)
            return mx.put_along_axis(buf, where, new, axis=2)

        self.keys, self.values = put(self.keys, keys), put(self.values, values)
        self.positions = put(self.positions, mx.broadcast_to(seen.reshape(B, 1, 1), (B, H, 1)))
        for c in caches:
            c._len += 1
            c.offset += 1
        held = tuple(c._len for c in caches)
        self._valid = self.slab.constant("held", held, self.positions.shape[-1])
        return self.keys, self.values

    def kv_segments(self, keys, values) -> list:
        return [(keys, values, DENSE)]

    def attention_mask(self, n_heads: int, n_queries: int) -> mx.array:
        return self._valid

    def size(self) -> int:
        return self.positions.shape[-1]

    def update_scores(self, logits: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate every row's scores at once, then evict the rows that overflow."""
        caches = self._caches()
        rule = caches[0].score_rule
        updated = rule.accumulate(self.scores, logits, self.positions.shape[1], probs)
        # Slots a row does not hold stay at 0, as a lone cache's free slots are.
        self.scores = mx.where(self._valid[:, 0], updated, 0.0)
        full = [i for i, c in enumerate(caches) if c._len > c._slot_budget]
        if full:
            self._evict_rows(full, [caches[i] for i in full])

    def _evict_rows(self, rows: list[int], caches: list[H2OKVCache]) -> None:
        """The rows that overflow this step evict together (they hold equally many slots:
        one past max_kv), ranked by a copy of their first cache over their stacked rows
        with each row's own tokens seen: every row keeps what it would keep alone."""
        view = copy.copy(caches[0])
        at = mx.array(rows)
        for name in _BUFFERS:
            setattr(view, name, getattr(self, name)[at])
        view.seen = self.slab.constant("seen", tuple(c.seen for c in caches)).reshape(-1, 1, 1)
        kept, _ = view._eviction_split()
        width, n = self.positions.shape[-1], view._len
        view._gather_kv(kept, width)
        for name in ("scores", "positions"):
            setattr(view, name, gather_slots(getattr(view, name)[..., :n], kept, width))
        for name in _BUFFERS:
            getattr(self, name)[at] = getattr(view, name)
        for c in caches:
            c.evicted += n - kept.shape[-1]
            c._len = kept.shape[-1]


class H2OSlab:
    """Dense H2O sessions of one configuration decoding together (see the module doc)."""

    def __init__(self, key: tuple):
        self.key = key
        self.members: list[Hashable] = []  # row order
        self.caches: list[list[H2OKVCache]] = []  # each member's caches, row order
        self.layers: list[H2OSlabLayer] = []
        self._lent: list[list[H2OKVCache]] = []
        self._constants: dict = {}

    def __contains__(self, member: Hashable) -> bool:
        return member in self.members

    @property
    def rows(self) -> int:
        return len(self.members)

    def begin_step(self) -> None:
        """A forward pass starts: per-row arrays built in the last one are stale."""
        self._constants = {}

    def constant(self, kind: str, values: tuple, width: int | None = None) -> mx.array:
        """Per-row int32 [rows] (`held` with a width: bool [rows, 1, 1, width], slot <
        held), built once per step and shared by every layer with the same values."""
        key = (kind, values, width)
        if key not in self._constants:
            row = mx.array(values, dtype=mx.int32)
            if width is not None:
                row = (mx.arange(width, dtype=mx.int32)[None] < row[:, None])[:, None, None]
            self._constants[key] = row
        return self._constants[key]

    def join(self, sessions: list[tuple[Hashable, list[H2OKVCache]]]) -> None:
        """Move sessions' slots into the slab as its last rows (one copy of the slab)."""
        self.reclaim()
        per_layer = list(zip(*(caches for _, caches in sessions), strict=True))
        if not self.layers:
            self.layers = [H2OSlabLayer(self, n, (None,) * 4) for n in range(len(per_layer))]
        for layer, caches in zip(self.layers, per_layer, strict=True):
            width = caches[0].max_size + 1
            for name in _BUFFERS:
                rows = [_widened(getattr(c, name), width) for c in caches]
                held = getattr(layer, name)
                setattr(layer, name, mx.concatenate(rows if held is None else [held, *rows]))
        for member, caches in sessions:
            self.members.append(member)
            self.caches.append(caches)
            for c in caches:
                for name in _BUFFERS:
                    setattr(c, name, None)

    def leave(self, member: Hashable, caches: list[H2OKVCache] | None) -> None:
        """Take a member's row out; write it back into its caches (None: drop it)."""
        self.reclaim()
        i = self.members.index(member)
        del self.members[i]
        own = self.caches.pop(i)
        written = []
        for layer, c in zip(self.layers, own, strict=True):
            if caches is not None:
                for name in _BUFFERS:
                    setattr(c, name, mx.contiguous(getattr(layer, name)[i : i + 1]))
                c._reset_free_slots()  # a free slot holds the position its token will have
                written += [getattr(c, name) for name in _BUFFERS]
            for name in _BUFFERS:
                a = getattr(layer, name)
                setattr(layer, name, mx.concatenate([a[:i], a[i + 1 :]]) if self.members else None)
        if not self.members:
            self.layers = []
        mx.async_eval(written)  # copied now: a lazy copy would keep the old slab alive

    def lend(self, member: Hashable, caches: list[H2OKVCache]) -> None:
        """Give a member's caches views of its rows, for a reader between steps."""
        i = self.members.index(member)
        for layer, c in zip(self.layers, caches, strict=True):
            for name in _BUFFERS:
                setattr(c, name, getattr(layer, name)[i : i + 1])
        self._lent.append(caches)

    def reclaim(self) -> None:
        """Drop lent views, so the slab's buffers are its own again."""
        for caches in self._lent:
            for c in caches:
                for name in _BUFFERS:
                    setattr(c, name, None)
        self._lent = []


def _widened(buf: mx.array, width: int) -> mx.array:
    """`buf` [1, H, slots, ...] with `width` slots, the extra ones zero."""
    extra = width - buf.shape[2]
    if extra <= 0:
        return buf[:, :, :width]
    pad = mx.zeros((*buf.shape[:2], extra, *buf.shape[3:]), dtype=buf.dtype)
    return mx.concatenate([buf, pad], axis=2)
