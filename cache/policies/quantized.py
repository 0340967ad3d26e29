"""Quantized H2O caches: h2o-q8, h2o-q4 and h2o-mixed's default layout (k8v4).

Packed storage. Keys and values go through `mx.quantize` along the head dim on
arrival (affine, `group_size` 64 by default): per KV head and slot a cache holds
packed uint32 words [.., D * bits / 32], one scale and one bias per group. Every
buffer keeps the sequence on axis 2, so H2OKVCache's scoring and eviction run
unchanged: eviction gathers the packed words, scales and biases along that axis
(`take_along_axis`), never dequantizing or requantizing.

The cache reports its widths as a `KVFormat`; cache/attention.py reads packed K/V
through the fused kernels (or dequantizes them, when that path is chosen).

`h2o-mixed` is "k8v4": keys 8-bit, values 4-bit, in every segment (a
QuantizedH2OKVCache with `value_bits`). Default model, 64-token essay prompt,
200 teacher-forced decode steps, max_kv 128 (136 tokens evicted per head); mean
KL(dense h2o || policy) per step, bytes per cached token vs dense h2o:

    h2o-q8                           KL 0.00078   0.29x
    h2o-q4                           KL 0.133     0.17x
    paper (heavy 8-bit, recent 4)    KL 0.131     0.23x
    k8v4 (keys 8-bit, values 4)      KL 0.009     0.23x
    dense-recent (heavy 8, recent -) KL 0.00006   0.63x

The recent window carries most of the attention, so the paper's 4-bit window
costs as much as q4 everywhere. What 4-bit breaks is the keys: one scale per
64-wide group spans the whole head dim, and outlier key channels set its step
(keys 4-bit with values 8-bit: KL 0.17). k8v4 spends the paper's memory on the
keys instead and is 15x closer to dense. Dense-recent (each token quantized
once, on leaving the window) is closer still but costs 2.7x the memory, more
than q8, whose perplexity is already that of dense h2o. All three schemes stay
selectable (config/cache_spec.MIXED_SCHEMES, cache/policies/mixed.py for the two
segmented ones).

Three changes narrow what a key's groups must span. `rotate=True` (Hadamard)
spreads outlier channels over the head dim. Keys are stored centred: minus one
mean per KV head, taken over the first tokens stored; softmax over q.(k - c)
equals softmax over q.k for any constant c, so attention and the probabilities
scores are built from do not change (the logits move by a constant per query).
And the sink tokens stay dense in a small pool, attended as a part of their own:
the attention sink is an outlier key that takes much of every query's mass, so its
rounding error moves every probability. Slots stay in position order (eviction
gathers sorted slots), so the sinks are always the first `pool` slots, whose
packed copies the pool shadows. On 2 x 512 essay tokens at max_kv 256, rotated
h2o-q4 vs dense h2o: +7.1% perplexity (KL 0.062) rotated only, +5.3% (0.043)
centred too, +3.4% (0.033) with the dense sinks as well; in groups of 32, +1.1%
(docs/quantized.md).

With 4-bit keys the newest tokens stay dense too (`dense_recent`, 16 by default): they
take most of a query's attention, and their 4-bit keys were most of what rotated h2o-q4
still lost (keys 4 / values 8 bits: KL 0.022 of 0.028). A tail pool holds them and
shadows the last slots, as the sink pool shadows the first (the recent window is never
evicted, so the newest tokens are always the last slots). A decode token's packed copy
is written when the tail fills, for all of its tokens at once, before the oldest leaves
it (`pack_pending`): until then no reader needs it. Rotated h2o-q4 in groups
of 32 vs dense h2o: KL 0.028 -> 0.005, perplexity +2.1% -> -0.1%, for 16 dense tokens per
layer and KV head.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Hashable
from functools import partial

import mlx.core as mx

from cache.attention import DENSE, KVFormat, seq_length
from cache.budget import kv_width, packed_extras
from cache.compiled_decode import slot_write
from cache.policies.h2o import H2OKVCache, turn_keys
from config.cache_spec import DEFAULT_GROUP_SIZE, CacheSpec, dense_recent_tokens
from kernels.hadamard import hadamard_block, rotate

PACKED_PARTS = 3  # mx.quantize's words, scales, biases


def check_group(head_dim: int, group_size: int) -> None:
    if head_dim % group_size:
        raise ValueError(
            f"head dim {head_dim} is not a multiple of the quantization group size "
            f"{group_size}: use a smaller group_size (32) or a dense policy"
        )


def quantize(x: mx.array, group_size: int, bits: int) -> list[mx.array]:
    """mx.quantize along the head dim: [words, scales, biases], the sequence still on axis 2."""
    check_group(x.shape[-1], group_size)
    return mx.quantize(x, group_size=group_size, bits=bits)


def encoded(fmt: KVFormat, keys: mx.array, values: mx.array) -> tuple:
    """K/V as a cache of format `fmt` stores them: packed (rotated first), or as given."""
    if not fmt.packed:
        return keys, values
    if fmt.rotated:
        keys, values = rotate(keys), rotate(values)
    gs, v_bits = fmt.group_size, fmt.value_bits or fmt.key_bits
    return quantize(keys, gs, fmt.key_bits), quantize(values, gs, v_bits)


def shifted_in(buf: mx.array, new: mx.array) -> mx.array:
    """`buf` [B, H, T, ...] with `new` [B, H, n, ...] appended along axis 2, its last T kept:
    a dense tail's newest tokens (also a slab's tail rows and their slots)."""
    return mx.concatenate([buf, new], axis=2)[:, :, -buf.shape[2] :]


@mx.compile
def _into_tail(tail_keys, tail_values, keys: mx.array, values: mx.array, center: mx.array):
    """A decode token's K/V, keys centred, shifted into the dense tail."""
    return shifted_in(tail_keys, keys - center), shifted_in(tail_values, values)


