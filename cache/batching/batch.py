"""Several sessions' caches of one layer, seen by an mlx-lm model as one batch.

The worker advances every decoding session in one forward pass per round, so
the weights (most of a decode step's memory traffic) are read once for all of
them. A BatchedCache is made of parts, in row order: a part is one session's
cache (any policy, its own length, eviction state and RoPE offset) or a
`KVSlab` layer, mlx-lm's left-padded BatchKVCache holding several plain
sessions at once. `update_and_fetch` hands each part its rows' new keys and
values; the router (cache/router.py) then attends part by part: a session's
cache against its own keys, a slab's rows in one attention call under its
padding mask. A batched step computes what each row would alone. A decode step
brings one token per row; a prefill pass brings a chunk per row, causal within
each row. Rows of unequal chunks are right-padded by the caller
(server/engine/batcher.py), with each row's real length given: a part then stores and
attends only its row's real tokens, and the padded positions' attention output
is zero, so any cache (scoring, evicting) takes exactly the chunk it would alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

from cache.batching.h2o_slab import H2OSlab, H2OSlabLayer, SlabRows
from cache.batching.kvarn_padded import KVarNPaddedLayer, KVarNPaddedSlab
from cache.batching.kvarn_slab import KVarNSlab, KVarNSlabLayer
from cache.contract import is_state
from cache.policies.full import plain
from cache.policies.h2o_kvarn import H2OKVarNCache
from cache.policies.kvarn import KVarNCache
from cache.policies.rotating import SinkRotatingKVCache

# The slab for a key, by the class of cache that made it (a key's first field, per layer);
# any other: an H2OSlab.
SLAB_OF = {KVarNCache.__name__: KVarNPaddedSlab, H2OKVarNCache.__name__: KVarNSlab}


def _rows(part) -> int:
    """Batch rows a part carries: a slab's (KVSlab, cache/batching/h2o_slab.py,
    cache/batching/kvarn_slab.py, cache/batching/kvarn_padded.py) or one session's."""
    if isinstance(part, BatchKVCache | BatchRotatingKVCache):
        return part.offset.shape[0]
    slab_layers = H2OSlabLayer | KVarNSlabLayer | KVarNPaddedLayer
    return part.rows if isinstance(part, slab_layers) else 1


def open_h2o_slab(key: tuple) -> H2OSlab | KVarNSlab | KVarNPaddedSlab:
    """An empty slab for sessions of this slab key (cache/h2o_slab.slab_key)."""
    return SLAB_OF.get(key[0][0], H2OSlab)(key)


@dataclass
class PartMasks:
    """One mask per part of a BatchedCache (a sliding-window layer's: `_window_masks`)."""

    parts: list


