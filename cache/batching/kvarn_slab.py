"""KVarNSlab: h2o-kvarn sessions holding equally many tokens, decoding as one cache.

A KVarN row's layout (cache/policies/kvarn.py: dense front pool, packed tiles, dense tail) follows
from how many tokens it holds, and an h2o-kvarn decode step changes that number alike for
every row: one token in, the tail packed into a tile when it fills, and past max_kv an
eviction down to `keep` (the "requantize" rule keeps exactly that many per head). Rows
holding equally many tokens therefore share their layout at every later step, and decode
as one H2OKVarNCache of R rows per layer (`KVarNSlabLayer`): one store, one compiled
attend-and-score call, one tile packing and one compiled eviction per layer and step for
all of them, where sessions side by side take one each (16 rows: 1.39x stock's ops per
step where 16 parts took 9.3x, docs/gpu_step.md). Each row keeps its own positions,
scores and tokens seen (its RoPE offset, its recent window) and computes what it would
alone.

Rows holding different counts cannot share one (their tails pack and their evictions fall
on different steps), so the slab key holds the count (`H2OKVarNCache.slab_key`) and the
batcher keeps a slab per count it meets: sessions started together, or that reached their
budget together, share one (a prompt past max_kv leaves `keep`, whatever its length);
sessions out of step decode alone (not measured yet: docs/gpu.md).

While in the slab a member's caches hold no arrays; `lend` (before any reader between
steps) and `leave` bring their counters (tokens seen, evicted) up to date and hand them
the row's arrays and layout (`n_front`, `n_tail`).
"""

from __future__ import annotations

from collections.abc import Hashable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from cache.batching.h2o_slab import SlabRows
from cache.policies.h2o_kvarn import H2OKVarNCache

ARRAYS = ("front", "tiles", "tail", "scores", "positions")  # a row's, batch axis first


class KVarNSlabLayer(H2OKVarNCache):
    """One layer of a KVarNSlab: an H2OKVarNCache whose batch rows are the members', each
    with its own tokens seen, set by the slab every step: `offset` (int32 [rows], RoPE's)
    and `seen_rows` (int32 [rows, 1, 1]: the step's token's position, then counted)."""

    @classmethod
    def stacked(cls, caches: list[H2OKVarNCache]) -> KVarNSlabLayer:
        layer = cls.__new__(cls)
        layer.__dict__.update(vars(caches[0]))  # its configuration and the rows' layout
        for name in ARRAYS:
            setattr(layer, name, None)
        layer.steps = layer.evicted = 0  # since made: the slab hands them on to the rows
        layer.add_rows(caches)
        return layer

    @property
    def rows(self) -> int:
        return self.scores.shape[0]

    def add_rows(self, caches: list[H2OKVarNCache]) -> None:
        """Append these caches' arrays as the last rows (they hold this layer's layout)."""
        for name in ARRAYS:
            rows = [getattr(c, name) for c in caches]
            have = getattr(self, name)
            stacked = rows if have is None else [have, *rows]
            if stacked[0] is not None:  # a pool or tiles none of them has yet stay None
                setattr(self, name, tree_map(lambda *a: mx.concatenate(a), *stacked))

    def row(self, i: int) -> dict[str, object]:
        """Row i's arrays as a lone cache holds them (copies), and its layout."""
        out = {n: _each(lambda a: mx.contiguous(a[i : i + 1]), getattr(self, n)) for n in ARRAYS}
        return out | {"n_front": self.n_front, "n_tail": self.n_tail}

    def drop_row(self, i: int) -> None:
        for name in ARRAYS:
            rest = _each(lambda a: mx.concatenate([a[:i], a[i + 1 :]]), getattr(self, name))
            setattr(self, name, rest)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("a KVarN slab decodes one token per row; prefill runs alone")
        seen = self.offset
        fetched = super().update_and_fetch(keys, values)
        self.offset, self.steps = seen, self.steps + 1  # the slab counts each row's tokens
        return fetched

    def _next_positions(self, n: int) -> mx.array:
        return self.seen_rows[0]  # one token per row (update_and_fetch)

    def _seen_now(self) -> mx.array:
        return self.seen_rows[1]


