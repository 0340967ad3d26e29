"""MixedH2OKVCache: h2o-mixed's segmented layouts (`paper` and `dense-recent`).

The paper keeps the heavy segment 8-bit and the recent window 4-bit; a token
then is quantized twice, 4-bit on arrival and 8-bit (from its 4-bit value) when
it leaves the window. MixedH2OKVCache stores the two segments apart: `old`
(sinks and heavy hitters, per-head slots, `heavy_bits`) and `recent` (the
newest `recent` tokens, the same in every head, `recent_bits`, None =
unquantized). A token moves from recent to old when the window passes it. Slots
stay in position order (eviction gathers sorted indices), so scores over
[old | recent] line up with H2OKVCache's per-slot bookkeeping; attention runs
over each segment and merges them by log-sum-exp (cache/attention.py). Why the
default h2o-mixed layout is k8v4 instead: cache/policies/quantized.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_map

from cache.attention import DENSE, KVFormat, seq_length
from cache.policies.h2o import H2OKVCache, gather_slots
from cache.policies.quantized import QuantizedH2OKVCache, quantize
from config.cache_spec import DEFAULT_GROUP_SIZE, MIXED_SCHEMES, CacheSpec


class MixedH2OKVCache(H2OKVCache):
    """Sinks and heavy hitters at `heavy_bits`, the recent window at `recent_bits` (None: dense).

    `keys`/`values` are [old, recent]: old is mx.quantize's [words, scales, biases]
    with spare slots (None before the first token leaves the window), recent holds
    exactly the window's tokens (an array, or a packed list when quantized).
    """

    def ranking_kv(self, n: int) -> None:
        """Two segments at two widths: a rule reading K/V ranks without them here."""
        return None

    def __init__(
        self,
        max_size: int,
        *,
        group_size: int = DEFAULT_GROUP_SIZE,
        heavy_bits: int = 8,
        recent_bits: int | None = None,
        **h2o,
    ):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, evict_batch)."""
        super().__init__(max_size, **h2o)
        self.group_size, self.heavy_bits, self.recent_bits = group_size, heavy_bits, recent_bits

    # ------------------------------------------------------------ building, pricing

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None) -> H2OKVCache:
        """The layout `spec.mixed` names: k8v4 is a QuantizedH2OKVCache with split widths."""
        layout, _ = MIXED_LAYOUTS[spec.mixed]
        return super().from_spec(spec, window) if layout is cls else layout.from_spec(spec, window)

    @classmethod
    def spec_knobs(cls, spec: CacheSpec) -> dict:
        return {"group_size": spec.group_size, **MIXED_LAYOUTS[spec.mixed][1]}

    @classmethod
    def layer_bytes(cls, shape, spec: CacheSpec, window: int | None = None) -> float:
        """Priced as k8v4 (the policy's widths) in every layout."""
        return QuantizedH2OKVCache.layer_bytes(shape, spec, window)

    @classmethod
    def check_head_dim(cls, spec: CacheSpec, head_dim: int) -> None:
        QuantizedH2OKVCache.check_head_dim(spec, head_dim)

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append to the recent window; tokens pushed out of it move to the old segment."""
        n_new = keys.shape[2]
        end = self.used + n_new
        if self.positions is None or end > self.positions.shape[-1]:
            self._grow(keys, values, end)  # scores/positions; the segments size themselves
        if self.keys is None:
            self.keys, self.values = [None, None], [None, None]
        n_old = self._n_old()
        for buf, new in ((self.keys, keys), (self.values, values)):
            new = self._encode_recent(new)
            window = new if buf[1] is None else tree_map(_concat, buf[1], new)
            spill = max(0, seq_length(window) - self.recent)
            if spill:
                self._append_old(buf, n_old, _slots(window, 0, spill))
            buf[1] = _slots(window, spill, None) if spill < seq_length(window) else None
        self.used = end
        self.offset += n_new
        return self._fetch()

    def kv_segments(self, keys, values) -> list[tuple[object, object, KVFormat]]:
        """[old | recent] as attention parts, in slot order, empty segments left out."""
        (old_k, rec_k), (old_v, rec_v) = keys, values
        gs = self.group_size
        old_format = KVFormat(self.heavy_bits, self.heavy_bits, gs)
        rec_format = DENSE if self.recent_bits is None else KVFormat(self.recent_bits, None, gs)
        parts = [(old_k, old_v, old_format), (rec_k, rec_v, rec_format)]
        return [part for part in parts if seq_length(part[0])]

    def trim(self, n: int) -> int:
        """Drop the n newest tokens, never past an evicted one; return how many."""
        n = max(0, min(n, self.trimmable_tokens()))
        if n == 0:
            return 0
        # Slots are in position order in every head: the newest n are the last n.
        keep = self.used - n
        n_old = self._n_old()
        rec_keep = keep - min(n_old, keep)
        for buf in (self.keys, self.values):
            buf[1] = _slots(buf[1], 0, rec_keep) if rec_keep else None
        self.used = keep
        self.offset -= n
        self.reset_free_slots()
        return n

    def _kv_loaded(self) -> None:
        if self.keys is not None:  # loaded nested lists: mutable [old, recent] pairs
            self.keys, self.values = list(self.keys), list(self.values)

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(
            group_size=self.group_size, heavy_bits=self.heavy_bits, recent_bits=self.recent_bits
        )
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        H2OKVCache.meta_state.fset(self, v)
        meta = json.loads(v[0])
        self.group_size = meta["group_size"]
        self.heavy_bits, self.recent_bits = meta["heavy_bits"], meta["recent_bits"]

    # ------------------------------------------------------------------ storage hooks

    def _n_old(self) -> int:
        return self.used - seq_length(self.keys[1])

    def _encode_recent(self, x: mx.array):
        if self.recent_bits is None:
            return x
        return quantize(x, self.group_size, self.recent_bits)

    def _to_old(self, window_part) -> list[mx.array]:
        """Tokens leaving the window, at heavy_bits (from the dense value when there is one)."""
        if self.recent_bits is not None:
            window_part = mx.dequantize(
                *window_part, group_size=self.group_size, bits=self.recent_bits
            )
        return quantize(window_part, self.group_size, self.heavy_bits)

    def _append_old(self, buf: list, n_old: int, window_part) -> None:
        """Write tokens leaving the window into old slots [n_old, ...), growing them if full."""
        packed = self._to_old(window_part)
        needed = n_old + seq_length(window_part)
        if buf[0] is None or needed > buf[0][0].shape[2]:
            # Decode settles at max_size + 1 - recent old slots; bigger only inside a chunk.
            capacity = max(needed, self.positions.shape[-1] - self.recent)
            grown = []
            for new, old in zip(packed, buf[0] or [None] * len(packed), strict=True):
                fresh = mx.zeros((*new.shape[:2], capacity, *new.shape[3:]), dtype=new.dtype)
                if old is not None and n_old:
                    fresh[:, :, :n_old] = old[:, :, :n_old]
                grown.append(fresh)
            buf[0] = grown
        for old, new in zip(buf[0], packed, strict=True):
            old[:, :, n_old:needed] = new

    def _grow_kv(self, keys, values, capacity: int) -> None:
        """Segments size themselves in update_and_fetch."""

    def _fetch(self):
        n_old = self._n_old()
        return tuple(
            [_slots(buf[0], 0, n_old) if n_old else None, buf[1]]
            for buf in (self.keys, self.values)
        )

    def _kv_state(self) -> tuple:
        return self._fetch()

    def _gather(self, idx: mx.array, capacity: int) -> None:
        # Sorted slots keep slot order == position order, which the segments rely on.
        super()._gather(mx.sort(idx, axis=-1), capacity)

    def _gather_kv(self, idx: mx.array, capacity: int) -> None:
        """Eviction keeps the whole recent window: the kept old slots come first in `idx`."""
        n_old, n_rec = self._n_old(), seq_length(self.keys[1])
        keep_old = idx.shape[-1] - n_rec
        old_idx = idx[..., :keep_old, None]
        old_capacity = max(keep_old, capacity - self.recent)
        for buf in (self.keys, self.values):
            if buf[0] is not None:
                buf[0] = [gather_slots(a[:, :, :n_old], old_idx, old_capacity) for a in buf[0]]


def _slots(x, start: int, stop: int | None):
    """Slots [start, stop) of an array or packed list, along the sequence axis."""
    return tree_map(lambda a: a[:, :, start:stop], x)


def _concat(a: mx.array, b: mx.array) -> mx.array:
    return mx.concatenate([a, b], axis=2)


# config/cache_spec.MIXED_SCHEMES -> (cache class, its width arguments). k8v4, the default,
# is the plain quantized cache with split widths; cache/policies/quantized.py says why it wins.
MIXED_LAYOUTS = {
    "k8v4": (QuantizedH2OKVCache, {"bits": 8, "value_bits": 4}),
    "paper": (MixedH2OKVCache, {"heavy_bits": 8, "recent_bits": 4}),
    "dense-recent": (MixedH2OKVCache, {"heavy_bits": 8, "recent_bits": None}),
}
assert set(MIXED_LAYOUTS) == set(MIXED_SCHEMES), "config/cache_spec.MIXED_SCHEMES disagrees"