class BatchedCache:
    def __init__(self, parts: list, masks: dict | None = None, lengths: list | None = None):
        self.parts = parts
        # Each row's real tokens in a right-padded pass (a prefill's chunks; a verify
        # pass's drafts, a slab's rows feeding 1 each); None: every row's input is real.
        self.lengths = lengths
        # Padding masks by (rows, new tokens, keys): every layer of a forward pass has the
        # same, so batch_caches shares one dict and each is built once, not once per layer.
        self.masks = {} if masks is None else masks
        self.whole = len(parts) == 1  # one part is the batch: no slicing, no concatenation
        # (part, first row, end row): fixed for the forward pass this object serves
        self.spans: list[tuple[object, int, int]] = []
        start = 0
        for part in parts:
            self.spans.append((part, start, start + _rows(part)))
            start += _rows(part)

    @property
    def offset(self) -> mx.array:
        """Per-row positions: RoPE takes an array of offsets, one per batch row."""
        offsets = [p.offset for p in self.parts]  # a slab's: an array, one per row
        if self.whole and isinstance(offsets[0], mx.array):
            return offsets[0]
        return mx.concatenate([o if isinstance(o, mx.array) else mx.array([o]) for o in offsets])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[list, list]:
        if self.whole and self.lengths is None:
            k, v = self.parts[0].update_and_fetch(keys, values)
            return [k], [v]
        fetched = [
            p.update_and_fetch(keys[a:b, :, : self._real(a)], values[a:b, :, : self._real(a)])
            for p, a, b in self.spans
        ]
        return [k for k, _ in fetched], [v for _, v in fetched]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if return_array:
            raise ValueError("batched sessions attend part by part: no shared mask array")
        if window_size is not None:
            return self._window_masks(N, window_size)
        # One new token sees every key its row holds; a chunk is causal within its row.
        return None if N == 1 else "causal"

    def _window_masks(self, N: int, window: int) -> PartMasks:
        """A sliding-window layer's masks: each session's cache builds its own (which of
        its keys the window still shows depends on what it holds), now, before the pass
        stores anything, as mlx-lm's models ask for it; `attend` hands each part its own."""
        return PartMasks(
            [p.make_mask(self._real(a) or N, window_size=window) for p, a, _ in self.spans]
        )

    def attend(self, queries: mx.array, keys: list, values: list, mask, attend_part: Callable):
        """attend_part(q, k, v, part, mask) per part, stacked back into the batch."""
        part = self.parts[0]
        if self.whole and self.lengths is None and not isinstance(part, BatchKVCache):
            own = mask.parts[0] if isinstance(mask, PartMasks) else mask
            return attend_part(queries, keys[0], values[0], part, own)  # its rows are the batch
        out = []
        for i, ((part, a, b), k, v) in enumerate(zip(self.spans, keys, values, strict=True)):
            part_mask = mask.parts[i] if isinstance(mask, PartMasks) else mask
            n = self._real(a) or queries.shape[2]
            if isinstance(part, BatchKVCache):  # its rows' left padding is never attended
                part_mask = self._padding_mask(part, a, b, n, k.shape[2])
            elif n == 1 and isinstance(part_mask, str):  # one token sees every key it holds
                part_mask = None
            q = (queries if self.whole else queries[a:b])[:, :, :n]
            o = attend_part(q, k, v, part, part_mask)
            if o.shape[2] < queries.shape[2]:  # a padded position's output stays 0
                o = mx.pad(o, [(0, 0), (0, 0), (0, queries.shape[2] - o.shape[2]), (0, 0)])
            out.append(o)
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    def _real(self, row: int) -> int | None:
        """Real tokens in `row`'s input (None: all of it)."""
        return None if self.lengths is None else self.lengths[row]

    def _padding_mask(self, part: BatchKVCache, a: int, b: int, n: int, n_keys: int) -> mx.array:
        # A slab's left padding is alike in every layer (KVSlab), so is its mask.
        key = (a, b, n, n_keys)
        if key not in self.masks:
            self.masks[key] = create_causal_mask(
                n, offset=n_keys - n, left_padding=part.left_padding
            )
        return self.masks[key]


def batch_caches(sessions: list[list], *slabs, lengths: list | None = None) -> list[BatchedCache]:
    """Per-layer BatchedCaches: the slabs' rows first, in order (KVSlab, H2OSlab; empty
    ones skipped), then each session's caches. `lengths`: a right-padded pass's real
    tokens per row, in that order (a slab's rows feed one token each)."""
    slabs = [s for s in slabs if s.members]
    for s in slabs:
        s.begin_step()
    layers = [list(layer) for layer in zip(*sessions, strict=True)]
    if not layers:  # every decoding session is in a slab
        layers = [[] for _ in slabs[0].layers]
    masks: dict = {}  # one forward pass: its layers share padding masks
    return [
        BatchedState(parts, lengths)
        if parts and all(is_state(p) for p in parts)  # never in a slab (slab_key: None)
        else BatchedCache([*(s.layers[n] for s in slabs), *parts], masks, lengths)
        for n, parts in enumerate(layers)
    ]


class BatchedState(ArraysCache):
    """One recurrent state layer (mlx-lm's ArraysCache: linear attention, SSM) of several
    sessions as one batch: their rows merged for the pass (ArraysCache.merge; a fresh
    session's state is zeros, as the layer starts it), and each row written back into its
    session's own cache as the model stores it. `lengths`: a right-padded prefill's real
    tokens per row, which mlx-lm's state layers mask by (ArraysCache.make_mask)."""

    def __init__(self, parts: list, lengths: list | None = None):
        super().__init__(len(parts[0].cache))
        self.cache = ArraysCache.merge(parts).cache
        self.parts = parts
        self.lengths = None if lengths is None else mx.array(lengths)

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.cache[idx] = value
        for row, part in enumerate(self.parts):
            part[idx] = value[row : row + 1]