class LendingRows(SlabRows):
    """What a KVarN slab does as any other between steps: lend a member copies of its
    rows (`_row`), take them back before the next step; nothing waits to be packed."""

    arrays: tuple[str, ...] = ARRAYS  # what a member's caches hold only while lent
    _lent: list[list]

    def _row(self, layer: int, i: int) -> dict[str, object]:
        """Row i of a layer as a lone cache holds it (copies), and its layout."""
        raise NotImplementedError

    def lend(self, member: Hashable, caches: list) -> None:
        """Give a member's caches copies of its rows, for a reader between steps."""
        self.count_tokens()
        i = self.members.index(member)
        for n, c in enumerate(caches):
            c.__dict__.update(self._row(n, i))
        self._lent.append(caches)

    def pack_pending(self) -> None:
        """Nothing waits to be packed: a tail packs in the step that fills it."""

    def reclaim(self) -> None:
        """Drop lent copies: the slab holds the rows."""
        for caches in self._lent:
            drop_arrays(caches, self.arrays)
        self._lent = []


class KVarNSlab(LendingRows):
    """h2o-kvarn sessions of one configuration and size decoding together (module doc)."""

    def __init__(self, key: tuple):
        self._key = key
        self.members: list[Hashable] = []  # row order
        self.caches: list[list[H2OKVarNCache]] = []  # each member's caches, row order
        self.layers: list[KVarNSlabLayer] = []
        self._lent: list[list[H2OKVarNCache]] = []
        self._synced: list[tuple[int, int]] = []  # per layer: (steps, evicted) handed on

    @property
    def key(self) -> tuple:
        """What a session must match to join: the rows' size moves from step to step."""
        return tuple(layer.slab_key() for layer in self.layers) if self.layers else self._key

    def begin_step(self) -> None:
        """A forward pass starts: every layer takes the rows' tokens seen (arrays built
        once for all layers, from host numbers: no op per layer)."""
        seen = [caches[0].offset + self.uncounted for caches in self.caches]
        offset = mx.array(seen, dtype=mx.int32)
        rows = [mx.array([[[n + d]] for n in seen], dtype=mx.int32) for d in (0, 1)]
        for layer in self.layers:
            layer.offset, layer.seen_rows = offset, rows

    def join(self, sessions: list[tuple[Hashable, list[H2OKVarNCache]]]) -> None:
        """Move sessions' rows into the slab as its last rows; they must hold its layout."""
        self.reclaim()
        self.count_tokens()
        key = self.key
        for _, caches in sessions:
            if tuple(c.slab_key() for c in caches) != key:
                raise ValueError("a KVarN slab's rows hold equally many tokens, alike packed")
        per_layer = [list(layer) for layer in zip(*(c for _, c in sessions), strict=True)]
        if not self.layers:
            self.layers = [KVarNSlabLayer.stacked(caches) for caches in per_layer]
            self._synced = [(0, 0)] * len(self.layers)
        else:
            for layer, caches in zip(self.layers, per_layer, strict=True):
                layer.add_rows(caches)
        for member, caches in sessions:
            self.members.append(member)
            self.caches.append(caches)
            drop_arrays(caches, ARRAYS)

    def leave(self, member: Hashable, caches: list[H2OKVarNCache] | None) -> None:
        """Take a member's row out; write it back into its caches (None: drop it)."""
        self.reclaim()
        self.count_tokens()
        i = self.members.index(member)
        del self.members[i], self.caches[i]
        written = []
        for n, layer in enumerate(self.layers):
            if caches is not None:
                row = layer.row(i)
                caches[n].__dict__.update(row)
                arrays = tree_flatten([row[name] for name in ARRAYS])
                written += [a for _, a in arrays if isinstance(a, mx.array)]
            if self.members:
                layer.drop_row(i)
        if not self.members:
            self.layers, self._synced = [], []
        mx.async_eval(written)  # copied now: a lazy copy would keep the old slab alive

    def _row(self, layer: int, i: int) -> dict[str, object]:
        return self.layers[layer].row(i)

    @property
    def uncounted(self) -> int:
        """Tokens every row took that its caches do not count yet (`count_tokens`)."""
        return self.layers[0].steps - self._synced[0][0] if self.layers else 0

    def count_tokens(self) -> None:
        """Hand every layer's tokens and evictions since the last sync to each member."""
        for n, layer in enumerate(self.layers):
            steps, evicted = self._synced[n]
            for caches in self.caches:
                caches[n].offset += layer.steps - steps
                caches[n].evicted += layer.evicted - evicted
            self._synced[n] = (layer.steps, layer.evicted)


def _each(fn, tree):
    """tree_map, but a pool or tiles not there yet (None) stay None."""
    return None if tree is None else tree_map(fn, tree)


def drop_arrays(caches: list, names: tuple[str, ...]) -> None:
    """A slab member's caches hold none of these while the slab holds its row."""
    for c in caches:
        for name in names:
            setattr(c, name, None)
