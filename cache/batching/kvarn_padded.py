"""KVarNPaddedSlab: `kvarn` sessions of one configuration decoding as one cache per layer.

A KVarNCache (cache/policies/kvarn.py) keeps every token: a dense front pool (`sink` slots), packed
tiles, a dense tail pool (`tile` slots). Sessions of a chat server hold different counts,
so their layouts differ: side by side in a batched pass each is a part of its own, one
store and one attention call per session and layer. Here every member is a row of one
layer cache, padded the way mlx-lm's BatchKVCache pads plain rows, but in tiles (8
sessions of the default model: 218-238 ms a step as parts, 179-200 here, stock mlx-lm's
8 rows 124-139; 3.84x stock's ops as parts, 1.25x here: docs/batch_scaling_kvarn.md,
docs/gpu.md):

- `dense` [rows, H, sink + tile, D] (keys, values): each row's front pool, then its tail
  pool; a step writes each row's token into its next slot (one scatter per pool);
- `tiles` [rows, H, capacity, ...]: each row's packed tiles first, zero tiles after;
- a mask [rows, 1, 1, slots] of what each row holds, built once per step for every layer.

Decoding needs no slot order (RoPE positions are in the keys), so a row attends its
front, tail and tiles in any order under the mask, in one call of the KVarN kernel for
every row. A row's tail packs in the step that fills it, as alone (its tile encoded from
the same dense tokens), so each row holds what its own cache would. Every layer of a row
holds one layout (no eviction): the slab keeps each row's counts on the host and builds
the step's write slots and mask from them (`begin_step`).

Padding costs the tiles the longest row holds more than each other row: the batcher
admits a session while the slab's tiles stay within twice the ones its rows hold
(`admits`). Memory stays in the budget: a row's padded size is at most the longest
row's, and the budget holds every session at the model's whole context.

While in the slab a member's caches hold no arrays; `lend` (a reader between steps) and
`leave` hand them their row, laid out as a lone cache holds it, and its counts.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from cache.attention import KVFormat
from cache.batching.kvarn_slab import LendingRows, drop_arrays
from cache.compiled_decode import scatter_write
from cache.contract import ScoredCache
from cache.policies.kvarn import KVarNCache
from cache.policies.kvarn_tiles import encode_tiles
from kernels.hadamard import rotate


@dataclass
class RowLayout:
    """What a row holds, alike in every layer: pool fills, packed tiles, tokens seen."""

    n_front: int
    n_tiles: int
    n_tail: int
    offset: int

    def next_slot(self, sink: int) -> int:
        """The dense slot the next token goes to: the front pool's next, else the tail's."""
        return self.n_front if self.n_front < sink else sink + self.n_tail

    def after_token(self, sink: int, tile: int) -> RowLayout:
        if self.n_front < sink:
            return RowLayout(self.n_front + 1, self.n_tiles, self.n_tail, self.offset + 1)
        if self.n_tail + 1 == tile:  # the token fills the tail: it packs into a tile
            return RowLayout(self.n_front, self.n_tiles + 1, 0, self.offset + 1)
        return RowLayout(self.n_front, self.n_tiles, self.n_tail + 1, self.offset + 1)


@dataclass
class StepPlan:
    """One decode step's per-row work, shared by every layer."""

    at: mx.array  # int32 [rows, 1, 1]: the dense slot each row's token goes to
    packs: list[tuple[int, int]]  # (row, tile index): rows whose tail this token fills
    mask: mx.array  # bool [rows, 1, 1, sink + tile + tiles * tile]: what each row holds
    offset: mx.array  # int32 [rows]: tokens each row saw before the step (RoPE's)


