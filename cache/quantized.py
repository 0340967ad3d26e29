"""Quantized H2O caches: h2o-q8, h2o-q4 and h2o-mixed.

Packed storage. Keys and values go through `mx.quantize` along the head dim on
arrival (affine, `group_size` 64 by default): per KV head and slot a cache holds
packed uint32 words [.., D * bits / 32], one scale and one bias per group. Every
buffer keeps the sequence on axis 2, so H2OKVCache's scoring and eviction run
unchanged: eviction gathers the packed words, scales and biases along that axis
(`take_along_axis`), never dequantizing or requantizing.

Attention reads the packed buffers through `kernels.quantized_sdpa_with_scores`
("fused"), or dequantizes them and calls the dense kernel ("dequantize");
`set_quantized_attention` picks the path, so benchmarks can time both. The
kernels take one width for K and V; keys and values of different widths (k8v4)
go through two packed matmuls (`mx.quantized_matmul`) instead.

h2o-mixed. The paper keeps the heavy segment 8-bit and the recent window 4-bit;
a token then is quantized twice, 4-bit on arrival and 8-bit (from its 4-bit
value) when it leaves the window. MixedH2OKVCache stores the two segments
apart: `old` (sinks and heavy hitters, per-head slots, `heavy_bits`) and
`recent` (the newest `recent` tokens, the same in every head, `recent_bits`,
None = unquantized). A token moves from recent to old when the window passes
it. Slots stay in position order (eviction gathers sorted indices), so scores
over [old | recent] line up with H2OKVCache's per-slot bookkeeping; attention
runs over each segment and merges them by log-sum-exp.

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
selectable (MIXED_SCHEMES); numbers in docs/quantized.md (bench/quantized.py).
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_map

from cache.h2o import H2OKVCache, gather_slots
from kernels import quantized_sdpa_with_scores, sdpa_with_scores
from kernels.reference import expand_mask

ATTENTION_PATHS = ("fused", "dequantize")
DEFAULT_GROUP_SIZE = 64
_attention_path = "fused"


def set_quantized_attention(path: str) -> None:
    """'fused': kernels read packed K/V; 'dequantize': mx.dequantize, then the dense kernel."""
    global _attention_path
    if path not in ATTENTION_PATHS:
        raise ValueError(f"quantized attention path {path!r}: choose from {ATTENTION_PATHS}")
    _attention_path = path


def quantized_attention(
    queries: mx.array,
    k_q: list[mx.array],
    v_q: list[mx.array],
    scale: float,
    mask,
    group_size: int,
    bits: int,
    value_bits: int | None = None,
) -> tuple[mx.array, mx.array]:
    """(out, float32 pre-softmax scores) over packed K/V, by the selected path.

    Keys have `bits`, values `value_bits` (None: the same).
    """
    value_bits = value_bits or bits
    if _attention_path == "dequantize":
        k = mx.dequantize(*k_q, group_size=group_size, bits=bits)
        v = mx.dequantize(*v_q, group_size=group_size, bits=value_bits)
        return sdpa_with_scores(queries, k, v, scale=scale, mask=mask)
    if value_bits != bits:  # the kernels take one width: packed matmuls, one per width
        return _split_width_attention(queries, k_q, v_q, scale, mask, group_size, bits, value_bits)
    return quantized_sdpa_with_scores(
        queries, k_q, v_q, scale, mask, group_size=group_size, bits=bits
    )


def _split_width_attention(q, k_q, v_q, scale, mask, group_size, key_bits, value_bits):
    """softmax(scale q k^T + mask) v straight from packed K and V of different widths."""
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k_q[0].shape[1], k_q[0].shape[2]
    # Query heads of one KV head stacked as rows (GQA): one packed matmul per KV head.
    qg = (q.astype(mx.float32) * scale).reshape(B, n_kv, n_q // n_kv * L_q, D)
    qmm = {"group_size": group_size, "transpose": True}
    scores = mx.quantized_matmul(qg, *k_q, bits=key_bits, **qmm).reshape(B, n_q, L_q, L_k)
    m = expand_mask(mask, L_q, L_k)
    if m is not None:
        scores = mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(qg.shape[:3] + (L_k,))
    qmm["transpose"] = False
    out = mx.quantized_matmul(probs, *v_q, bits=value_bits, **qmm).reshape(B, n_q, L_q, -1)
    return out.astype(q.dtype), scores


def quantize(x: mx.array, group_size: int, bits: int) -> list[mx.array]:
    """mx.quantize along the head dim: [words, scales, biases], the sequence still on axis 2."""
    if x.shape[-1] % group_size:
        raise ValueError(
            f"head dim {x.shape[-1]} is not a multiple of the quantization group size "
            f"{group_size}: use a smaller group_size (32) or a dense policy"
        )
    return mx.quantize(x, group_size=group_size, bits=bits)


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
        **h2o,
    ):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, alpha, evict_batch)."""
        super().__init__(max_size, **h2o)
        self.group_size, self.bits, self.value_bits = group_size, bits, value_bits or bits

    def attention_with_scores(self, queries, keys, values, scale: float, mask=None):
        """What the router calls for this layer: keys/values as update_and_fetch returned them."""
        gs, bits, v_bits = self.group_size, self.bits, self.value_bits
        return quantized_attention(queries, keys, values, scale, mask, gs, bits, v_bits)

    def _encode(self, keys: mx.array, values: mx.array):
        gs = self.group_size
        return quantize(keys, gs, self.bits), quantize(values, gs, self.value_bits)

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(group_size=self.group_size, bits=self.bits, value_bits=self.value_bits)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        H2OKVCache.meta_state.fset(self, v)
        meta = json.loads(v[0])
        self.group_size, self.bits = meta["group_size"], meta["bits"]
        self.value_bits = meta.get("value_bits", self.bits)


