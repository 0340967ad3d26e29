"""MergingH2OKVCache: H2O that folds each evicted token into its most similar kept one.

At 8-16x compression eviction throws away most of a conversation, and H2O's gain over a
sliding window fades (docs/rules.md). Here an evicted token is not dropped: it is merged
into the kept middle slot of its head (not a sink, not the recent window) whose key is
closest in direction (cosine). The slot's value becomes the weighted mean of what it
stands for, its key the weighted mean direction at the weighted mean length, and its
count grows. Each side weighs its rank under the score rule (attention per query, under
`mean`; a merged slot's rank already covers its tokens): in the attention these tokens
would have had, the one that draws more dominates the output, and a mean over counts
pulled kept slots towards the less-attended tokens folded into them (held-out essays,
max_kv 128, profiled layers: 16x from 0.40 to 0.26 of a sliding window's increase;
docs/performance.md). Attention adds log(count) to a slot's logit (`logit_bias`, which the router
hands to the kernel), so a slot standing for c alike tokens gets about the attention
those c tokens would have had (ToMe's proportional attention; CaM and D2O merge evicted
K/V in this spirit). Without that bias merging is worse than dropping: a merged slot
would get one token's share for many tokens' content.

Who leaves is ranked by what merging would lose: a middle token's rank under the score
rule (as H2O's) times its distance (1 - cosine) to the nearest middle key ranked at
least as high. A token that a more important slot already repeats costs little to fold
into it, so it goes before a distinct token ranked a little higher; of two alike tokens
the lower-ranked leaves, never both for repeating each other. Sinks and the recent window
stay protected, and stay out of the comparison: its cosines are [middle x middle]
(leaver candidates among the lowest ranks only measured worse: docs/rules.md). On
held-out essays (max_kv 128, profiled layers) this took 16x from 0.45 to about 0.40 of
a sliding window's increase (docs/performance.md). The counts are one more float32 per slot, kept in
step with the slots by every gather, and saved with the cache.
"""

from __future__ import annotations

import mlx.core as mx

from cache.budget import MERGING_BOOKKEEPING
from cache.policies.h2o import H2OKVCache, gather_slots