class KVarNPaddedLayer(ScoredCache):
    """One layer of a KVarNPaddedSlab: a part of a BatchedCache, attended by the router
    through the KVarN kernel under the step's mask."""

    def __init__(self, slab: KVarNPaddedSlab, proto: KVarNCache):
        self.slab = slab
        self.fmt, self.sink, self.tile = proto.fmt, proto.sink, proto.tile
        self.sinkhorn_iters = proto.sinkhorn_iters
        self.dense: list[mx.array] | None = None  # [keys, values]
        self.tiles: list[list[mx.array]] | None = None  # [key tiles, value tiles]

    @property
    def rows(self) -> int:
        return self.dense[0].shape[0]

    @property
    def offset(self) -> mx.array:
        return self.slab.plan.offset

    def add_rows(self, caches: list[KVarNCache], layouts: list[RowLayout], capacity: int):
        """Append these caches' arrays as the last rows, every row's tiles padded to
        `capacity` with zero tiles."""
        dense = [_dense_pools(c) for c in caches]
        tiles = [(1, c.tiles if n.n_tiles else None) for c, n in zip(caches, layouts, strict=True)]
        if self.dense is not None:
            dense = [self.dense, *dense]
            tiles = [(self.rows, self.tiles), *tiles]
        self.dense = tree_map(lambda *a: mx.concatenate(a), *dense)
        if capacity:
            self.tiles = tree_map(lambda *a: mx.concatenate(a), *_zero_padded(tiles, capacity))

    def row(self, i: int, layout: RowLayout) -> dict[str, object]:
        """Row i as a lone KVarNCache holds it (copies): its pools whole, its own tiles."""
        k, v = (mx.contiguous(p[i : i + 1]) for p in self.dense)
        tail = None
        if layout.n_front == self.sink and (layout.n_tiles or layout.n_tail):
            tail = [k[:, :, self.sink :], v[:, :, self.sink :]]
        tiles = None
        if layout.n_tiles:
            tiles = tree_map(lambda a: mx.contiguous(a[i : i + 1, :, : layout.n_tiles]), self.tiles)
        front = [k[:, :, : self.sink], v[:, :, : self.sink]]
        return {"front": front, "tail": tail, "tiles": tiles}

    def drop_row(self, i: int, capacity: int) -> None:
        def without(a: mx.array) -> mx.array:
            return mx.concatenate([a[:i], a[i + 1 :]])

        self.dense = tree_map(without, self.dense)
        if self.tiles is not None:  # no tiles left to any row: none kept
            self.tiles = (
                tree_map(lambda a: without(a)[:, :, :capacity], self.tiles) if capacity else None
            )

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("a KVarN slab decodes one token per row; prefill runs alone")
        plan = self.slab.plan
        pools = zip(self.dense, (keys, values), strict=True)
        self.dense = [scatter_write(plan.at, p, rotate(x).astype(p.dtype)) for p, x in pools]
        if plan.packs:
            self._pack(plan)
        tiles = self.tiles or [None, None]
        return [self.dense[0], tiles[0], None], [self.dense[1], tiles[1], None]

    def kv_segments(self, keys, values) -> list[tuple[object, object, KVFormat]]:
        f = self.fmt
        return [(keys, values, KVFormat(f.key_bits, f.value_bits, f.group_size, tile=f.tile))]

    def attention_mask(self, n_q_heads: int, n_new: int, mask=None) -> mx.array:
        return self.slab.plan.mask

    def update_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Nothing is evicted: no scores kept."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # the step's own mask comes from `attention_mask`

    def size(self) -> int:
        """Slots every row attends: both pools and the padded tiles."""
        tiles = 0 if self.tiles is None else self.tiles[0][0].shape[2]
        return self.dense[0].shape[2] + tiles * self.tile

    @property
    def state(self):
        raise TypeError("a slab layer is not saved: its members' caches are")

    # ------------------------------------------------------------------ internals

    def _pack(self, plan: StepPlan) -> None:
        """Encode the tails this step filled (one call for all of them) into their rows'
        next tiles, growing every row's tiles when the longest takes one more."""
        rows = mx.array([r for r, _ in plan.packs])
        H, D = self.dense[0].shape[1], self.dense[0].shape[3]
        k, v = (mx.take(p[:, :, self.sink :], rows, axis=0) for p in self.dense)
        shape = (len(plan.packs), H, 1, self.tile, D)
        new = encode_tiles(k.reshape(shape), v.reshape(shape), self.fmt, self.sinkhorn_iters)
        if self.tiles is None:  # the first tile any row packs
            self.tiles = tree_map(lambda a: _no_tiles(a, self.rows), new)
        self.tiles = _zero_padded([(self.rows, self.tiles)], self.slab.capacity)[0]
        for j, (r, t) in enumerate(plan.packs):
            for (_, have), (_, fresh) in zip(
                tree_flatten(self.tiles), tree_flatten(new), strict=True
            ):
                have[r : r + 1, :, t : t + 1] = fresh[j : j + 1]


