"""AdaptiveH2OKVCache: the KV heads of a layer share one pool of slots (AdaKV).

H2OKVCache gives every KV head the same share (sink + heavy + recent slots).
AdaKV (Feng et al. 2024) keeps the best middle tokens of a layer over all its
heads instead, so a head whose attention is concentrated gives slots to one
whose attention is spread. Per-head buffers would need padding to hold
different counts, which costs the memory AdaKV saves; this cache stores one
pool per layer instead: K/V [B, 1, slots, D] with each slot's KV head beside
its position and score, H x (max_size + 1) slots, the bytes of H2OKVCache plus
one byte per slot for the head id.

Attention runs over the pool as if it were one KV head, with a mask
(`attention_mask`, passed in by the router) that shows each query head its own
KV head's slots, in causal order inside a chunk. A slot's score then carries
only its own head's attention, so every score rule works unchanged. Each query
head takes dot products with every slot of the pool (H times the arithmetic of
per-head buffers; decode still reads each key and value once).

Eviction keeps sinks and the recent window of every head; the middle slots of
all heads compete in one top-k, except that each head keeps its best
`floor` x heavy (AdaKV's safeguard), so no head is starved.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from cache.budget import ADAPTIVE_BOOKKEEPING
from cache.contents import LayerContents, scored_contents
from cache.policies.h2o import H2OKVCache, gather_slots

DEFAULT_FLOOR = 0.2  # of a head's uniform heavy share it always keeps


class AdaptiveH2OKVCache(H2OKVCache):
    slot_extra_bytes = ADAPTIVE_BOOKKEEPING  # the head id
    # A verify pass's tokens are reordered as decode steps store them (`_keep_drafted`).
    verifies_drafts = True

    def __init__(self, max_size: int, *, floor: float = DEFAULT_FLOOR, **h2o):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, evict_batch)."""
        super().__init__(max_size, **h2o)
        if not 0 <= floor <= 1:
            raise ValueError(f"floor must lie in [0, 1], got {floor}")
        self.floor = floor
        self.n_heads = 0
        self.heads = None  # uint8 [B, 1, capacity]: the KV head each slot belongs to

    def ranking_kv(self, n: int) -> tuple[mx.array, mx.array] | None:
        """The pool's K/V [B, 1, n, D], for a rule that ranks each slot by its own key and
        value (`kv_per_slot`); one that reads the held ones together (`value`'s mean of a
        head's values) ranks without them, as the heads share one slot axis."""
        if not self.score_rule.kv_per_slot:
            return None
        return self.keys[:, :, :n], self.values[:, :, :n]

    def rule_rank(self, scores: mx.array, pos: mx.array, seen) -> mx.array:
        """[B, 1, n]: a per-head rule reading the pool ranks every slot under each KV
        head's knobs ([B, H, n]); a slot keeps its own head's rank."""
        ranked = super().rule_rank(scores, pos, seen)
        if ranked.shape[1] == 1:
            return ranked
        heads = self.heads[..., : scores.shape[-1]].astype(mx.int32)
        return mx.take_along_axis(ranked, heads, axis=1)

    @property
    def _slots_per_token(self) -> int:
        return max(1, self.n_heads)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store N new tokens of every head [B, H, N, D] in the pool; return the pool."""
        self._check_scored()
        B, H, N, _ = keys.shape
        self.n_heads = H
        flat_k, flat_v = (x.reshape(B, 1, H * N, x.shape[-1]) for x in (keys, values))
        start, end = self.used, self.used + H * N
        if self.positions is None or end > self.positions.shape[-1]:
            self._grow(flat_k, flat_v, end)
            self.heads = self._grown(self.heads, (B, 1), (), mx.uint8, self.positions.shape[-1])
        self.keys[:, :, start:end] = flat_k
        self.values[:, :, start:end] = flat_v
        # Head-major, as the reshape laid them out: head h's N tokens, then h + 1's.
        self.positions[:, :, start:end] = mx.tile(
            mx.arange(self.offset, self.offset + N, dtype=mx.int32), H
        )
        self.heads[:, :, start:end] = mx.repeat(mx.arange(H, dtype=mx.uint8), N)
        self.scores[:, :, start:end] = 0.0
        self.used = end
        self.offset += N
        return self._fetch()

    def _keep_drafted(self, fed: int, kept: int) -> mx.array:
        """A verify pass stored its tokens head-major (every head's `fed`, head by head):
        the kept ones move token-major, as decode steps lay them out, and the refused go."""
        H, n = self.n_heads, self.used
        start = n - H * fed
        slot = start + np.arange(fed)[None, :] + fed * np.arange(H)[:, None]  # [head, token]
        order = np.concatenate([np.arange(start), slot[:, :kept].T.reshape(-1)])
        idx = mx.array(order, dtype=mx.int32)
        for name in ("keys", "values", "positions", "heads", "scores"):
            buf = getattr(self, name)
            buf[:, :, : idx.size] = mx.take(buf[:, :, :n], idx, axis=2)
        self.used = idx.size
        self.offset -= fed - kept
        self.reset_free_slots()
        return idx

    def attention_mask(self, n_q_heads: int, n_new: int, mask=None) -> mx.array:
        """[B, n_q_heads, n_new, slots]: a query head sees its KV head's slots, causally."""
        n = self.used
        group = mx.arange(n_q_heads) // (n_q_heads // self.n_heads)
        visible = self.heads[:, :, None, :n] == group[None, :, None, None].astype(mx.uint8)
        if n_new == 1:
            return visible
        query_pos = mx.arange(self.offset - n_new, self.offset, dtype=mx.int32)
        return visible & (self.positions[:, :, None, :n] <= query_pos[None, None, :, None])

    def contents(self) -> LayerContents:
        """Each KV head's slots of the pool (heads hold different counts)."""
        n = self.used
        if self.positions is None or n == 0:
            return scored_contents(self, 0)
        heads, pos, score = (
            np.array(a[0, 0, :n]) for a in (self.heads, self.positions, self.scores)
        )
        per_head = [heads == h for h in range(self.n_heads)]
        return scored_contents(self, 0, [pos[m] for m in per_head], [score[m] for m in per_head])

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.heads is None else self.heads.nbytes)

    def trimmable_tokens(self) -> int:
        if self.positions is None:
            return 0
        n = self.used
        mine = self.heads[..., :n] == mx.arange(self.n_heads, dtype=mx.uint8)[:, None]
        held = mx.sort(mx.where(mine, self.positions[..., :n], -(2**30)), axis=-1)  # [B, H, n]
        in_order = held == mx.arange(self.offset - n, self.offset, dtype=mx.int32)
        return int(in_order.sum(axis=-1).min().item())

    @property
    def state(self):
        if self.positions is None:
            return None, None, None, None, None, self.meta_state[0]
        n = self.used
        kv = self._kv_state()
        return (*kv, self.scores[..., :n], self.positions[..., :n], self.heads[..., :n],
                self.meta_state[0])  # fmt: skip

    @state.setter
    def state(self, v) -> None:
        *rest, self.heads, meta = v
        H2OKVCache.state.fset(self, (*rest, meta))

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(floor=self.floor, n_heads=self.n_heads)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        H2OKVCache.meta_state.fset(self, v)
        meta = json.loads(v[0])
        self.floor, self.n_heads = meta["floor"], meta["n_heads"]

    def _gather(self, idx: mx.array, capacity: int) -> None:
        self.heads = gather_slots(self.heads[:, :, : self.used], idx, capacity)
        super()._gather(idx, capacity)

    def reset_free_slots(self) -> None:
        """Appending writes positions and head ids itself; free slots only need score 0."""
        if self.used < self.scores.shape[-1]:
            self.scores[..., self.used :] = 0.0

    def _evict(self) -> None:
        """Keep every head's sinks and recent window, then the pool's best middle slots."""
        H, n = self.n_heads, self.used
        keep = H * (self.max_size + 1 - self.evict_batch)
        pos, heads = self.positions[..., :n], self.heads[..., :n]
        middle = self.in_middle(pos, self.seen)
        value = self.rule_rank(self.scores[..., :n], pos, self.seen)
        guard = int(self.floor * self.heavy)
        if guard:
            value = mx.where(self._best_of_each_head(value, heads, middle, guard), mx.inf, value)
        ranked = mx.where(middle, value, mx.inf)
        top = mx.argpartition(-ranked, kth=keep - 1, axis=-1)[..., :keep]
        self.evicted += (n - keep) // H
        self._gather(top, capacity=H * (self.max_size + 1))

    def _best_of_each_head(self, value, heads, middle, k: int) -> mx.array:
        """Each head's k best middle slots (ties may add a few)."""
        best = mx.zeros(value.shape, dtype=mx.bool_)
        for h in range(self.n_heads):
            mine = middle & (heads == h)
            candidates = mx.where(mine, value, -mx.inf)
            kth = -mx.partition(-candidates, kth=k - 1, axis=-1)[..., k - 1 : k]
            best = best | (mine & (candidates >= kth))
        return best