class KVSlab(SlabRows):
    """Plain (mlx-lm KVCache) sessions decoding together, each layer's K/V in one buffer.

    Row by row, every decode step costs each session a cache update and an
    attention call per layer; in the slab, the members share one of each per
    layer (mlx-lm's BatchKVCache: rows left-padded to the longest; a sliding-window
    layer without sinks, Gemma 3's, mlx-lm's BatchRotatingKVCache). While a
    session is a member its own cache objects hold no arrays (a second copy
    would double its memory, and a live view would stop the slab updating in
    place): `leave` writes its rows back, `lend` hands out read-only views (a
    sliding window's: a copy in temporal order) until the next step.
    """

    def __init__(self):
        self.members: list[Hashable] = []  # row order
        self.layers: list[BatchKVCache | BatchRotatingKVCache] = []
        self._lent: list[list[KVCache]] = []

    def begin_step(self) -> None:
        """A forward pass starts (nothing is built per step here; an H2OSlab's is)."""

    def join(self, sessions: list[tuple[Hashable, list[KVCache]]]) -> None:
        """Move sessions' K/V into the slab as its last rows (one copy of the slab)."""
        self.reclaim()
        per_layer = zip(*(caches for _, caches in sessions), strict=True)
        merged = [_batch_class(layer[0]).merge(list(layer)) for layer in per_layer]
        if not self.members:
            self.layers = merged
        else:
            for layer, rows in zip(self.layers, merged, strict=True):
                layer.extend(rows)
        for key, caches in sessions:
            self.members.append(key)
            for c in caches:
                c.keys = c.values = None  # the offset stays: it still says what it holds

    def leave(self, key: Hashable, caches: list[KVCache] | None) -> None:
        """Take a member's row out; write it back into `caches` (None: discard it)."""
        self.reclaim()
        i = self.members.index(key)
        del self.members[i]
        plain_layers = [layer for layer in self.layers if plain_layer(layer)]
        pads = plain_layers[0].left_padding.tolist() if plain_layers else []  # alike in each
        pad = pads.pop(i) if pads else 0
        shift = min(pads, default=0)  # padding every remaining row has: dropped
        others = [j for j in range(len(self.members) + 1) if j != i]

        def without_row(a: mx.array) -> mx.array:  # two copies, not a slow gather
            return mx.concatenate([a[:i], a[i + 1 :]])

        written = []
        for n, layer in enumerate(self.layers):
            if not plain_layer(layer):
                if caches is not None:
                    _write_window(caches[n], layer.extract(i))
                    written += [caches[n].keys, caches[n].values]
                if self.members:
                    layer.filter(mx.array(others))
                continue
            keys, values, offset, left_padding, idx = layer.state
            if caches is not None:
                c = caches[n]
                c.keys = mx.contiguous(keys[i : i + 1, :, pad:idx])
                c.values = mx.contiguous(values[i : i + 1, :, pad:idx])
                c.offset = idx - pad
                written += [c.keys, c.values]
            if self.members:
                layer.state = (  # the held positions only: spare room is not copied
                    without_row(keys[:, :, shift:idx]),
                    without_row(values[:, :, shift:idx]),
                    without_row(offset),
                    without_row(left_padding) - shift,
                    idx - shift,
                )
        if not self.members:
            self.layers = []
        # Copied now: a lazy copy would keep the whole old slab alive until first used.
        mx.async_eval(written)

    def lend(self, key: Hashable, caches: list[KVCache]) -> None:
        """Give a member's cache objects views of its rows, for a reader between steps."""
        i = self.members.index(key)
        pad = next(
            (layer.left_padding[i].item() for layer in self.layers if plain_layer(layer)), 0
        )  # alike in every BatchKVCache layer
        for c, layer in zip(caches, self.layers, strict=True):
            if not plain_layer(layer):
                _write_window(c, layer.extract(i))
                continue
            c.keys = layer.keys[i : i + 1, :, pad : layer.size()]
            c.values = layer.values[i : i + 1, :, pad : layer.size()]
            c.offset = layer.size() - pad
        self._lent.append(caches)

    def reclaim(self) -> None:
        """Drop lent views, so the slab's buffers are its own again (updated in place)."""
        for caches in self._lent:
            for c in caches:
                c.keys = c.values = None
        self._lent = []


def kv_slab_layer(cache) -> bool:
    """Whether a KVSlab can hold this layer: mlx-lm's plain KVCache, or a sliding window
    that keeps no sinks (what mlx-lm's BatchRotatingKVCache batches)."""
    if plain(cache):
        return True
    return type(cache) in (RotatingKVCache, SinkRotatingKVCache) and cache.keep == 0


def plain_layer(layer) -> bool:
    """Whether a KVSlab layer is a BatchKVCache (else a sliding window's
    BatchRotatingKVCache)."""
    return isinstance(layer, BatchKVCache)


def _batch_class(cache) -> type:
    return BatchKVCache if plain(cache) else BatchRotatingKVCache


def _write_window(cache: RotatingKVCache, row: RotatingKVCache) -> None:
    """A sliding-window row (BatchRotatingKVCache.extract: its window in temporal order)
    back into the session's own cache."""
    cache.keys, cache.values, cache.offset, cache._idx = row.keys, row.values, row.offset, row._idx
