"""H2O sessions decoding together: each layer's slots for all of them in one buffer.

Alone in a batched pass (cache/batching/batch.py), an H2O session costs every decode step
one cache update, one scored attention call and one score update per layer. On a
GPU a decode step is launch-bound, so that cost grows with the sessions: 16 of them
decoded at 1.85x one session's rate on an H100, where 16 rows of one KVCache ran
at 8.9x (docs/gpu.md). KVSlab (cache/batching/batch.py) already shares those calls among
plain sessions; this is the same for H2O.

Every member's layer is a row of [rows, kv_heads, max_kv + 1, ...] buffers (keys,
values, scores, positions; packed K/V as mx.quantize's words, scales and biases) and a
mask of the slots each row's heads hold. A step encodes every row's new token at once
and writes it into each head's first free slot with one scatter per buffer, attends
every row in one call (the slots a head does not hold are masked), and accumulates
every row's scores at once. Rows evict on their own schedule, each ranked by its own
cache's rule and tokens seen, so a member keeps exactly the positions it would keep
alone; eviction only frees the leaving slots (one ranking for every row that evicts
that step, no K/V copied) and the next tokens fill them. Slot order is the slab's
own: a row leaving or lent is laid out as a lone cache holds it (held slots first, in
position order), which is what the packed layouts need (their sink pool shadows the
first slots) and any order serves a dense one.

Members: sessions whose every layer's cache has a `slab_key` (cache/contract.py): dense
`H2OKVCache` and packed `QuantizedH2OKVCache` (h2o-q8, h2o-q4, h2o-mixed k8v4) opt in;
merging, windowed and tiled layouts differ and do not), never re-indexed, all with one
configuration (`slab_key`). A member's arrays are the ones its caches name
(`slab_buffers`). A packed row also stacks its key centre and dense sink pool, and joins
once that pool is full (its sinks seen); with 4-bit keys also its dense tail, once that
holds its newest tokens past the sinks: the slab keeps the slot each tail token fills,
masks those packed copies and scores the tail's logits in their slots; it encodes and
writes the copies for all rows once every `tail` steps, as a lone cache does (and before
rows move or are read: `pack_pending`). While in the slab a member's caches hold no
arrays, and their counters (length, tokens seen) lag by the steps since the slab last
counted them: a step counts its token once (`uncounted`), not per row and layer, and
`count_tokens` brings them up to date before eviction, `lend` and `leave` read them.
`leave` writes a member's rows back, `lend` hands out copies until the next step. A
member nearing its model's context must leave first (`near_wall`): re-indexing runs alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from functools import partial

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from cache.attention import ATTENTION, DENSE, KVFormat
from cache.compiled_decode import (
    attended_and_scored,
    compiled_on_template,
    scatter_write,
    scored,
    select_write,
    updated_scores,
)
from cache.contract import LayerCache, ScoredCache
from cache.policies.h2o import SLOT_BUFFERS as SLOTS
from cache.policies.h2o import H2OKVCache
from cache.policies.quantized import encoded, shifted_in


def slab_key(caches: list) -> tuple | None:
    """What the members of one H2OSlab share, or None if these caches cannot join one."""
    if not caches or not all(isinstance(c, LayerCache) for c in caches):
        return None
    key = tuple(c.slab_key() for c in caches)
    return None if any(k is None for k in key) else key


def near_wall(caches: list[H2OKVCache], margin: int = 2, lag: int = 0) -> bool:
    """Whether a cache may re-index within `margin` tokens (H2OKVCache.evict_if_full);
    `lag`: tokens it took that its counters do not count yet (a slab's member)."""
    c = caches[0]  # every layer has seen as many tokens
    return c.rope is not None and c.offset + lag + margin >= c.reindex_from


class H2OSlabLayer(ScoredCache):
    """One layer of an H2OSlab: a part of a BatchedCache, attended by the router."""

    def __init__(self, slab: H2OSlab, index: int, names: tuple[str, ...]):
        self.slab, self.index, self.names = slab, index, names
        self.keys = self.values = self.scores = self.positions = None  # [rows, H, slots, ...]
        self.key_center = self.sink_keys = self.sink_values = None  # packed rows: [rows, H, ..]
        self.tail_keys = self.tail_values = None  # [rows, H, tail, D]: newest tokens, dense
        self.held = None  # bool [rows, H, slots]: the slots each row's head holds
        self.tail_slots = None  # int32 [rows, H, tail]: the slot each tail token fills
        # The newest tail tokens whose packed copies wait (every row alike: rows join with
        # none waiting and take a token each step), as a lone cache's `unpacked`.
        self.unpacked = 0
        self._mask = None  # this step's `held` per query head, [rows, q_heads, 1, slots]
        # Tokens every row could take, as its caches count, before one holds more than its
        # slot budget (`count_room`); the slab's uncounted steps are taken from it.
        self._room = 0
        self._step_settings = self._step = None  # `_decode_step`, and what it was made for
        self._pool_shape = self._pool_masks_of = None  # `_pool_masks`, and the shape it fits

    @property
    def rows(self) -> int:
        return len(self.slab.members)

    def forget_mask(self) -> None:
        """The rows or the slots they hold changed: the next attention builds its mask."""
        self._mask = None

    def _caches(self) -> list[H2OKVCache]:
        return self.slab.layer_caches[self.index]

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE positions of the next token."""
        return self.slab.seen_at_start()  # members are never re-indexed: offset == seen

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        """Store one new token per row and head in its first free slot; return whole buffers.
        Where the router's compiled decode serves the step, the store waits for it
        (`pending_store`): written, attended and scored in one compiled call."""
        if keys.shape[2] != 1:
            raise ValueError("an H2O slab decodes one token per row; prefill runs alone")
        seen = self.slab.seen_at_start()  # this layer's caches, before this token
        self.pending_store = (keys, values, seen)
        if not ATTENTION.stores_with_decode(self):
            self.store_pending()
        if self.index == 0:  # the step's first layer counts its token for every layer
            self.slab.uncounted += 1
        return self.keys, self.values

    def count_room(self) -> None:
        """`_room`, after the rows or what their caches count changed (rows evict on their
        own schedules)."""
        caches = self._caches()
        self._room = caches[0].slot_budget - max(c.used for c in caches) if caches else 0

    def store_pending(self) -> tuple:
        """Write the step's token now (a reader other than the compiled decode came)."""
        keys, values, seen = self.pending_store
        self.pending_store = None
        write = _compiled_write(self.slab.select_writes, self._caches()[0].kv_format)
        self._stored(write(self._arrays(), keys, values, seen))
        return self.keys, self.values

    def store_and_attend(self, queries, scale: float, mask, attend: Callable, how) -> mx.array:
        """The step's token written, every row attended over its slots and its scores
        accumulated, in one compiled call (what a GPU kernel that stores, attends and
        scores does); then the rows that overflow evict. `mask` (a decode query's) hides
        nothing: the held slots are the mask."""
        keys, values, seen = self.pending_store
        self.pending_store = None
        step, front = self._decode_step(queries, scale, attend, how)
        out, arrays = step(self._arrays(), self._pool_masks(front), queries, keys, values, seen)
        self._stored(arrays)
        self._evict_overflowing()
        return out

    def _decode_step(self, queries, scale: float, attend: Callable, how) -> tuple:
        """(this layer's compiled decode step, its front pool's tokens), kept while the
        router's attention and its settings are the same: what else keys the step is the
        layer's for as long as the slab lives (hashing it was ~4 us a layer and step)."""
        settings = (queries.shape[1], scale, attend, how)
        if self._step_settings != settings:
            caches, front = self._caches(), self._front()
            fmt, rule = caches[0].kv_format, caches[0].score_rule.accumulation
            group, n_kv = queries.shape[1] // self.held.shape[1], self.positions.shape[1]
            select = self.slab.select_writes
            step = _decode_step(select, fmt, group, front, rule, n_kv, scale, attend, how)
            self._step_settings, self._step = settings, (step, front)
        return self._step

    def _arrays(self) -> dict:
        """The buffers a step reads and writes, by name (those this layout has)."""
        arrays = {name: getattr(self, name) for name in _STEP_ARRAYS}
        return {name: a for name, a in arrays.items() if a is not None}

    def _stored(self, arrays: dict) -> None:
        """Take a step's written buffers; with a dense tail, its packed copy waits: packed
        with the tail's others once every `tail` steps (as a lone cache does)."""
        self.__dict__.update(arrays)
        self._mask = None
        if self.tail_keys is not None:
            self.unpacked += 1
            if self.unpacked == self.tail_slots.shape[2]:
                self.pack_pending()

    def pack_pending(self) -> None:
        """Write the packed copies the newest tail tokens wait for, every row's at once."""
        n, self.unpacked = self.unpacked, 0
        if not n:
            return
        tail = (self.tail_keys[:, :, -n:], self.tail_values[:, :, -n:])
        keys, values = self._caches()[0].encode(*tail)
        put = partial(scatter_write, self.tail_slots[:, :, -n:])
        self.keys, self.values = tree_map(put, self.keys, keys), tree_map(put, self.values, values)

    def kv_segments(self, keys, values) -> list:
        """Every slot of every row; a packed row's dense sink pool (the first part) shadows
        its first slots (read whole, masked: no slice per buffer and step), its dense tail
        (the last part) the slots its newest tokens fill."""
        fmt = self._caches()[0].kv_format
        return _parts(self._arrays() | {"keys": keys, "values": values}, fmt)

    def attention_mask(self, n_heads: int, n_queries: int, mask=None) -> mx.array:
        """The sink pool, all of it; the slots each query head's KV head holds, but for the
        packed copies the pools serve (the sinks', the tail tokens'); then the tail."""
        if self._mask is None:
            front, group = self._front(), n_heads // self.held.shape[1]
            self._mask = _visible(self._arrays(), self._pool_masks(front), group)
        return self._mask

    def size(self) -> int:
        return self.positions.shape[-1]

    def update_scores(self, logits: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate every row's scores at once, then evict the rows that overflow."""
        rule, n_kv = self._caches()[0].score_rule, self.positions.shape[1]
        tail, front = self._tail(), self._front()
        self.scores = scored(rule, n_kv, self.scores, [self.held], logits, probs, tail, front)
        self._evict_overflowing()

    @property
    def sums_probabilities(self) -> bool:
        return self._caches()[0].sums_probabilities  # every row's rule is the same

    def update_weights(self, weights: Callable[[mx.array], mx.array]) -> bool:
        """Dense rows (no pools whose logits move); a free slot's logit is masked and its
        score 0, so held + weights needs no `held` select."""
        pools = self.sink_keys is not None or self.tail_keys is not None
        if pools or not self.sums_probabilities:
            return False
        self.scores = weights(self.scores)
        self._evict_overflowing()
        return True

    fused_decode = True  # the slots' shapes stay fixed while the rows do

    def attend_decode(
        self, queries, parts: list, scale: float, mask, attend: Callable, how, bias=None
    ) -> mx.array:
        """Attention over `parts` (`attend`: the router's op-by-op attention, `how` its
        settings) and the score update in one compiled call (what a GPU kernel's epilogue
        does), then eviction. The logits and probabilities stay inside the fused graph."""
        rule, n_kv = self._caches()[0].score_rule, self.positions.shape[1]
        out, self.scores = attended_and_scored(
            queries, parts, scale, mask, attend, how, rule, n_kv, self.scores, [self.held],
            self._tail(), self._front(), bias,
        )  # fmt: skip
        self._evict_overflowing()
        return out

    def _pool_masks(self, front: int) -> tuple:
        """(slots past the sink pool [slots], [the pool, all visible], [the tail, all
        visible]): built and evaluated once per shape, so no step builds them."""
        rows, heads, slots = self.held.shape
        tail = 0 if self.tail_slots is None else self.tail_slots.shape[2]
        shape = (rows, heads, slots, front, tail)
        if self._pool_shape != shape:
            ones = partial(mx.ones, dtype=mx.bool_)
            self._pool_masks_of = (
                mx.arange(slots) >= front,
                [ones((rows, heads, front))] if front else [],
                [ones((rows, heads, tail))] if tail else [],
            )
            mx.eval(self._pool_masks_of)
            self._pool_shape = shape
        return self._pool_masks_of

    def _front(self) -> int:
        """The dense sink pool's tokens, read before every slot (cache/compiled_decode.py)."""
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    def _tail(self) -> list:
        """[the slot each tail token fills] for a layout with a dense tail, else []."""
        return [] if self.tail_keys is None else [self.tail_slots]

    def _evict_overflowing(self) -> None:
        """After the scores: evict the rows this step took past their slot budget."""
        if self._room < self.slab.uncounted:  # this step's token took some row past it
            self.slab.count_tokens()
            caches = self._caches()
            self._evict(tuple(c.used > c.slot_budget for c in caches), caches)

    def _evict(self, full: tuple[bool, ...], caches: list[H2OKVCache]) -> None:
        """Rows that overflow free their leaving slots, ranked as alone (their cache's rule,
        their own tokens seen), and the next tokens fill them: no K/V moves. A full row
        holds every slot, so one ranking over the slab serves every row that evicts; it is
        one compiled call (rows evict on their own schedules, so most steps have one)."""
        key = self.slab.key[self.index]
        if key not in _EVICTIONS:
            _EVICTIONS[key] = compiled_on_template(caches[0], _free_leaving, ("held", "scores"))
        buffers = {"scores": self.scores, "positions": self.positions, "held": self.held}
        if caches[0].score_rule.reads_kv:  # the rule ranks by the rows' keys and values too
            buffers |= {n: getattr(self, n) for n in self.names if n not in buffers}
        seen = (self.slab.seen_at_start() + 1).reshape(-1, 1, 1)  # this token's counted
        scalars = {"seen": seen, "evicting": mx.array(full)}
        out = _EVICTIONS[key](buffers, scalars)
        self.held, self.scores, self._mask = out["held"], out["scores"], None
        keep = caches[0].keep
        for c, evicts in zip(caches, full, strict=True):
            if evicts:
                c.evicted += c.used - keep
                c.used = keep
        self.count_room()

    def row(self, i: int) -> dict[str, object]:
        """Row i as a lone cache lays it out: held slots first, in position order."""
        far = mx.array(2**31 - 1, dtype=mx.int32)
        order = mx.argsort(mx.where(self.held[i : i + 1], self.positions[i : i + 1], far), -1)

        def compact(a: mx.array) -> mx.array:
            return mx.take_along_axis(
                a[i : i + 1], order.reshape(*order.shape, *[1] * (a.ndim - 3)), 2
            )

        out = {}
        for name in self.names:
            buf = getattr(self, name)
            pick = compact if name in SLOTS else (lambda a: a[i : i + 1])
            out[name] = tree_map(lambda a, f=pick: mx.contiguous(f(a)), buf)
        return out


class SlabRows:
    """What every slab answers of its members (row order): whether one is in it, how many;
    an H2O one (`caches`, `uncounted`) also whether one must leave to re-index."""

    members: list[Hashable]

    def __contains__(self, member: Hashable) -> bool:
        return member in self.members

    @property
    def rows(self) -> int:
        return len(self.members)

    def admits(self, caches: list[list]) -> list[bool]:
        """Which of these sessions (their caches) may join, in order: all, where rows need
        no padding (a padded slab weighs it: cache/batching/kvarn_padded.py)."""
        return [True] * len(caches)

    def near_wall(self, member: Hashable) -> bool:
        """Module `near_wall` for a member, whose caches do not count `uncounted` tokens."""
        return near_wall(self.caches[self.members.index(member)], lag=self.uncounted)


class H2OSlab(SlabRows):
    """H2O sessions of one configuration decoding together (see the module doc)."""

    def __init__(self, key: tuple):
        self.key = key
        self.members: list[Hashable] = []  # row order
        self.caches: list[list[H2OKVCache]] = []  # each member's caches, row order
        self.layer_caches: list[list[H2OKVCache]] = []  # the same per layer (every step's)
        self.layers: list[H2OSlabLayer] = []
        self._lent: list[list[H2OKVCache]] = []
        self._seen: mx.array | None = None  # seen_at_start, for the step under way
        # Tokens every row took that its caches do not count yet (`count_tokens`).
        self.uncounted = 0
        # How a step writes its tokens: a scatter touches only the new slots (the CPU's
        # memory bandwidth is the limit there); on a GPU one select over the buffers costs
        # less than a scatter launch (bench/slab_steps.py measures both).
        self.select_writes = mx.default_device() == mx.gpu

    def begin_step(self) -> None:
        """A forward pass starts: per-row arrays built in the last one are stale."""
        self._seen = None

    def count_tokens(self) -> None:
        """Count the tokens every row took since the last count in its caches (members are
        never re-indexed: offset += n is seen += n). A step only counts its token once, for
        every row and layer (`uncounted`): touching each row's caches at every layer cost
        ~10 us a layer, 16 rows. Counted before the caches are read: eviction, lend, leave,
        join."""
        n, self.uncounted = self.uncounted, 0
        if not n:
            return
        for layer, caches in zip(self.layers, self.layer_caches, strict=True):
            for c in caches:
                c.used += n
                c.seen += n
            layer._room -= n

    def seen_at_start(self) -> mx.array:
        """Every row's tokens seen as this step began, int32 [rows]: what each layer's
        caches hold until that layer's update (built once per step, for every layer)."""
        if self._seen is None:  # built in the step's first layer, before its token counts
            n = self.uncounted
            self._seen = mx.array([caches[0].seen + n for caches in self.caches], mx.int32)
        return self._seen

    def join(self, sessions: list[tuple[Hashable, list[H2OKVCache]]]) -> None:
        """Move sessions' rows into the slab as its last rows (one copy of the slab)."""
        self.reclaim()
        self.count_tokens()  # the rows here first: `uncounted` is not the new rows'
        self.pack_pending()  # the rows after join wait for none, as the new ones
        for _, caches in sessions:  # the slab reads every slot it did not write packed
            for c in caches:
                c.pack_pending()
        per_layer = list(zip(*(caches for _, caches in sessions), strict=True))
        if not self.layers:
            names = [caches[0].slab_buffers() for caches in per_layer]
            self.layers = [H2OSlabLayer(self, n, layer) for n, layer in enumerate(names)]
            for layer, caches in zip(self.layers, per_layer, strict=True):
                layer.scores_with_step = caches[0].scores_with_step
        for layer, caches in zip(self.layers, per_layer, strict=True):
            width = caches[0].max_size + 1
            for name in layer.names:
                rows = [getattr(c, name) for c in caches]
                if name in SLOTS:
                    rows = [tree_map(partial(_widened, width=width), r) for r in rows]
                have = getattr(layer, name)
                stacked = rows if have is None else [have, *rows]
                setattr(layer, name, tree_map(lambda *a: mx.concatenate(a), *stacked))
            # A lone cache holds its first _len slots, every head alike.
            lens = mx.array([c.used for c in caches], dtype=mx.int32)[:, None, None]
            held = mx.arange(width, dtype=mx.int32) < lens
            held = mx.broadcast_to(held, (len(caches), layer.positions.shape[1], width))
            layer.held = held if layer.held is None else mx.concatenate([layer.held, held])
            if "tail_keys" in layer.names:  # ... its tail the last of them
                T = caches[0].tail
                tail = lens - T + mx.arange(T, dtype=mx.int32)
                tail = mx.broadcast_to(tail, (len(caches), layer.positions.shape[1], T))
                have = layer.tail_slots
                layer.tail_slots = tail if have is None else mx.concatenate([have, tail])
            layer.forget_mask()
        for member, caches in sessions:
            self.members.append(member)
            self.caches.append(caches)
            for layer, c in zip(self.layers, caches, strict=True):
                for name in layer.names:
                    setattr(c, name, None)
        self.layer_caches = [list(layer) for layer in zip(*self.caches, strict=True)]
        for layer in self.layers:
            layer.count_room()

    def leave(self, member: Hashable, caches: list[H2OKVCache] | None) -> None:
        """Take a member's row out; write it back into its caches (None: drop it)."""
        self.reclaim()
        self.count_tokens()
        self.pack_pending()
        i = self.members.index(member)
        del self.members[i], self.caches[i]
        self.layer_caches = [list(layer) for layer in zip(*self.caches, strict=True)]
        written = []
        for n, layer in enumerate(self.layers):
            if caches is not None:
                for name, arrays in layer.row(i).items():
                    setattr(caches[n], name, arrays)
                    written += _leaves(arrays)
                caches[n].reset_free_slots()  # a free slot holds its next token's position
            for name in (*layer.names, "held", "tail_slots"):
                buf = getattr(layer, name)
                if buf is not None:
                    rest = tree_map(lambda a: mx.concatenate([a[:i], a[i + 1 :]]), buf)
                    setattr(layer, name, rest if self.members else None)
            layer.forget_mask()
        if not self.members:
            self.layers = []
        for layer in self.layers:
            layer.count_room()
        mx.async_eval(written)  # copied now: a lazy copy would keep the old slab alive

    def lend(self, member: Hashable, caches: list[H2OKVCache]) -> None:
        """Give a member's caches copies of its rows, for a reader between steps."""
        self.count_tokens()
        self.pack_pending()
        i = self.members.index(member)
        for layer, c in zip(self.layers, caches, strict=True):
            for name, arrays in layer.row(i).items():
                setattr(c, name, arrays)
        self._lent.append(caches)

    def pack_pending(self) -> None:
        """Every layer's waiting packed copies written: before rows move or are read."""
        for layer in self.layers:
            layer.pack_pending()

    def reclaim(self) -> None:
        """Drop lent copies: the slab holds the rows."""
        for caches in self._lent:
            for layer, c in zip(self.layers, caches, strict=True):
                for name in layer.names:
                    setattr(c, name, None)
        self._lent = []


_EVICTIONS: dict[Hashable, Callable] = {}  # compiled slab evictions by layer configuration


def _free_leaving(view: H2OKVCache) -> None:
    """On a row cache's template given the slab's `scores`, `positions`, `held`, `seen`
    [rows, 1, 1] and `evicting` [rows]: free each evicting row's leaving slots, ranked by
    the rule as alone, and zero the scores of every slot a row does not hold."""
    view.used = view.positions.shape[-1]
    ranked = view.eviction_ranks(view.positions)
    leaving = mx.argpartition(-ranked, kth=view.keep - 1, axis=-1)[..., view.keep :]
    freed = mx.put_along_axis(view.held, leaving, mx.array(False), axis=2)
    view.held = mx.where(view.evicting[:, None, None], freed, view.held)
    view.scores = mx.where(view.held, view.scores, 0.0)


# What a step reads and writes of a layer, by name (cache/compiled_decode.py's inputs).
_STEP_ARRAYS = (
    "held", "positions", "keys", "values", "scores", "key_center", "sink_keys", "sink_values",
    "tail_keys", "tail_values", "tail_slots",
)  # fmt: skip


def _written(select: bool, fmt: KVFormat, arrays: dict, keys, values, seen) -> dict:
    """A step's token per row in each head's first free slot: the `arrays` it changes
    (held, positions, and K/V, or with a dense tail the tail and the slots its tokens fill:
    the packed copy waits). `seen` [rows]: each row's tokens before this one."""
    held = arrays["held"]
    B, H = held.shape[:2]
    at = mx.argmax(~held, axis=-1, keepdims=True)  # [B, H, 1]: a row holds max_kv at most
    if select:  # on a GPU one select over the buffers costs less than a scatter launch
        taken = mx.arange(held.shape[-1], dtype=at.dtype) == at  # [B, H, slots]
        put, held = partial(select_write, taken), held | taken
    else:
        put, held = partial(scatter_write, at), mx.put_along_axis(held, at, mx.array(True), 2)
    seen = mx.broadcast_to(seen.reshape(B, 1, 1), (B, H, 1))
    written = {"held": held, "positions": put(arrays["positions"], seen)}
    if "key_center" in arrays:  # packed rows store keys centred (cache/policies/quantized.py)
        keys = keys - arrays["key_center"]
    if "tail_keys" in arrays:
        written["tail_keys"] = shifted_in(arrays["tail_keys"], keys)
        written["tail_values"] = shifted_in(arrays["tail_values"], values)
        written["tail_slots"] = shifted_in(arrays["tail_slots"], at.astype(mx.int32))
    else:
        new_keys, new_values = encoded(fmt, keys, values)
        written["keys"] = tree_map(put, arrays["keys"], new_keys)
        written["values"] = tree_map(put, arrays["values"], new_values)
    return written


def _visible(arrays: dict, pool_masks: tuple, group: int) -> mx.array:
    """The step's mask [rows, q_heads, 1, keys] over `_parts`: the sink pool, the held
    slots but the packed copies a pool serves (the sinks', the tail tokens'), the tail."""
    visible = arrays["held"]
    past_front, pools, tail = pool_masks
    if "tail_slots" in arrays:
        visible = mx.put_along_axis(visible, arrays["tail_slots"], mx.array(False), axis=2)
    if pools or tail:
        if pools:
            visible = visible & past_front
        visible = mx.concatenate([*pools, visible, *tail], axis=2)
    return mx.repeat(visible[:, :, None], group, axis=1)


def _parts(arrays: dict, fmt: KVFormat) -> list:
    """Attention's parts: [dense sink pool |] every slot [| dense tail]."""
    slots = (arrays["keys"], arrays["values"], fmt)
    if "sink_keys" not in arrays:
        return [slots]
    tail = [(arrays["tail_keys"], arrays["tail_values"], DENSE)] if "tail_keys" in arrays else []
    return [(arrays["sink_keys"], arrays["sink_values"], DENSE), slots, *tail]


@functools.cache
def _compiled_write(select: bool, fmt: KVFormat) -> Callable:
    """`_written` as one compiled call: shapes stay fixed while the rows do, so the graph
    is traced once and replayed, its element-wise ops fused."""
    return mx.compile(partial(_written, select, fmt))


@functools.cache
def _decode_step(
    select: bool, fmt: KVFormat, group: int, front: int, rule, n_kv: int, scale: float,
    attend: Callable, how: tuple,
) -> Callable:  # fmt: skip
    """A layer's decode step in one compiled call: `_written`, then attention over the
    written slots (`attend`: the router's op-by-op attention, `how` its settings) and the
    score update. (arrays, pool masks, queries, keys, values, seen) -> (out, written)."""

    def step(arrays: dict, pool_masks: tuple, queries, keys, values, seen) -> tuple:
        written = _written(select, fmt, arrays, keys, values, seen)
        arrays = arrays | written
        mask = _visible(arrays, pool_masks, group)
        out, logits, probs = attend(queries, _parts(arrays, fmt), scale, mask)
        tail = [arrays["tail_slots"]] if "tail_slots" in arrays else []
        held = [arrays["held"]]
        scores = updated_scores(rule, n_kv, arrays["scores"], held, logits, probs, tail, front)
        # Evaluating the output evaluates the scores (cache/compiled_decode.py).
        return mx.depends([out], [scores])[0], written | {"scores": scores}

    return mx.compile(step)


def _leaves(tree) -> list[mx.array]:
    return [a for _, a in tree_flatten(tree)]


def _widened(buf: mx.array, width: int) -> mx.array:
    """`buf` [1, H, slots, ...] with `width` slots, the extra ones zero."""
    extra = width - buf.shape[2]
    if extra <= 0:
        return buf[:, :, :width]
    return mx.pad(buf, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (buf.ndim - 3))