class MergingH2OKVCache(H2OKVCache):
    slot_extra_bytes = MERGING_BOOKKEEPING  # the count
    # A decode at the buffers' final size reads every slot, the counts' log beside them,
    # so its graph repeats from step to step (a slab does not hold the counts).
    fixed_decode = True
    # A decode's merge is one compiled call (its shapes repeat from one eviction to the
    # next): its ranking, [middle x middle] key cosines, picks and scatter-add are ~230 ops
    # a layer that the host would otherwise build, and a GPU launch, one by one.
    compiles_eviction = True
    # Merging happens at eviction only, which a draft's pass defers to `settle_draft`;
    # a refused token's slot gets back count 1 when it is freed (`reset_free_slots`).
    verifies_drafts = True

    def __init__(self, max_size: int, **h2o):
        """`h2o`: H2OKVCache's knobs (sink, heavy, recent, score, evict_batch)."""
        super().__init__(max_size, **h2o)
        self.counts = None  # float32 [B, H, capacity]: tokens each slot stands for (>= 1)

    def logit_bias(self) -> mx.array:
        """log(count) per slot attention reads, [B, H, slots]: the held ones, or every slot
        in a decode that reads them all (`fused_decode`; a free slot's count is 1, masked)."""
        return mx.log(self.counts if self.fused_decode else self.counts[..., : self.used])

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.counts is None else self.counts.nbytes)

    @property
    def state(self):
        *rest, meta = super().state
        counts = None if self.counts is None else self.counts[..., : self.used]
        return (*rest, counts, meta)

    @state.setter
    def state(self, v) -> None:
        *rest, self.counts, meta = v
        H2OKVCache.state.fset(self, (*rest, meta))

    # ------------------------------------------------------------------ internals

    def eviction_ranks(self, pos: mx.array) -> mx.array:
        """H2O's ranks, each middle one times the distance to the nearest middle key ranked
        at least as high (a tie goes to the lower slot index): what merging it would lose.

        Only middle keys are compared: the n - sink - recent lowest ranks, which are every
        middle slot while the recent window holds all its tokens, so the cosines are
        [middle x middle], not [slots x slots] (sinks and the recent window, half the
        slots, never leave). After a trim has left holes in the recent window, its few
        highest middle ranks sit this eviction out, as sinks do, and the others seek
        their nearest higher-ranked key without them."""
        ranks = super().eviction_ranks(pos)
        n = pos.shape[-1]
        m = n - self.sink - self.recent
        mid = mx.argpartition(ranks, kth=m - 1, axis=-1)[..., :m]  # [B, H, M]: slots
        mine = mx.take_along_axis(ranks, mid, axis=-1)
        keys = mx.take_along_axis(self.keys[:, :, :n], mid[..., None], axis=2)
        unit = _unit(keys.astype(mx.float32))
        similarity = unit @ unit.swapaxes(-1, -2)  # [B, H, M, M]
        me, them = mine[..., :, None], mine[..., None, :]
        higher = (them > me) | ((them == me) & (mid[..., None, :] < mid[..., :, None]))
        middle = self.in_middle(mx.take_along_axis(pos, mid, axis=-1), self.seen)
        nearest = mx.where(middle[..., None, :] & higher, similarity, -mx.inf).max(axis=-1)
        # The top-ranked slot has no one above it (-inf): the largest distance, 2.
        distance = mx.clip(1.0 - nearest, 1e-3, 2.0)
        worth = mx.where(middle, mine * distance, mx.inf)
        return mx.put_along_axis(mx.full(ranks.shape, mx.inf), mid, worth, axis=-1)

    def _grow(self, keys, values, needed: int) -> None:
        counts = self.counts
        super()._grow(keys, values, needed)
        self.counts = self._grown(
            counts, self.positions.shape[:2], (), mx.float32, self.positions.shape[-1]
        )
        self.reset_free_slots()

    def reset_free_slots(self) -> None:
        super().reset_free_slots()
        if self.counts is not None and self.used < self.counts.shape[-1]:
            self.counts[..., self.used :] = 1.0

    def eviction_buffers(self) -> tuple[str, ...]:
        return (*super().eviction_buffers(), "counts")

    def _gather(self, idx: mx.array, capacity: int) -> None:
        self.counts = gather_slots(self.counts[:, :, : self.used], idx, capacity)
        super()._gather(idx, capacity)

    def _evict_ops(self) -> None:
        """The lowest-worth middle tokens leave, folded into their nearest kept slot."""
        n = self.used
        # What a slot weighs in a merge: the attention it draws per query (the rule's rank;
        # a merged slot's already counts its tokens', through its log(count) bias). Kept
        # above 0 so that a merge never divides by 0.
        rank = self.rule_rank(self.scores[..., :n], self.positions[..., :n], self.seen)
        weight = mx.maximum(rank, 1e-9)
        kept, gone = self._eviction_split()
        keep = kept.shape[-1]

        def pick(buf: mx.array, slots: mx.array) -> mx.array:
            return mx.take_along_axis(buf[:, :, :n], slots[..., None], axis=2)

        gone_k, gone_v = pick(self.keys, gone), pick(self.values, gone)
        gone_c, gone_w = pick(self.counts[..., None], gone), pick(weight[..., None], gone)
        kept_w = pick(weight[..., None], kept)
        self._gather(kept, capacity=self.max_size + 1)

        # Nearest kept middle slot by key direction. Sinks stay pure (they anchor
        # attention) and so does the recent window: trimming it (an edited reply) then
        # drops only its own tokens, and it measured no worse as a destination.
        kept_k, kept_v = self.keys[:, :, :keep], self.values[:, :, :keep]
        similarity = _unit(gone_k) @ _unit(kept_k).swapaxes(-1, -2)  # [B, H, gone, keep]
        kept_pos = self.positions[:, :, None, :keep]
        open_slot = self.in_middle(kept_pos, self.seen)
        into = mx.argmax(mx.where(open_slot, similarity, -mx.inf), axis=-1)  # [B, H, gone]
        # A head with no middle slot kept (heavy 0) drops its leavers, as plain H2O does.
        merged = open_slot.any(axis=-1)[..., None]
        gone_c, gone_w = mx.where(merged, gone_c, 0.0), mx.where(merged, gone_w, 0.0)

        # Sums of [count, weight, weighted key, weighted key length, weighted value] into
        # the kept slots: one flat scatter-add for all five.
        B, H, n_gone = into.shape
        D = gone_k.shape[-1]
        flat = (mx.arange(B * H)[:, None] * keep + into.reshape(B * H, n_gone)).reshape(-1)
        parts = [gone_c, gone_w, gone_w * gone_k, gone_w * _length(gone_k), gone_w * gone_v]
        gone_x = mx.concatenate(parts, axis=-1)
        width = gone_x.shape[-1]
        added = mx.zeros((B * H * keep, width), dtype=mx.float32)
        added = added.at[flat].add(gone_x.reshape(-1, width))
        add_c, add_w, add_k, add_len, add_v = mx.split(
            added.reshape(B, H, keep, width), [1, 2, D + 2, D + 3], axis=-1
        )
        total = kept_w + add_w

        # A key takes the weighted mean direction at the weighted mean length: a plain mean
        # of keys that point apart is shorter, and would cool the logits of every merged slot.
        key = (kept_w * kept_k + add_k) / total
        length = (kept_w * _length(kept_k) + add_len) / total
        key = key * length / mx.maximum(_length(key), 1e-12)
        self.keys[:, :, :keep] = key.astype(self.keys.dtype)
        self.values[:, :, :keep] = ((kept_w * kept_v + add_v) / total).astype(self.values.dtype)
        self.counts[:, :, :keep] += add_c[..., 0]


def _length(x: mx.array) -> mx.array:
    return mx.sqrt((x * x).sum(-1, keepdims=True))


def _unit(x: mx.array) -> mx.array:
    return x / mx.maximum(_length(x), 1e-12)