class KVarNPaddedSlab(LendingRows):
    """`kvarn` sessions of one configuration decoding together (see the module doc)."""

    arrays = ("front", "tiles", "tail")

    def __init__(self, key: tuple):
        self.key = key
        self.members: list[Hashable] = []  # row order
        self.caches: list[list[KVarNCache]] = []  # each member's caches, row order
        self.layouts: list[RowLayout] = []  # each row's, after the last step
        self.layers: list[KVarNPaddedLayer] = []
        self.plan: StepPlan | None = None
        self._lent: list[list[KVarNCache]] = []
        self.uncounted = 0  # steps since the members' caches were last given their counts

    @property
    def capacity(self) -> int:
        return max((n.n_tiles for n in self.layouts), default=0)

    def admits(self, caches: list[list[KVarNCache]]) -> list[bool]:
        """Which of these sessions may join, in order: while the slab's tiles (every row
        padded to the longest) stay within twice those its rows hold, plus one a row (the
        padding at most what they hold, as the batcher's KVSlab)."""
        tiles = [n.n_tiles for n in self.layouts]
        out = []
        for c in caches:
            layout = _layout(c)
            have = [*tiles, 0 if layout is None else layout.n_tiles]
            fits = layout is not None and len(have) * max(have) <= 2 * sum(have) + len(have)
            out.append(fits)
            if fits:
                tiles = have
        return out

    def begin_step(self) -> None:
        """A forward pass starts: every row takes one token. Its write slots, the tails it
        fills and the mask of what each row then holds, for every layer."""
        layer = self.layers[0]
        sink, tile = layer.sink, layer.tile
        before = self.layouts
        after = [n.after_token(sink, tile) for n in before]
        packs = [(r, n.n_tiles) for r, n in enumerate(before) if after[r].n_tiles > n.n_tiles]
        self.layouts = after
        self.plan = StepPlan(
            at=mx.array([n.next_slot(sink) for n in before], dtype=mx.int32)[:, None, None],
            packs=packs,
            mask=_held_mask(after, sink, tile, self.capacity),
            offset=mx.array([n.offset for n in before], dtype=mx.int32),
        )
        self.uncounted += 1

    def join(self, sessions: list[tuple[Hashable, list[KVarNCache]]]) -> None:
        """Move sessions' rows into the slab as its last rows (one copy of the slab); each
        must hold one layout in every layer (`admits`)."""
        self.reclaim()
        self.count_tokens()
        layouts = [_layout(caches) for _, caches in sessions]
        if None in layouts:
            raise ValueError("a session's KVarN layers hold different layouts: it decodes alone")
        capacity = max([self.capacity, *(n.n_tiles for n in layouts)])
        per_layer = [list(layer) for layer in zip(*(c for _, c in sessions), strict=True)]
        if not self.layers:
            self.layers = [KVarNPaddedLayer(self, caches[0]) for caches in per_layer]
        for layer, caches in zip(self.layers, per_layer, strict=True):
            layer.add_rows(caches, layouts, capacity)
        for (member, caches), layout in zip(sessions, layouts, strict=True):
            self.members.append(member)
            self.caches.append(caches)
            self.layouts.append(layout)
            drop_arrays(caches, self.arrays)

    def leave(self, member: Hashable, caches: list[KVarNCache] | None) -> None:
        """Take a member's row out; write it back into its caches (None: drop it)."""
        self.reclaim()
        self.count_tokens()
        i = self.members.index(member)
        layout = self.layouts[i]
        del self.members[i], self.caches[i], self.layouts[i]
        written = []
        for n, layer in enumerate(self.layers):
            if caches is not None:
                row = layer.row(i, layout)
                caches[n].__dict__.update(row)
                written += [
                    a for _, a in tree_flatten(list(row.values())) if isinstance(a, mx.array)
                ]
            layer.drop_row(i, self.capacity)
        if not self.members:
            self.layers, self.plan = [], None
        mx.async_eval(written)  # copied now: a lazy copy would keep the old slab alive

    def _row(self, layer: int, i: int) -> dict[str, object]:
        return self.layers[layer].row(i, self.layouts[i])

    def count_tokens(self) -> None:
        """Hand every member's caches their row's counts."""
        if not self.uncounted:
            return
        for caches, n in zip(self.caches, self.layouts, strict=True):
            for c in caches:
                c.n_front, c.n_tail, c.offset = n.n_front, n.n_tail, n.offset
        self.uncounted = 0