@functools.cache
def _packed_store(group_size: int, bits: int, value_bits: int, rotated: bool):
    """One decode token's K/V centred, rotated, packed and written into slot `at` (int32
    [1]) of every packed buffer, as one compiled call: (keys, values, new keys, new values,
    centre, at) -> (keys, values). A dynamic slice update: one op per buffer, where a
    scatter took three (its index reshaped and broadcast)."""

    def store(stored_keys: list, stored_values: list, keys, values, center, at) -> tuple:
        keys = keys - center
        if rotated:
            keys, values = rotate(keys), rotate(values)
        put = partial(slot_write, at)
        new_keys = quantize(keys, group_size, bits)
        new_values = quantize(values, group_size, value_bits)
        return list(map(put, stored_keys, new_keys)), list(map(put, stored_values, new_values))

    return mx.compile(store)


@functools.cache
def _kv_format(bits: int, value_bits: int, group_size: int, rotated: bool) -> KVFormat:
    return KVFormat(bits, value_bits, group_size, rotated=rotated)


@functools.lru_cache(maxsize=1024)
def _tail_slots(start: int, n: int) -> mx.array:
    """int32 [1, 1, n]: slots start, ..., start + n - 1. Built from host data once per
    start and kept (a decode's starts cycle with its evictions): no op in a step, and no
    array built from a Python list per layer and step."""
    return mx.array([[list(range(start, start + n))]], dtype=mx.int32)


