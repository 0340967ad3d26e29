"""H2OKVarNCache: the `h2o-kvarn` policy, H2O heavy-hitter eviction over KVarN storage.

Storage is KVarNCache's (rotated tokens; dense front pool = H2O's sinks; packed tiles of
64 tokens, 32 below max_kv 256 (config.cache_spec.h2o_kvarn_tile); dense tail of fewer
than a tile), with H2O's per-slot scores and positions in slot order (a tail token that
becomes part of a tile keeps its slot). When the cache
holds more than max_size tokens, tokens leave by one of two rules (`strategy`):

- "requantize" (default): token-level H2O. The kept slots are exactly dense H2O's for
  the same scores. Tiles that lost no token keep their bytes; the survivors of damaged
  tiles are dequantized, laid out after the intact tiles and packed again in full
  tiles (without Sinkhorn rounds by default: `repack_sinkhorn_iters`,
  config.cache_spec.H2O_KVARN_REPACK_SINKHORN_ITERS says why), the rest joining the
  dense tail. Keys cannot move packed (one group per channel spans a tile's tokens),
  and values would lose their per-tile factor.
- "tile": a tile leaves whole: tiles wholly outside the recent window rank by the sum
  of their tokens' scores and the lowest go. Nothing is re-packed, but heavy hitters
  leave with their tile's weak tokens.

Measured when the rule was chosen (default model, essays, max_kv 256, 2 x 512 tokens;
docs/quantized.md), perplexity vs dense h2o: whole tiles +5.6-6.4%; re-packing every 16
evicted tokens +3.0%, every 64 (a tile's worth) +1.95%; moving value rows packed with
per-token scales only (no channel factor) +3.4%. Re-packing compounds error, so it
should be rare: the default evicts a tile's worth at a time. What is left is mostly the
2-bit value grid (docs/kvarn_ablation.md: k4v4 leaves a third of k4v2's KL), hence
values in groups of 32 channels here (`value_group_size`, H2O_KVARN_VALUE_GROUP):
k4v2 is now +1.0-1.5% over dense h2o on three window sets.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Hashable

import mlx.core as mx

from cache.attention import ATTENTION
from cache.budget import H2O_BOOKKEEPING, kvarn_layer_bytes, value_group
from cache.compiled_decode import attend_then_score, attended_and_scored, compiled_on_template
from cache.contents import LayerContents, scored_contents
from cache.policies.kvarn import KVarNCache
from cache.policies.kvarn import check_head_dim as check_kvarn_head_dim
from cache.policies.kvarn_tiles import SINKHORN_ITERS, encode_tiles
from cache.scores import ScoreRule
from cache.scores.heavy_hitters import HeavyHitters, segment_knobs
from config.cache_spec import (
    DEFAULT_SCORE,
    H2O_KVARN_REPACK_SINKHORN_ITERS,
    H2O_KVARN_VALUE_GROUP,
    KVARN_PRESETS,
    KVARN_STRATEGIES,
    CacheSpec,
    choose,
    h2o_kvarn_tile,
    split_segments,
)
from kernels.hadamard import rotate
from kernels.kvarn import dequantize_keys, dequantize_values


class H2OKVarNCache(HeavyHitters, KVarNCache):
    repack_sinkhorn_iters: int = H2O_KVARN_REPACK_SINKHORN_ITERS  # also for older saves
    keeps_scores = True  # KVarNCache's storage, H2O's eviction by score

    def __init__(
        self,
        max_size: int,
        key_bits: int = 4,
        value_bits: int = 2,
        *,
        tile: int | None = None,
        sink: int | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        score: str | ScoreRule = DEFAULT_SCORE,
        evict_batch: int | None = None,
        strategy: str = "requantize",
        head_dim: int | None = None,
        sinkhorn_iters: int = SINKHORN_ITERS,
        value_group_size: int = H2O_KVARN_VALUE_GROUP,
        repack_sinkhorn_iters: int = H2O_KVARN_REPACK_SINKHORN_ITERS,
    ):
        budget = split_segments(max_size, sink=sink, heavy=heavy, recent=recent)
        tile = h2o_kvarn_tile(budget.max_size) if tile is None else tile
        super().__init__(
            key_bits,
            value_bits,
            tile=tile,
            sink=budget.sink,
            head_dim=head_dim,
            sinkhorn_iters=sinkhorn_iters,
            value_group_size=value_group_size,
        )
        choose("h2o-kvarn strategy", strategy, KVARN_STRATEGIES)
        if strategy == "tile" and budget.heavy < tile:
            raise ValueError(f"tile eviction needs a heavy budget of at least one tile ({tile})")
        # A tile's worth at a time by default: every eviction re-packs the damaged tiles,
        # so fewer, larger evictions quantize survivors fewer times (docs/quantized.md).
        self.set_rule(
            max_size, budget.sink, budget.heavy, budget.recent, score, evict_batch,
            default_batch=max(1, min(tile, budget.heavy)),
        )  # fmt: skip
        self.strategy = strategy
        self.repack_sinkhorn_iters = repack_sinkhorn_iters
        self.scores = self.positions = None  # [B, H, size] per slot

    # ------------------------------------------------------------ building, pricing

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None) -> H2OKVarNCache:
        if window is not None:
            raise ValueError("no KVarN twin inside a sliding window (config/policies.py)")
        return cls(
            spec.max_kv, *KVARN_PRESETS[spec.kvarn], **segment_knobs(spec),
            strategy=spec.kvarn_strategy,
        )  # fmt: skip

    @classmethod
    def layer_bytes(cls, shape, spec: CacheSpec, window: int | None = None) -> float:
        """max_kv + 1 tokens (the newest waits in a spare slot until the eviction, as in
        dense H2O): H2O's sinks as the front pool, whole tiles, the tail pool whole; a
        score and a position per slot."""
        tokens, group = spec.max_kv + 1, value_group(shape.head_dim, H2O_KVARN_VALUE_GROUP)
        return kvarn_layer_bytes(
            shape, tokens, spec.segments().sink, h2o_kvarn_tile(spec.max_kv),
            KVARN_PRESETS[spec.kvarn], group, bookkeeping=H2O_BOOKKEEPING * tokens,
        )  # fmt: skip

    @classmethod
    def check_head_dim(cls, spec: CacheSpec, head_dim: int) -> None:
        check_kvarn_head_dim(head_dim, H2O_KVARN_VALUE_GROUP)

    # ------------------------------------------------------------------ the contract

    def contents(self) -> LayerContents:
        return scored_contents(self, self.size())

    def trimmable_tokens(self) -> int:
        return 0 if self.evicted else super().trimmable_tokens()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        lead, n = keys.shape[:2], keys.shape[2]
        pos = mx.broadcast_to(self._next_positions(n), (*lead, n))
        if self.scores is None:
            self.scores, self.positions = mx.zeros((*lead, n), dtype=mx.float32), pos
        else:  # new slots score 0
            self.scores = mx.pad(self.scores, [(0, 0), (0, 0), (0, n)])
            self.positions = mx.concatenate([self.positions, pos], axis=-1)
        self.fused_decode = n == 1  # until the step ends: attend_decode or update_scores
        if n == 1 and self._store_joins():
            # The router's call rotates and writes it with the attention (store_and_attend);
            # until then this returns the buffers before it (cache/contract.py).
            self.pending_store = (keys, values)
            self.offset = self.offset + 1
            return self._fetch()
        return super().update_and_fetch(keys, values)

    def _store_joins(self) -> bool:
        """Whether a decode token's store waits for its attention call: a step owner's
        decode on the reference, into a tail it does not fill (a filled one is packed now)."""
        filled = self.n_front == self.sink and self.tiles is not None
        return filled and self.n_tail + 1 < self.tile and ATTENTION.stores_with_decode(self)

    def store_pending(self) -> tuple:
        keys, values = self.pending_store
        self.pending_store = None
        self._append_tail(rotate(keys), rotate(values))
        return self._fetch()

    def store_and_attend(
        self, queries: mx.array, scale: float, mask, attend: Callable, how: tuple
    ) -> mx.array:
        """The pending token rotated and written into the tail, the front, tiles and tail
        attended and the scores updated, in one compiled call (a trace per tail length, as
        `attend_decode`'s); then any eviction."""
        if mask is not None:  # (a decode query's is None) written first, attended apart
            parts = self.kv_segments(*self.store_pending())
            return self.attend_decode(queries, parts, scale, mask, attend, how)
        keys, values = self.pending_store
        self.pending_store = None
        layout = self.kv_segments(None, None)[0][2]
        rule, n_kv = self.score_rule, self.scores.shape[1]
        step = _decode_with_store(self.n_tail, layout, rule, n_kv, scale, attend, how)
        out, self.scores, self.tail = step(
            self.front, self.tiles, self.tail, keys, values, queries, self.scores
        )
        self.n_tail += 1
        self.fused_decode = False
        self.evict_if_full()
        return out

    def _next_positions(self, n: int) -> mx.array:
        """The positions of the next n tokens (a slab's rows: each its own,
        cache/batching/kvarn_slab.py)."""
        return mx.arange(self.offset, self.offset + n, dtype=mx.int32)

    def _seen_now(self) -> mx.array:
        """Tokens seen, this step's counted, as the eviction's rank takes them."""
        return mx.array(self.offset, dtype=mx.int32)

    def attend_decode(
        self, queries: mx.array, parts: list, scale: float, mask, attend: Callable, how: tuple,
        bias: mx.array | None = None,
    ) -> mx.array:  # fmt: skip
        """A decode's attention over the front, tiles and tail and its score update in one
        compiled call (cache/compiled_decode.py; a trace per tail length, replayed from one
        tile to the next), then any eviction."""
        rule, n_kv = self.score_rule, self.scores.shape[1]
        out, self.scores = attended_and_scored(
            queries, parts, scale, mask, attend, how, rule, n_kv, self.scores, [], [], 0, bias
        )
        self.fused_decode = False
        self.evict_if_full()
        return out

    def update_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate one attention call's logits [B, n_q_heads, L_q, size], then evict."""
        KVarNCache.update_scores(self, scores)  # checks the length
        self.fused_decode = False
        self.add_scores(scores, probs)
        self.evict_if_full()

    def add_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate logits over all stored keys (a block of a prompt chunk) without evicting."""
        n_kv = self.scores.shape[1]
        self.scores = self.score_rule.accumulate(self.scores, scores, n_kv, probs)

    def evict_if_full(self) -> None:
        if self.size() <= self.max_size:
            return
        if self.strategy == "tile":
            self._evict_tiles()
        elif self.size() == self.max_size + 1:  # a decode's: the same layout every time
            self._evict_tokens_compiled()
        else:
            self._evict_tokens()

    def trim(self, n: int) -> int:
        n = super().trim(n)
        self.scores, self.positions = (
            self.scores[..., : self.size()],
            self.positions[..., : self.size()],
        )
        return n

    def is_trimmable(self) -> bool:
        return self.evicted == 0

    @property
    def nbytes(self) -> int:
        book = 0 if self.scores is None else self.scores.nbytes + self.positions.nbytes
        return super().nbytes + book

    @property
    def state(self):
        return (*super().state[:4], self.scores, self.positions, self.meta_state[0])

    @state.setter
    def state(self, v) -> None:
        KVarNCache.state.fset(self, (*v[:4], v[6]))
        self.scores, self.positions = v[4], v[5]

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(self.rule_meta())  # its sink is KVarN's front pool, the same number
        meta.update(strategy=self.strategy, repack_sinkhorn_iters=self.repack_sinkhorn_iters)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        meta = json.loads(v[0])
        self.load_rule_meta(meta)
        kvarn_keys = ("key_bits", "value_bits", "tile", "sink", "sinkhorn_iters")
        kvarn_keys += ("value_group_size", "n_front", "n_tail", "offset")
        own = {k: meta[k] for k in kvarn_keys if k in meta}
        KVarNCache.meta_state.fset(self, (json.dumps(own),))
        self.strategy = meta["strategy"]
        self.repack_sinkhorn_iters = meta.get("repack_sinkhorn_iters", 0)

    # ------------------------------------------------------------------ in a slab

    def slab_key(self) -> Hashable | None:
        """Rows that hold as many tokens hold them in one layout, now and after every later
        decode step (cache/batching/kvarn_slab.py): the key holds the size. Whole-tile eviction
        drops
        as many tiles as each row's candidates allow, so its rows would part: it stays alone."""
        if self.strategy != "requantize" or self.scores is None:
            return None
        rule = (self.max_size, self.sink, self.heavy, self.recent, self.evict_batch)
        packing = (self.fmt, self.sinkhorn_iters, self.repack_sinkhorn_iters)
        front = self.front[0]
        shape = (front.dtype, front.shape[1], front.shape[3])
        return (H2OKVarNCache.__name__, *rule, self.score_rule, *packing, shape, self.size())

    # ------------------------------------------------------------------ eviction

    def _evict_tokens(self) -> None:
        """Keep dense H2O's slots; re-pack only the tiles that lost tokens."""
        size, keep, F, t = (
            self.size(),
            self.max_size + 1 - self.evict_batch,
            self.n_front,
            self.tile,
        )
        n = self.n_tiles()
        top, _ = self.split(self.rank_middle(self.scores, self.positions, self.offset))
        kept = mx.put_along_axis(
            mx.zeros(self.scores.shape, mx.bool_), top, mx.array(True), axis=-1
        )
        slot = mx.arange(size)
        tile_of = mx.clip((slot - F) // t, 0, max(n - 1, 0))
        in_tiles = (slot >= F) & (slot < F + n * t)
        intact = kept[..., F : F + n * t].reshape(*kept.shape[:2], n, t).all(-1)  # [B, H, n]
        intact_slot = (
            (mx.take(intact, tile_of, axis=-1) & in_tiles) if n else mx.zeros_like(in_tiles)
        )
        # front, intact tiles, damaged tiles' survivors, tail; evicted slots last
        group = mx.where(slot < F, 0, mx.where(intact_slot, 1, mx.where(in_tiles, 2, 3)))
        order = mx.argsort(mx.where(kept, group * size + slot, 4 * size + slot), axis=-1)[
            ..., :keep
        ]
        self.scores = mx.take_along_axis(self.scores, order, axis=-1)
        self.positions = mx.take_along_axis(self.positions, order, axis=-1)
        self._rebuild(order, intact)

    def _evict_tokens_compiled(self) -> None:
        """`_evict_tokens` as one compiled call (`offset` its input): a decode meets the same
        layout at every eviction (the tail's length is the same modulo a tile), so one
        trace per configuration serves them all, where the host would build ~400 ops per
        layer one by one (the ranking, the damaged tiles' dequantization and re-packing)."""
        rule = json.dumps(self.rule_meta() | {"evicted": 0}, sort_keys=True)
        key = (type(self), rule, self.fmt, self.n_front, self.n_tail, self.repack_sinkhorn_iters)
        if key not in _EVICTIONS:
            _EVICTIONS[key] = compiled_on_template(
                self, H2OKVarNCache._evict_tokens, ("tiles", "tail", "scores", "positions")
            )
        buffers = {name: getattr(self, name) for name in ("front", "tiles", "tail")}
        buffers.update(scores=self.scores, positions=self.positions)
        size = self.size()
        self.__dict__.update(_EVICTIONS[key](buffers, {"offset": self._seen_now()}))
        self.evicted += size - self.keep
        self.n_tail = (self.keep - self.n_front) % self.tile  # as _rebuild leaves it

    def _rebuild(self, order: mx.array, intact: mx.array) -> None:
        """Lay the kept slots (`order`, into the old slots) out as [front | tiles | tail]."""
        F, t, n, fmt = self.n_front, self.tile, self.n_tiles(), self.fmt
        dense = [self._dense_slots(parts, order)[:, :, F:] for parts in self._fetch()]
        n_new = dense[0].shape[2] // t
        old, self.tiles = self.tiles, None
        if n_new:
            B, H, _, D = dense[0].shape
            # Every new tile is encoded, and each head keeps its intact old tiles over the
            # fresh ones: skipping tiles intact in every head needed their count on the host,
            # a sync per layer that stalls a pipelined (or GPU) decode at every eviction.
            shape = (B, H, n_new, t, D)
            k_new, v_new = (x[:, :, : n_new * t].reshape(shape) for x in dense)
            fresh = encode_tiles(k_new, v_new, fmt, self.repack_sinkhorn_iters)
            if n:
                # New tile j is the head's j-th intact old tile while j < its intact count.
                ids = mx.argsort(mx.where(intact, 0, n) + mx.arange(n), axis=-1)
                ids = mx.take(ids, mx.minimum(mx.arange(n_new), n - 1), axis=-1)
                use_old = mx.arange(n_new) < intact.sum(-1)[..., None]
                self.tiles = [
                    [_pick(o, f, ids, use_old) for o, f in zip(olds, news, strict=True)]
                    for olds, news in zip(old, fresh, strict=True)
                ]
            else:
                self.tiles = fresh
        self.n_tail = 0
        self._set_tail(dense[0][:, :, n_new * t :], dense[1][:, :, n_new * t :])

    def _dense_slots(self, parts: list, order: mx.array) -> mx.array:
        """[front, tiles, tail] as one dense float32 [B, H, size, D], gathered at `order`."""
        front, tiles, tail = parts
        seq = [] if front is None else [front]  # None: no sinks (sink=0)
        if tiles is not None:
            dequantize = dequantize_keys if tiles is self.tiles[0] else dequantize_values
            x = dequantize(tiles, self.fmt)  # [B, H, n, tile, D]
            seq.append(x.reshape(*x.shape[:2], -1, x.shape[-1]))
        if tail is not None:
            seq.append(tail)
        whole = mx.concatenate([x.astype(mx.float32) for x in seq], axis=2)
        return mx.take_along_axis(whole, order[..., None], axis=2)

    def _evict_tiles(self) -> None:
        """Drop whole tiles outside the recent window, lowest summed score first."""
        size, keep, F, t, n = (
            self.size(),
            self.max_size + 1 - self.evict_batch,
            self.n_front,
            self.tile,
            self.n_tiles(),
        )
        if n == 0:
            return
        tile_pos = self.positions[..., F : F + n * t].reshape(*self.positions.shape[:2], n, t)
        tile_score = self.scores[..., F : F + n * t].reshape(tile_pos.shape).sum(-1)
        candidate = tile_pos.max(-1) < self.offset - self.recent
        n_cand = int(candidate.sum(-1).min().item())
        drop = min(n_cand, -(-(size - keep) // t))
        if drop == 0:
            return
        ranked = mx.where(candidate, tile_score, mx.inf)
        kept_tiles = (
            mx.sort(mx.argpartition(-ranked, kth=n - drop - 1, axis=-1)[..., : n - drop], axis=-1)
            if n > drop
            else None
        )
        slot_ids = [mx.broadcast_to(mx.arange(F), (*ranked.shape[:2], F))]
        if kept_tiles is not None:
            slot_ids.append(
                (F + kept_tiles[..., None] * t + mx.arange(t)).reshape(*ranked.shape[:2], -1)
            )
        slot_ids.append(
            mx.broadcast_to(mx.arange(F + n * t, size), (*ranked.shape[:2], size - F - n * t))
        )
        order = mx.concatenate(slot_ids, axis=-1)
        self.scores = mx.take_along_axis(self.scores, order, axis=-1)
        self.positions = mx.take_along_axis(self.positions, order, axis=-1)
        self.evicted += drop * t
        if kept_tiles is None:
            self.tiles = None
        else:
            self.tiles = [
                [
                    mx.take_along_axis(
                        a, kept_tiles.reshape(*kept_tiles.shape, *([1] * (a.ndim - 3))), axis=2
                    )
                    for a in side
                ]
                for side in self.tiles
            ]


_EVICTIONS: dict[tuple, Callable] = {}  # compiled decode evictions by configuration and layout


@functools.cache
def _decode_with_store(
    n_tail: int, layout, rule, n_kv: int, scale: float, attend: Callable, how: tuple
) -> Callable:
    """(front, tiles, tail, keys, values, queries, scores) -> (out, scores, tail): the new
    token rotated into tail slot `n_tail`, then `attend_then_score` over the front, the
    tiles and the tail's first n_tail + 1 tokens."""

    def step(front, tiles, tail, keys, values, queries, scores) -> tuple:
        at = mx.array([n_tail])
        new = zip(tail, (keys, values), strict=True)
        tail = [mx.slice_update(b, rotate(x), at, (2,)) for b, x in new]
        read = [[f, t, b[:, :, : n_tail + 1]] for f, t, b in zip(front, tiles, tail, strict=True)]
        out, scores = attend_then_score(
            attend, (layout,), rule, n_kv, scale, 0, queries, [tuple(read)], None, scores, [], [],
            [],
        )  # fmt: skip
        return out, scores, tail

    return mx.compile(step)


def _pick(old: mx.array, fresh: mx.array, ids: mx.array, use_old: mx.array) -> mx.array:
    """Tile array: old tiles `ids` [B, H, n_new] where `use_old`, else the re-packed `fresh`."""
    trailing = (1,) * (old.ndim - 3)
    reused = mx.take_along_axis(old, ids.reshape(*ids.shape, *trailing), axis=2)
    return mx.where(use_old.reshape(*fresh.shape[:3], *trailing), reused, fresh)