def _layout(caches: list[KVarNCache]) -> RowLayout | None:
    """A session's layout, which every layer shares (one token in each, no eviction);
    None where they differ (not met: such a session decodes alone)."""
    layouts = {(c.n_front, c.n_tiles(), c.n_tail, c.offset) for c in caches}
    return RowLayout(*layouts.pop()) if len(layouts) == 1 else None


def _dense_pools(c: KVarNCache) -> list[mx.array]:
    """[keys, values] [1, H, sink + tile, D]: the front pool, then the tail pool (zeros
    where a lone cache has none yet)."""
    tail = c.tail or [mx.zeros((*p.shape[:2], c.tile, p.shape[3]), p.dtype) for p in c.front]
    return [mx.concatenate([f, t], axis=2) for f, t in zip(c.front, tail, strict=True)]


def _zero_padded(trees: list[tuple[int, list | None]], capacity: int) -> list:
    """(rows, tile tree [rows, H, n, ...] or None) each padded with zero tiles to
    `capacity` (None: all zeros, shaped like the others')."""
    like = next(t for _, t in trees if t is not None)

    def padded(a: mx.array, rows: int | None = None) -> mx.array:
        if rows is not None:  # a row with no tiles yet
            return mx.zeros((rows, a.shape[1], capacity, *a.shape[3:]), a.dtype)
        extra = [(0, 0), (0, 0), (0, capacity - a.shape[2])] + [(0, 0)] * (a.ndim - 3)
        return a if capacity == a.shape[2] else mx.pad(a, extra)

    return [
        tree_map(padded, t) if t is not None else tree_map(lambda a, r=rows: padded(a, r), like)
        for rows, t in trees
    ]


def _held_mask(layouts: list[RowLayout], sink: int, tile: int, capacity: int) -> mx.array:
    """bool [rows, 1, 1, sink + tile + capacity * tile]: each row's front and tail slots
    in use, then its tiles."""
    n = [[x.n_front, x.n_tail, x.n_tiles * tile] for x in layouts]
    front, tail, tiles = mx.array(n, dtype=mx.int32)[:, :, None].split(3, axis=1)
    dense = mx.arange(sink + tile, dtype=mx.int32)
    in_dense = (dense < front) | ((dense >= sink) & (dense < sink + tail))
    in_tiles = mx.arange(capacity * tile, dtype=mx.int32) < tiles
    return mx.concatenate([in_dense, in_tiles], axis=-1)[:, None]


def _no_tiles(like: mx.array, rows: int) -> mx.array:
    """A tile array of `rows` rows holding no tile, shaped like `like` otherwise."""
    return mx.zeros((rows, like.shape[1], 0, *like.shape[3:]), like.dtype)