class QuantizedH2OKVCache(H2OKVCache):
    """H2OKVCache over packed K/V: keys at `bits`, values at `value_bits` (None: `bits`).

    `bits`/`group_size` as mlx-lm's QuantizedKVCache, whose attention reads them
    when no router is installed; it assumes one width, so split widths need the
    router (make_cache installs it).
    """

    def __init__(
        self,
        max_size: int,
        *,
        group_size: int = DEFAULT_GROUP_SIZE,
        bits: int = 8,
        value_bits: int | None = None,
        rotate: bool = False,
        head_dim: int | None = None,
        dense_recent: int | None = None,
        **h2o,
    ):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, evict_batch).

        `rotate`: K/V Hadamard-rotated before packing (spreads outlier channels over
        the group); attention rotates the query in and the output back once, so any
        backend's packed kernel reads the rotated storage unchanged. `head_dim`, when
        given, is checked now against the group and the rotation. `dense_recent`: how
        many of the newest tokens are also kept dense, in the tail pool (at most the
        recent window; None: 16 for 4-bit keys, else none: config.cache_spec).
        """
        super().__init__(max_size, **h2o)
        self.group_size, self.bits, self.value_bits = group_size, bits, value_bits or bits
        self.rotate = rotate
        self.key_center = None  # [B, H, 1, D]: subtracted from every key before packing
        self.sink_keys = self.sink_values = None  # [B, H, sink, D]: the dense sink pool
        # [B, H, tail, D]: the newest tokens, dense (right-aligned; `tail_len` of them valid)
        self.tail = dense_recent_tokens(bits, self.recent, dense_recent) if self.dense_tail else 0
        self.tail_keys = self.tail_values = None
        self.tail_len = 0
        self.unpacked = 0  # newest tokens (all in the tail) whose packed copies wait
        if head_dim is not None:
            quantize(mx.zeros((1, head_dim)), group_size, bits)  # raises on a bad group
            if rotate:
                hadamard_block(head_dim)

    # The sliding-window twin evicts its sinks once they leave the window: no pools there.
    dense_sinks = dense_tail = True
    slab_rows = True

    @property
    def verifies_drafts(self) -> bool:
        """A draft's tokens are packed into the newest slots, which dense H2O's
        `settle_draft` gives back exactly. Not with a dense tail: a verify pass's early
        queries would read packed what decoding one by one reads dense (the tokens its
        later ones push out of the tail)."""
        return not self.tail

    @property
    def fills_holes(self) -> bool:
        """Not with a dense tail: it serves the last slots (sinks never move: they stay)."""
        return not self.tail

    # ------------------------------------------------------------ building, pricing

    @classmethod
    def spec_knobs(cls, spec: CacheSpec) -> dict:
        info = spec.info
        return dict(
            group_size=spec.group_size, bits=info.key_bits, value_bits=info.value_bits,
            rotate=spec.rotates(), dense_recent=spec.dense_recent,
        )  # fmt: skip

    @classmethod
    def slot_bytes(cls, shape, spec: CacheSpec) -> float:
        info, group = spec.info, spec.group_size
        return kv_width(shape, info.key_bits, group) + kv_width(shape, info.value_bits, group)

    @classmethod
    def extra_bytes(cls, shape, spec: CacheSpec, window: int | None) -> float:
        """The key centre and, outside sliding windows, the dense sink pool and tail."""
        return packed_extras(shape, spec, windowed=window is not None)

    @classmethod
    def check_head_dim(cls, spec: CacheSpec, head_dim: int) -> None:
        check_group(head_dim, spec.group_size)
        if spec.rotates():
            hadamard_block(head_dim)

    # ------------------------------------------------------------ speculative decoding

    def draft_room(self) -> int:
        """As dense H2O's, once the sink pool is full (a draft never writes it)."""
        return 0 if self.sinks_filling else super().draft_room()

    # ------------------------------------------------------------------ in a slab

    def slab_key(self) -> Hashable | None:
        if self.sinks_filling:
            return None
        if self.tail_keys is not None and self.tail_filled() < self.tail:  # so does its tail
            return None
        return super().slab_key()

    def slab_layout(self) -> tuple:
        return (self.kv_format, self.slab_buffers(), self.tail)

    def slab_buffers(self) -> tuple[str, ...]:
        """Its slots, the key centre, and the dense pools it has."""
        own = ("key_center", "sink_keys", "sink_values", "tail_keys", "tail_values")
        return super().slab_buffers() + tuple(n for n in own if getattr(self, n) is not None)

    @property
    def kv_format(self) -> KVFormat:
        # Read a few times a layer and step: one instance per format, not one per read.
        return _kv_format(self.bits, self.value_bits, self.group_size, self.rotate)

    def ranking_kv(self, n: int) -> tuple[mx.array, mx.array]:
        """Slots [0, n) unpacked, rotated back and the key centre added: the K/V as they
        came (to the rounding), for a rule that reads them. Pending packed copies (the dense
        tail's) sit in the recent window, which no rule ranks."""
        gs = self.group_size
        keys = mx.dequantize(*(a[:, :, :n] for a in self.keys), group_size=gs, bits=self.bits)
        values = mx.dequantize(
            *(a[:, :, :n] for a in self.values), group_size=gs, bits=self.value_bits
        )
        if self.rotate:  # the Hadamard rotation is its own inverse
            keys, values = rotate(keys), rotate(values)
        if self.key_center is not None:
            keys = keys + self.key_center
        return keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Centre the keys (the first tokens fix the centre), keep sinks dense, store all."""
        if self.positions is None:  # the first tokens (a restored cache keeps its own)
            self._start(keys, values)
        if keys.shape[2] == 1 and self.key_center is not None and self._every_slot(1):
            return self._decode_at_final_size(keys, values)
        if self.key_center is not None:
            keys = keys - self.key_center
        if self.sinks_filling:
            n = min(keys.shape[2], self.sink - self.seen)
            self.sink_keys[:, :, self.seen : self.seen + n] = keys[:, :, :n]
            self.sink_values[:, :, self.seen : self.seen + n] = values[:, :, :n]
        defer = self._defers(keys.shape[2])
        if not defer:
            self.pack_pending()
        if self.tail_keys is not None:
            self.tail_keys = shifted_in(self.tail_keys, keys)
            self.tail_values = shifted_in(self.tail_values, values)
            self.tail_len = min(self.tail, self.tail_len + keys.shape[2])
        if defer:
            return self._append_unpacked()
        return super().update_and_fetch(keys, values)

    def _decode_at_final_size(self, keys: mx.array, values: mx.array):
        """A decode token's store in one compiled call (its shapes repeat every step):
        centred into the dense tail (its packed copy waits: `_append_unpacked`), or centred,
        packed and written into its slot. What the op-by-op path above does, ~10 ops less.
        Where the router's compiled decode serves the step, the store joins that call
        (`pending_store`), unless the tail's copies are packed this step."""
        if self.tail_keys is not None:
            new = [keys, values, self.key_center]
            packs = self.unpacked + 1 == self.tail  # `_append_unpacked` reads the tail now
            self._store(_into_tail, ("tail_keys", "tail_values"), new, now=packs)
            return self._append_unpacked()
        self._check_scored()
        at = mx.array([self.used], dtype=mx.int32)  # a constant: no op in the step
        store = _packed_store(self.group_size, self.bits, self.value_bits, self.rotate)
        self._store(store, ("keys", "values"), [keys, values, self.key_center, at], now=False)
        self.used += 1
        self.offset += 1
        self.fused_decode = True
        return self._fetch()

    def _defers(self, n: int) -> bool:
        """Whether a new token's packed copy waits: one decode token, a full tail past the
        sinks that serves it, room for its slot."""
        if n != 1 or self.tail_keys is None or self.tail_filled() < self.tail:
            return False
        return self.used < self.positions.shape[-1]

    def _append_unpacked(self):
        """Take a decode token's slot (its position is set, its score 0) and leave its
        packed copy to `pack_pending`: no reader needs it while the tail serves it. Packing
        the tail's tokens once every `tail` steps instead of one per step saves ~10 small
        ops per layer and step (a third of what the tail costs)."""
        self._check_scored()
        self.used += 1
        self.offset += 1
        self.unpacked += 1
        if self.unpacked == self.tail:  # the oldest of them leaves the tail next step
            self.pack_pending()
        self.fused_decode = self._every_slot(1)
        return self._fetch()

    def pack_pending(self) -> None:
        """Write the packed copies the newest tokens wait for, from the dense tail."""
        n, self.unpacked = self.unpacked, 0
        if not n:
            return
        encoded = self.encode(self.tail_keys[:, :, -n:], self.tail_values[:, :, -n:])
        self._write_slots(*encoded, self.used - n, self.used)

    def _start(self, keys: mx.array, values: mx.array) -> None:
        """The centre (the mean key of the first tokens, sinks included: measured better
        than leaving them out) and the dense sink pool."""
        self.key_center = mx.mean(keys, axis=2, keepdims=True)
        if self.dense_sinks and self.sink > 0:
            shape = (*keys.shape[:2], self.sink, keys.shape[3])
            self.sink_keys = mx.zeros(shape, dtype=keys.dtype)
            self.sink_values = mx.zeros(shape, dtype=values.dtype)
        if self.tail:
            shape = (*keys.shape[:2], self.tail, keys.shape[3])
            self.tail_keys = mx.zeros(shape, dtype=keys.dtype)
            self.tail_values = mx.zeros(shape, dtype=values.dtype)

    @property
    def sinks_filling(self) -> bool:
        """Whether the dense sink pool still takes the tokens that come."""
        return self.sink_keys is not None and self.seen < self.sink

    def _pool(self) -> int:
        """Sink tokens served from the dense pool; they shadow packed slots [0, pool)."""
        return 0 if self.sink_keys is None else min(self.sink, self.seen)

    def tail_filled(self) -> int:
        """Newest tokens served from the dense tail; they shadow the last packed slots.
        Slots stay in position order and the recent window (at least `tail` long) is
        never evicted, so the newest tokens are always the last slots."""
        return 0 if self.tail_keys is None else min(self.tail_len, self.used - self._pool())

    def _every_slot(self, n_new: int) -> bool:
        """... once its dense pools are full too (their shapes fixed)."""
        pools_full = self._pool() == (0 if self.sink_keys is None else self.sink)
        return super()._every_slot(n_new) and pools_full and self.tail_filled() == self.tail

    def _slots_of_keys(self, slots: int) -> mx.array:
        """[sink pool | every packed slot | tail]: the pools' keys (-1) are always visible,
        their packed copies never (the sinks', past every slot) or while the tail serves
        them (the pools are full, their sizes fixed, once a decode reads every slot)."""
        pool = self._pool()
        always, tail = mx.full((pool,), -1, mx.int32), mx.full((self.tail,), -1, mx.int32)
        packed = mx.arange(slots, dtype=mx.int32)
        packed = mx.where(packed < pool, mx.array(2**31 - 1, mx.int32), packed)
        return mx.concatenate([always, packed, tail])

    def _slots_served(self) -> int:
        return self.used - self.tail_filled()

    def _front(self) -> int:
        """A decode reading every slot (`_fetch`) reads the packed buffers whole (no slice
        per buffer and step), the sinks' packed copies masked behind their dense pool."""
        return self._pool()

    def _tail(self) -> list:
        """The slots of the tail's tokens: the last `tail` held ones."""
        if not self.tail_filled():
            return []
        return [_tail_slots(self.used - self.tail, self.tail)]

    def kv_segments(self, keys, values) -> list[tuple[object, object, KVFormat]]:
        """[dense sinks | packed slots between | dense tail], in slot order, empty parts
        left out."""
        if not (self._pool() or self.tail_filled()):
            return [(keys, values, self.kv_format)]
        formats = (DENSE, self.kv_format, DENSE)
        parts = zip(keys, values, formats, strict=True)
        return [part for part in parts if seq_length(part[0])]

    @property
    def nbytes(self) -> int:
        pools = (self.sink_keys, self.sink_values, self.tail_keys, self.tail_values)
        extra = (self.key_center, *pools)
        return super().nbytes + sum(a.nbytes for a in extra if a is not None)

    def encode(self, keys: mx.array, values: mx.array):
        return encoded(self.kv_format, keys, values)

    def _fetch(self):
        """Packed slots; with dense pools (sinks, tail) in use, (sinks, packed, tail) each."""
        pool, tail = self._pool(), self.tail_filled()
        if not (pool or tail):
            return super()._fetch()
        # A decode reading every slot takes the packed buffers whole (`_front`), else one
        # slice per buffer; full pools whole: on the CPU every op of a decode step's graph
        # costs ~3-5 us, and these were a third of a packed layer's.
        if self.fused_decode:
            packed = self.keys, self.values
        else:
            end = self.used - tail
            packed = (
                [a[:, :, pool:end] for a in self.keys],
                [a[:, :, pool:end] for a in self.values],
            )
        sinks = tails = (None, None)
        if pool:
            sinks = self.sink_keys, self.sink_values
            if pool < self.sink_keys.shape[2]:
                sinks = tuple(a[:, :, :pool] for a in sinks)
        if tail:
            tails = self.tail_keys, self.tail_values
            if tail < self.tail:
                tails = tuple(a[:, :, self.tail - tail :] for a in tails)
        return (sinks[0], packed[0], tails[0]), (sinks[1], packed[1], tails[1])

    def _gather(self, idx: mx.array, capacity: int) -> None:
        # Slots in position order: the never-evicted sinks stay in slots [0, pool).
        super()._gather(mx.sort(idx, axis=-1), capacity)

    def _rerope_keys(self, delta: mx.array) -> None:
        """Unpack the held keys, rotate them by `delta` positions, pack them again."""
        n, gs = self.used, self.group_size
        dense = mx.dequantize(*(a[:, :, :n] for a in self.keys), group_size=gs, bits=self.bits)
        if self.rotate:  # the Hadamard rotation is its own inverse
            dense = rotate(dense)
        dense = self._turn(dense, delta)
        if self.rotate:
            dense = rotate(dense)
        for buf, packed in zip(self.keys, quantize(dense, gs, self.bits), strict=True):
            buf[:, :, :n] = packed
        pool, tail = self._pool(), self.tail_filled()
        if pool:
            turned = self._turn(self.sink_keys[:, :, :pool], delta[..., :pool])
            self.sink_keys[:, :, :pool] = turned
        if tail:
            turned = self._turn(self.tail_keys[:, :, -tail:], delta[..., n - tail : n])
            self.tail_keys[:, :, -tail:] = turned

    def trim(self, n: int) -> int:
        """Drop the n newest tokens; the dense tail drops them too (and holds fewer)."""
        n = super().trim(n)
        self.unpacked = max(self.unpacked - n, 0)
        if n and self.tail_keys is not None:

            def shifted(a: mx.array) -> mx.array:  # right-aligned: what is left moves right
                kept = a[:, :, : max(self.tail - n, 0)]
                return mx.pad(kept, [(0, 0), (0, 0), (self.tail - kept.shape[2], 0), (0, 0)])

            self.tail_keys, self.tail_values = shifted(self.tail_keys), shifted(self.tail_values)
            self.tail_len = max(self.tail_len - n, 0)
        return n

    def _turn(self, centred: mx.array, delta: mx.array) -> mx.array:
        """RoPE turns a key, not a centred one: add the centre back, turn, take it off."""
        if self.key_center is None:
            return turn_keys(self.rope, centred, delta)
        return turn_keys(self.rope, centred + self.key_center, delta) - self.key_center

    def _kv_state(self) -> tuple:
        """Packed K/V, then the centre and the dense sink pool (what the keys are
        relative to, and what shadows the first packed slots)."""
        keys, values = super()._kv_state()
        keys, values = list(keys), list(values)
        if self.key_center is not None:
            keys.append(self.key_center)
        if self.sink_keys is not None:
            keys.append(self.sink_keys)
            values.append(self.sink_values)
        if self.tail_keys is not None:  # last: meta's has_tail says it is there
            keys.append(self.tail_keys)
            values.append(self.tail_values)
        return keys, values

    def _kv_loaded(self) -> None:
        self.key_center = self.sink_keys = self.sink_values = None
        self.tail_keys = self.tail_values = None
        if self.keys is None:
            return
        keys, values = list(self.keys), list(self.values)
        self.keys, self.values = keys[:PACKED_PARTS], values[:PACKED_PARTS]
        extra_k, extra_v = keys[PACKED_PARTS:], values[PACKED_PARTS:]
        if self._saved_tail and extra_v:
            self.tail_keys, self.tail_values = extra_k.pop(), extra_v.pop()
        if extra_k:
            self.key_center = extra_k[0]
        if len(extra_k) > 1:
            self.sink_keys, self.sink_values = extra_k[1], extra_v[0]

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(group_size=self.group_size, bits=self.bits, value_bits=self.value_bits)
        meta.update(rotate=self.rotate, tail=self.tail, tail_len=self.tail_len)
        meta.update(has_tail=self.tail_keys is not None, unpacked=self.unpacked)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        H2OKVCache.meta_state.fset(self, v)
        meta = json.loads(v[0])
        self.group_size, self.bits = meta["group_size"], meta["bits"]
        self.value_bits = meta.get("value_bits", self.bits)
        self.rotate = meta.get("rotate", False)
        # Saved before the dense tail existed: none (the cache reads as it was packed).
        self.tail, self.tail_len = meta.get("tail", 0), meta.get("tail_len", 0)
        self._saved_tail = meta.get("has_tail", False)
        self.unpacked = meta.get("unpacked", 0)
