"""The H2O rule every evicting cache shares: its segments, its score rule, what stays.

Dense, packed, merging, recall, pooled and windowed H2O caches (cache/policies/h2o.py and its
subclasses) and KVarN-packed H2O (cache/policies/h2o_kvarn.py) differ in how they store K/V and
how they move it when tokens leave. Which tokens leave is decided here, for all of them:
the sinks and the recent window always stay, middle tokens rank by the score rule, and
an eviction keeps max_size + 1 - evict_batch of them (the next evict_batch - 1 tokens
then only append).
"""

from __future__ import annotations

import mlx.core as mx

from cache.scores import ScoreRule, make_score_rule
from config.cache_spec import DEFAULT_SCORE, CacheSpec, default_evict_batch, split_segments


def segment_knobs(spec: CacheSpec) -> dict:
    """An H2O cache's constructor knobs from a spec: its segments, rule and evict batch."""
    seg = spec.segments()
    return dict(
        sink=seg.sink, heavy=seg.heavy, recent=seg.recent, score=spec.score,
        evict_batch=spec.evict_batch,
    )  # fmt: skip


class HeavyHitters:
    """Mixin of an evicting cache: `max_size`, its segments, `evict_batch`, `score_rule`,
    and `evicted` (tokens evicted per head)."""

    def set_rule(
        self,
        max_size: int,
        sink: int | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        score: str | ScoreRule = DEFAULT_SCORE,
        evict_batch: int | None = None,
        default_batch: int | None = None,
    ) -> None:
        """`default_batch`: the evict batch when none is given (None: default_evict_batch)."""
        seg = split_segments(max_size, sink=sink, heavy=heavy, recent=recent)
        self.max_size, self.sink, self.heavy, self.recent = (
            seg.max_size, seg.sink, seg.heavy, seg.recent,
        )  # fmt: skip
        if evict_batch is None:
            evict_batch = default_batch or default_evict_batch(self.max_size, self.heavy)
        if not 1 <= evict_batch <= max(1, self.heavy):
            raise ValueError(
                f"evict_batch must be between 1 and the heavy budget ({self.heavy}), "
                f"got {evict_batch}"
            )
        self.evict_batch = evict_batch
        self.score_rule = make_score_rule(score) if isinstance(score, str) else score
        self.evicted = 0

    @property
    def keep(self) -> int:
        """Tokens per head an eviction keeps."""
        return self.max_size + 1 - self.evict_batch

    def in_middle(self, pos: mx.array, seen) -> mx.array:
        """Which of these positions are neither sinks nor in the recent window, with `seen`
        tokens seen (an int, or per row [rows, 1, 1] in a slab)."""
        return (pos >= self.sink) & (pos < seen - self.recent)

    def rank_middle(self, scores: mx.array, pos: mx.array, seen) -> mx.array:
        """What eviction keeps the top of: middle tokens by the rule, sinks and recent +inf."""
        return mx.where(self.in_middle(pos, seen), self.rule_rank(scores, pos, seen), mx.inf)

    def rule_rank(self, scores: mx.array, pos: mx.array, seen) -> mx.array:
        """The rule's rank of the first n held slots (n: `scores`' last axis), with their
        keys and values when the rule reads them (`ranking_kv`)."""
        kv = self.ranking_kv(scores.shape[-1]) if self.score_rule.reads_kv else None
        return self.score_rule.rank(scores, pos, seen, kv)

    def ranking_kv(self, n: int) -> tuple[mx.array, mx.array] | None:
        """Dense (keys, values) [B, H, n, D] of the first n slots, for a rule that reads
        them; None: this layout cannot hand them over (the rule ranks without)."""
        return None

    def split(self, ranked: mx.array) -> tuple[mx.array, mx.array]:
        """(slots kept, slots leaving) [B, H, *] of `ranked` [B, H, held]; the leavers
        are counted as evicted."""
        order = mx.argpartition(-ranked, kth=self.keep - 1, axis=-1)
        self.evicted += ranked.shape[-1] - self.keep
        return order[..., : self.keep], order[..., self.keep :]

    def rule_meta(self) -> dict:
        """The rule's part of a cache's meta_state."""
        return {
            "max_size": self.max_size,
            "sink": self.sink,
            "heavy": self.heavy,
            "recent": self.recent,
            "score": self.score_rule.name,
            "score_knobs": self.score_rule.knobs(),
            "evict_batch": self.evict_batch,
            "evicted": self.evicted,
        }

    def load_rule_meta(self, meta: dict) -> None:
        self.max_size, self.sink, self.heavy, self.recent = (
            meta["max_size"], meta["sink"], meta["heavy"], meta["recent"],
        )  # fmt: skip
        self.score_rule = make_score_rule(meta["score"], **meta.get("score_knobs", {}))
        self.evict_batch = meta.get("evict_batch", 1)
        self.evicted = meta.get("evicted", 0)
