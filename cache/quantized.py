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
selectable (config/cache_spec.MIXED_SCHEMES, cache/mixed.py for the two
segmented ones). `rotate=True` (Hadamard) spreads the outliers instead: h2o-q4
+7.1% perplexity vs dense h2o instead of +18%; numbers in docs/quantized.md.
"""

from __future__ import annotations

import json

import mlx.core as mx

from cache.attention import KVFormat
from cache.h2o import H2OKVCache, turn_keys
from config.cache_spec import DEFAULT_GROUP_SIZE
from kernels.hadamard import hadamard_block, rotate


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
        rotate: bool = False,
        head_dim: int | None = None,
        **h2o,
    ):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, evict_batch).

        `rotate`: K/V Hadamard-rotated before packing (spreads outlier channels over
        the group); attention rotates the query in and the output back once, so any
        backend's packed kernel reads the rotated storage unchanged. `head_dim`, when
        given, is checked now against the group and the rotation.
        """
        super().__init__(max_size, **h2o)
        self.group_size, self.bits, self.value_bits = group_size, bits, value_bits or bits
        self.rotate = rotate
        if head_dim is not None:
            quantize(mx.zeros((1, head_dim)), group_size, bits)  # raises on a bad group
            if rotate:
                hadamard_block(head_dim)

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(self.bits, self.value_bits, self.group_size, rotated=self.rotate)

    def _encode(self, keys: mx.array, values: mx.array):
        gs = self.group_size
        if self.rotate:
            keys, values = rotate(keys), rotate(values)
        return quantize(keys, gs, self.bits), quantize(values, gs, self.value_bits)

    def _rerope_keys(self, delta: mx.array) -> None:
        """Unpack the held keys, rotate them by `delta` positions, pack them again."""
        n, gs = self._len, self.group_size
        dense = mx.dequantize(*(a[:, :, :n] for a in self.keys), group_size=gs, bits=self.bits)
        if self.rotate:  # the Hadamard rotation is its own inverse
            dense = rotate(dense)
        dense = turn_keys(self.rope, dense, delta)
        if self.rotate:
            dense = rotate(dense)
        for buf, packed in zip(self.keys, quantize(dense, gs, self.bits), strict=True):
            buf[:, :, :n] = packed

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(group_size=self.group_size, bits=self.bits, value_bits=self.value_bits)
        meta.update(rotate=self.rotate)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        H2OKVCache.meta_state.fset(self, v)
        meta = json.loads(v[0])
        self.group_size, self.bits = meta["group_size"], meta["bits"]
        self.value_bits = meta.get("value_bits", self.bits)
        self.rotate = meta.get("rotate", False)
