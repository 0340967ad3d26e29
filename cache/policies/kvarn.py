"""KVarNCache: the `kvarn` policy, KV quantization by rotation and variance normalization.

KVarN (Muller et al., 2026; mlx-kvarn): every token is Hadamard-rotated along the head
dim (kernels/hadamard.py) on arrival. The first `sink` tokens (128) stay dense in the
front pool. Later tokens wait, dense, in the tail pool until `tile` (128) of them have
gathered; that tile is then Sinkhorn-balanced and packed, keys and values at their own
widths (cache/policies/kvarn_tiles.py; presets: config/cache_spec.KVARN_PRESETS, k4v2 default).
Nothing is ever
evicted: memory grows by one packed tile per `tile` tokens. Under `auto` a conversation
starts in plain dense caches and is stored into these when it outgrows the tokens its
share holds dense (CacheSpec.dense_until, cache/factory.py pack_dense).

Slots are [front | tiles | tail] in position order, so mlx-lm's causal mask for new
tokens (the last N slots) holds. Attention (kernels/kvarn.py) rotates the query once,
reads the packed tiles with one packed matmul per tile for q.k and for p.v, and rotates
the output back once; cache/attention.py calls it for the KVFormat this cache reports.

Bytes (all exact, asserted against `nbytes` in tests, used by cache/budget.py): the
front pool is allocated whole (`sink` dense slots) with the first token, the tail pool
whole (`tile` dense slots) with the first token past it, and each tile holds packed
words, float16 scales and biases and one float16 factor vector (cache/budget.py's
`tile_nbytes`).
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from cache.attention import KVFormat
from cache.budget import kvarn_layer_bytes, value_group
from cache.contents import LayerContents, every_token
from cache.contract import ScoredCache
from cache.policies.full import FullKVCache
from cache.policies.kvarn_tiles import SINKHORN_ITERS, encode_tiles
from config.cache_spec import KVARN_PRESETS, KVARN_SINK, KVARN_TILE, QUANT_GROUP_SIZES, CacheSpec
from config.policies import FULL, KVARN
from kernels.hadamard import hadamard_block, rotate
from kernels.kvarn import TileFormat

TILE_SIZES = QUANT_GROUP_SIZES  # the key group spans one tile
BITS = (2, 4, 8)


def check_head_dim(head_dim: int, group: int | None = None) -> None:
    """Raise a clear ValueError when KVarN cannot store this head dim (values in groups of
    `group` channels, or the widest that fits)."""
    hadamard_block(head_dim)
    value_group(head_dim)
    if group is not None and head_dim % group:
        raise ValueError(f"head dim {head_dim} is not a multiple of the value group {group}")


class KVarNCache(ScoredCache):
    """Rotated K/V: dense front (sink) pool, Sinkhorn-balanced packed tiles, dense tail."""

    # Channels per value scale; None: the widest that divides the head dim (also what
    # caches saved before this was stored were packed with).
    value_group_size: int | None = None

    def __init__(
        self,
        key_bits: int = 4,
        value_bits: int = 2,
        *,
        tile: int = KVARN_TILE,
        sink: int = KVARN_SINK,
        head_dim: int | None = None,
        sinkhorn_iters: int = SINKHORN_ITERS,
        value_group_size: int | None = None,
    ):
        """`head_dim`, when given, is checked now (else on the first tokens)."""
        if key_bits not in BITS or value_bits not in BITS:
            raise ValueError(f"KVarN widths must be among {BITS}, got k{key_bits}v{value_bits}")
        if tile not in TILE_SIZES:
            raise ValueError(f"KVarN tile must be one of {TILE_SIZES} tokens, got {tile}")
        if sink < 0:
            raise ValueError(f"the sink pool cannot be negative, got {sink}")
        if value_group_size not in (None, *QUANT_GROUP_SIZES):
            raise ValueError(
                f"KVarN value groups are {QUANT_GROUP_SIZES} channels, got {value_group_size}"
            )
        if head_dim is not None:
            check_head_dim(head_dim, value_group_size)
        self.value_group_size = value_group_size
        self.key_bits, self.value_bits, self.tile, self.sink = key_bits, value_bits, tile, sink
        self.sinkhorn_iters = sinkhorn_iters
        self.front = self.tail = None  # [k, v] dense pools [B, H, slots, D]
        self.tiles = None  # [key tiles, value tiles] (kernels/kvarn.py layout)
        self.n_front = self.n_tail = 0
        self.offset = 0

    # ------------------------------------------------------------ building, pricing

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None) -> KVarNCache:
        if window is not None:
            raise ValueError("KVarN keeps every token: a sliding-window layer keeps its window")
        return cls(*KVARN_PRESETS[spec.kvarn])

    @classmethod
    def layer_bytes(cls, shape, spec: CacheSpec, window: int | None = None) -> float:
        """max_kv tokens: both pools whole, every full tile packed; or, if more, the
        plain dense cache it starts as (`dense_until` tokens)."""
        bits, group = KVARN_PRESETS[spec.kvarn], value_group(shape.head_dim)
        packed = kvarn_layer_bytes(shape, spec.max_kv, KVARN_SINK, KVARN_TILE, bits, group)
        if not spec.dense_until:
            return packed
        return max(packed, FullKVCache.layer_bytes(shape, CacheSpec(FULL.name, spec.dense_until)))

    @classmethod
    def check_head_dim(cls, spec: CacheSpec, head_dim: int) -> None:
        check_head_dim(head_dim)

    # ------------------------------------------------------------------ the contract

    def contents(self) -> LayerContents:
        heads = 0 if self.front is None else self.front[0].shape[1]
        return every_token(self.offset, heads, kind=KVARN.name)

    def slab_key(self) -> tuple | None:
        """Sessions of one configuration decode as rows of one padded slab, whatever
        they hold (cache/batching/kvarn_padded.py)."""
        if self.front is None:
            return None
        front = self.front[0]  # fmt: widths, tile and value group
        shape = (front.dtype, front.shape[1], front.shape[3])
        return (type(self).__name__, self.fmt, self.sink, self.sinkhorn_iters, *shape)

    def trimmable_tokens(self) -> int:
        """The dense pools' tokens: packed tiles stay."""
        return self.n_tail if self.tiles is not None else self.n_front + self.n_tail

    # ------------------------------------------------------------ speculative decoding

    # Its evicting subclasses decode a token a pass.
    verifies_drafts = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.verifies_drafts = cls.__dict__.get("verifies_drafts", False)

    def draft_room(self) -> int:
        """As many draft tokens as stay in the dense pools (settle_draft trims them back
        exactly): the token that fills the tail's tile packs it, so that one comes in a
        pass of its own, as it would decoding without drafts."""
        if not self.verifies_drafts or self.front is None:
            return 0
        return max(0, (self.sink - self.n_front) + (self.tile - self.n_tail) - 2)

    # ------------------------------------------------------------------ protocol

    @property
    def fmt(self) -> TileFormat:
        d = self.front[0].shape[-1]
        group = self.value_group_size or value_group(d)
        return TileFormat(self.tile, self.key_bits, self.value_bits, group)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store N new tokens (rotated); full tiles leave the tail packed."""
        if self.front is None:
            check_head_dim(keys.shape[-1], self.value_group_size)
            shape = (*keys.shape[:2], self.sink, keys.shape[-1])
            self.front = [mx.zeros(shape, keys.dtype), mx.zeros(shape, values.dtype)]
        k, v = rotate(keys), rotate(values)
        m = min(k.shape[2], self.sink - self.n_front)
        if m:
            for pool, new in zip(self.front, (k, v), strict=True):
                pool[:, :, self.n_front : self.n_front + m] = new[:, :, :m]
            self.n_front += m
        if m < k.shape[2]:
            self._append_tail(k[:, :, m:], v[:, :, m:])
        self.offset = self.offset + keys.shape[2]  # a slab row's: an array, not changed in place
        return self._fetch()

    def kv_segments(self, keys, values) -> list[tuple[object, object, KVFormat]]:
        """What update_and_fetch returned, as one KVarN part for cache/attention.py."""
        fmt = self.fmt
        layout = KVFormat(fmt.key_bits, fmt.value_bits, fmt.group_size, tile=fmt.tile)
        return [(keys, values, layout)]

    scores = None  # keeps no importance: nothing is ever evicted
    keeps_scores = False

    def update_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """No eviction: the scores are only checked against the stored length."""
        if scores.shape[-1] != self.size():
            raise ValueError(
                f"scores cover {scores.shape[-1]} keys but the cache holds {self.size()}"
            )

    def add_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """A block of a prompt chunk's scores: nothing to keep."""

    def evict_if_full(self) -> None:
        """Never evicts."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError(f"{type(self).__name__} cannot serve a sliding-window attention layer")
        if N == 1:
            return None
        return create_causal_mask(N, self.size()) if return_array else "causal"

    def n_tiles(self) -> int:
        return 0 if self.tiles is None else self.tiles[0][0].shape[2]

    def size(self) -> int:
        """Tokens physically stored (per head)."""
        return self.n_front + self.n_tiles() * self.tile + self.n_tail

    def empty(self) -> bool:
        return self.front is None

    @property
    def nbytes(self) -> int:
        """Every buffer held: both dense pools whole, and the packed tiles."""
        held = [*(self.front or []), *(self.tail or [])]
        if self.tiles is not None:
            held += [*self.tiles[0], *self.tiles[1]]
        return sum(a.nbytes for a in held)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop up to n newest tokens from the dense pools (packed tiles stay); return how many."""
        if self.tiles is not None:
            n = min(n, self.n_tail)
            self.n_tail -= n
        else:
            n = min(n, self.n_front + self.n_tail)
            from_tail = min(n, self.n_tail)
            self.n_tail -= from_tail
            self.n_front -= n - from_tail
        self.offset -= n
        return n

    @property
    def state(self):
        tiles = self.tiles or [None, None]
        return self.front, tiles[0], tiles[1], self.tail, self.meta_state[0]

    @state.setter
    def state(self, v) -> None:
        self.front, k_tiles, v_tiles, self.tail, meta = v
        self.tiles = None if k_tiles is None else [list(k_tiles), list(v_tiles)]
        self.front = None if self.front is None else list(self.front)
        self.tail = None if self.tail is None else list(self.tail)
        self.meta_state = (meta,)

    @property
    def meta_state(self) -> tuple[str]:
        keys = ("key_bits", "value_bits", "tile", "sink", "sinkhorn_iters", "value_group_size")
        meta = {k: getattr(self, k) for k in keys}
        meta.update(n_front=self.n_front, n_tail=self.n_tail, offset=self.offset)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        for key, value in json.loads(v[0]).items():
            setattr(self, key, value)

    # ------------------------------------------------------------------ internals

    def _fetch(self):
        """[front, tiles, tail] for keys and for values, unused slots cut off."""
        front = [None, None]
        if self.n_front:  # a full pool whole: no slice op per step
            full = self.n_front == self.front[0].shape[2]
            front = self.front if full else [p[:, :, : self.n_front] for p in self.front]
        tail = [p[:, :, : self.n_tail] for p in self.tail] if self.n_tail else [None, None]
        tiles = self.tiles or [None, None]
        return [front[0], tiles[0], tail[0]], [front[1], tiles[1], tail[1]]

    def _append_tail(self, k: mx.array, v: mx.array) -> None:
        """Add tokens after the tail's; every full tile of the tail is packed."""
        if self.tail is None:
            shape = (*k.shape[:2], self.tile, k.shape[-1])
            self.tail = [mx.zeros(shape, k.dtype), mx.zeros(shape, v.dtype)]
        end = self.n_tail + k.shape[2]
        if end < self.tile:  # decode: the tile is not full yet, write in place
            self.tail[0][:, :, self.n_tail : end] = k
            self.tail[1][:, :, self.n_tail : end] = v
            self.n_tail = end
            return
        pending = [
            mx.concatenate([p[:, :, : self.n_tail], x], axis=2)
            for p, x in zip(self.tail, (k, v), strict=True)
        ]
        self._set_tail(*pending)

    def _set_tail(self, k: mx.array, v: mx.array) -> None:
        """Make k/v (dense, rotated) the tail: full tiles from its front are packed first."""
        full = k.shape[2] // self.tile * self.tile
        if full:
            self._append_tiles(k[:, :, :full], v[:, :, :full])
        self.n_tail = k.shape[2] - full
        if self.n_tail:
            self.tail[0][:, :, : self.n_tail] = k[:, :, full:]
            self.tail[1][:, :, : self.n_tail] = v[:, :, full:]

    def _append_tiles(self, k: mx.array, v: mx.array) -> None:
        B, H, n, D = k.shape
        shape = (B, H, n // self.tile, self.tile, D)
        new = encode_tiles(k.reshape(shape), v.reshape(shape), self.fmt, self.sinkhorn_iters)
        if self.tiles is None:
            self.tiles = new
        else:
            self.tiles = [
                [mx.concatenate([a, b], axis=2) for a, b in zip(old, fresh, strict=True)]
                for old, fresh in zip(self.tiles, new, strict=True)
            ]