class MixedH2OKVCache(H2OKVCache):
    """Sinks and heavy hitters at `heavy_bits`, the recent window at `recent_bits` (None: dense).

    `keys`/`values` are [old, recent]: old is mx.quantize's [words, scales, biases]
    with spare slots (None before the first token leaves the window), recent holds
    exactly the window's tokens (an array, or a packed list when quantized).
    """

    def __init__(
        self,
        max_size: int,
        *,
        group_size: int = DEFAULT_GROUP_SIZE,
        heavy_bits: int = 8,
        recent_bits: int | None = None,
        **h2o,
    ):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, alpha, evict_batch)."""
        super().__init__(max_size, **h2o)
        self.group_size, self.heavy_bits, self.recent_bits = group_size, heavy_bits, recent_bits

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append to the recent window; tokens pushed out of it move to the old segment."""
        n_new = keys.shape[2]
        end = self._len + n_new
        if self.positions is None or end > self.positions.shape[-1]:
            self._grow(keys, values, end)  # scores/positions; the segments size themselves
        if self.keys is None:
            self.keys, self.values = [None, None], [None, None]
        n_old = self._n_old()
        for buf, new in ((self.keys, keys), (self.values, values)):
            new = self._encode_recent(new)
            window = new if buf[1] is None else tree_map(_concat, buf[1], new)
            spill = max(0, _length(window) - self.recent)
            if spill:
                self._append_old(buf, n_old, _slots(window, 0, spill))
            buf[1] = _slots(window, spill, None) if spill < _length(window) else None
        self._len = end
        self.offset += n_new
        return self._fetch()

    def attention_with_scores(self, queries, keys, values, scale: float, mask=None):
        """Attention over [old | recent], merged by log-sum-exp; scores in slot order."""
        (old_k, rec_k), (old_v, rec_v) = keys, values
        n_old, n_rec = _length(old_k), _length(rec_k)
        full = expand_mask(mask, queries.shape[2], n_old + n_rec)
        parts = []
        if n_old:
            m = None if full is None else full[..., :n_old]
            gs, bits = self.group_size, self.heavy_bits
            parts.append(quantized_attention(queries, old_k, old_v, scale, m, gs, bits))
        if n_rec:
            m = None if full is None else full[..., n_old:]
            if self.recent_bits is None:
                parts.append(sdpa_with_scores(queries, rec_k, rec_v, scale=scale, mask=m))
            else:
                gs, bits = self.group_size, self.recent_bits
                parts.append(quantized_attention(queries, rec_k, rec_v, scale, m, gs, bits))
        if len(parts) == 1:
            return parts[0]
        return _merge(parts, queries.dtype)

    def trim(self, n: int) -> int:
        """Drop the n newest tokens, never past the last eviction; return how many."""
        n = max(0, min(n, self.offset - self._last_eviction))
        if n == 0:
            return 0
        # Slots are in position order in every head: the newest n are the last n.
        keep = self._len - n
        n_old = self._n_old()
        rec_keep = keep - min(n_old, keep)
        for buf in (self.keys, self.values):
            buf[1] = _slots(buf[1], 0, rec_keep) if rec_keep else None
        self._len = keep
        self.offset -= n
        self._reset_free_slots()
        return n

    @property
    def state(self):
        return super().state

    @state.setter
    def state(self, v) -> None:
        H2OKVCache.state.fset(self, v)
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
        return self._len - _length(self.keys[1])

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
        needed = n_old + _length(window_part)
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
        n_old, n_rec = self._n_old(), _length(self.keys[1])
        keep_old = idx.shape[-1] - n_rec
        old_idx = idx[..., :keep_old, None]
        old_capacity = max(keep_old, capacity - self.recent)
        for buf in (self.keys, self.values):
            if buf[0] is not None:
                buf[0] = [gather_slots(a[:, :, :n_old], old_idx, old_capacity) for a in buf[0]]


# h2o-mixed schemes: name -> (cache class, its width arguments). The module docstring
# says why MIXED_DEFAULT wins.
MIXED_SCHEMES = {
    # keys 8-bit, values 4-bit, in every segment
    "k8v4": (QuantizedH2OKVCache, {"bits": 8, "value_bits": 4}),
    # the paper: heavy segment 8-bit, recent window 4-bit (a token quantized twice)
    "paper": (MixedH2OKVCache, {"heavy_bits": 8, "recent_bits": 4}),
    # recent window dense, 8-bit once a token leaves it
    "dense-recent": (MixedH2OKVCache, {"heavy_bits": 8, "recent_bits": None}),
}
MIXED_DEFAULT = "k8v4"


def _length(x) -> int:
    """Sequence length of an array or packed list (0 for None)."""
    if x is None:
        return 0
    return (x[0] if isinstance(x, (list, tuple)) else x).shape[2]


def _slots(x, start: int, stop: int | None):
    """Slots [start, stop) of an array or packed list, along the sequence axis."""
    return tree_map(lambda a: a[:, :, start:stop], x)


def _concat(a: mx.array, b: mx.array) -> mx.array:
    return mx.concatenate([a, b], axis=2)


def _merge(parts: list[tuple[mx.array, mx.array]], dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Combine attention over disjoint key sets: weight each by its share of the softmax mass."""
    lses = [mx.logsumexp(scores, axis=-1, keepdims=True) for _, scores in parts]
    total = lses[0]
    for lse in lses[1:]:
        total = mx.logaddexp(total, lse)
    out = None
    for (o, _), lse in zip(parts, lses, strict=True):
        w = mx.exp(lse - total)
        # A row that sees no key of a segment has w = 0 and a NaN output there.
        term = mx.where(w > 0, w * o.astype(mx.float32), 0.0)
        out = term if out is None else out + term
    return out.astype(dtype), mx.concatenate([scores for _, scores in parts], axis=-1)
