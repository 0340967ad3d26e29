"""H2OKVCache eviction against a brute-force oracle, on random scores.

The oracle keeps, per KV head, a plain dict {position: accumulated score}
and applies H2O literally: add every key's share of attention, then while
over budget drop the lowest-scored token that is neither a sink nor in the
recent window (by full sort), down to max_size + 1 - evict_batch tokens.
The cache must keep exactly the oracle's positions at every step.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import cache  # noqa: F401  (registers the class with mlx-lm)
from cache import H2OKVCache, QuantizedH2OKVCache
from cache.policies.merging import MergingH2OKVCache
from cache.scores import make_score_rule
from config.cache_spec import split_segments

B, N_Q, N_KV, D = 1, 6, 2, 8
ALPHA = 0.95


class Oracle:
    def __init__(self, max_size: int, sink: int, recent: int, rule: str, evict_batch: int = 1):
        self.max_size, self.sink, self.recent, self.rule = max_size, sink, recent, rule
        self.evict_batch = evict_batch
        self.kept = [dict() for _ in range(N_KV)]  # per KV head: position -> score
        self.offset = 0

    def step(self, logit_table: np.ndarray, n_new: int) -> None:
        """logit_table[q_head, row, position]: logits of this call's query rows."""
        new = range(self.offset, self.offset + n_new)
        for kept in self.kept:
            kept.update({p: 0.0 for p in new})
        self.offset += n_new
        group = N_Q // N_KV
        for h, kept in enumerate(self.kept):
            positions = np.array(sorted(kept))
            increment = np.zeros(len(positions))
            for q in range(h * group, (h + 1) * group):
                rows = np.zeros(len(positions))
                decay = 1.0
                for r in range(n_new):
                    if self.rule == "tova" and r < n_new - 1:
                        continue  # TOVA: the newest query row only
                    query_pos = self.offset - n_new + r
                    logits = logit_table[q, r, positions].astype(np.float64)
                    visible = positions <= query_pos
                    if self.rule in ("attn", "mean", "tova"):
                        e = np.where(visible, np.exp(logits - logits[visible].max()), 0.0)
                        rows += e / e.sum()
                    else:
                        w = (1 - ALPHA) * ALPHA ** (n_new - 1 - r)
                        rows += w * np.where(visible, np.abs(logits), 0.0)
                increment += rows / group
            if self.rule == "ema":
                decay = ALPHA**n_new
            if self.rule == "tova":
                decay = 0.0  # the newest query's attention replaces the held one
            for p, inc in zip(positions, increment, strict=True):
                kept[p] = decay * kept[p] + inc
            self._evict(kept)

    def _evict(self, kept: dict) -> None:
        if len(kept) <= self.max_size:
            return
        excess = len(kept) - (self.max_size + 1 - self.evict_batch)
        middle = [p for p in kept if self.sink <= p < self.offset - self.recent]
        # mean: per query that has seen the key (offset - p of them, by causality)
        norm = (lambda p: self.offset - p) if self.rule == "mean" else (lambda p: 1.0)
        rank = {p: kept[p] / norm(p) for p in kept}
        middle.sort(key=lambda p: rank[p])
        for p in middle[:excess]:
            del kept[p]


def cache_positions_of(c: H2OKVCache) -> list[set]:
    pos = np.array(c.positions[0, :, : c.used])
    return [set(pos[h].tolist()) for h in range(pos.shape[0])]


def cache_positions(c: H2OKVCache) -> list[set]:
    """The set of token positions each KV head holds."""
    pos = np.array(c.positions[0, :, : c.used])
    return [set(pos[h].tolist()) for h in range(N_KV)]


def feed(c: H2OKVCache, oracle: Oracle, rng: np.random.Generator, n_new: int) -> int:
    """One attention call of n_new tokens with random logits. Returns the size inside the call."""
    k = mx.array(rng.standard_normal((B, N_KV, n_new, D)).astype(np.float32))
    c.update_and_fetch(k, k)
    inside = c.size()
    table = rng.standard_normal((N_Q, n_new, oracle.offset + n_new)).astype(np.float32) * 3
    # Scores as the kernel exports them: per slot, by the position the slot holds,
    # masked (-inf) where the query may not see the key.
    slot_pos = np.array(c.positions[0, :, : c.used])  # [N_KV, S]
    group = N_Q // N_KV
    scores = np.empty((B, N_Q, n_new, c.used), np.float32)
    for q in range(N_Q):
        pos = slot_pos[q // group]
        for r in range(n_new):
            query_pos = oracle.offset + r
            scores[0, q, r] = np.where(pos <= query_pos, table[q, r, pos], -np.inf)
    c.update_scores(mx.array(scores))
    oracle.step(table, n_new)
    return inside


@pytest.mark.parametrize("rule", ["attn", "ema", "mean", "tova"])
@pytest.mark.parametrize("preset", ["heavy", "balanced", "lean"])
@pytest.mark.parametrize("evict_batch", [1, 4])
def test_decode_eviction_matches_oracle(rule, preset, evict_batch):
    rng = np.random.default_rng(0)
    budget = split_segments(24, preset)
    c = H2OKVCache(24, budget.sink, budget.heavy, budget.recent, rule, evict_batch=evict_batch)
    oracle = Oracle(24, budget.sink, budget.recent, rule, evict_batch)
    feed(c, oracle, rng, 10)  # short prefill
    for step in range(120):
        feed(c, oracle, rng, 1)
        assert c.size() <= 24
        assert c.offset == oracle.offset
        held = cache_positions(c)
        assert held == [set(k) for k in oracle.kept], f"step {step}"
        for h in range(N_KV):
            assert set(range(budget.sink)) <= held[h]
            assert set(range(max(0, c.offset - budget.recent), c.offset)) <= held[h]
    assert c.evicted == oracle.offset - c.size()


@pytest.mark.parametrize("rule", ["attn", "ema", "mean", "tova"])
@pytest.mark.parametrize("evict_batch", [1, 3])
def test_chunked_prefill_eviction_matches_oracle(rule, evict_batch):
    rng = np.random.default_rng(1)
    max_size, step = 32, 20
    budget = split_segments(max_size, "heavy")
    segments = dict(sink=budget.sink, heavy=budget.heavy, recent=budget.recent)
    c = H2OKVCache(max_size, **segments, score=rule, evict_batch=evict_batch)
    oracle = Oracle(max_size, budget.sink, budget.recent, rule, evict_batch)
    for _ in range(5):
        inside = feed(c, oracle, rng, step)
        assert inside <= max_size + step
        assert c.size() <= max_size
        assert cache_positions(c) == [set(k) for k in oracle.kept]
    # decode after chunks, then another chunk before the free slots are used up
    for _ in range(3):
        feed(c, oracle, rng, 1)
    feed(c, oracle, rng, 7)
    assert cache_positions(c) == [set(k) for k in oracle.kept]


class SnapshotCache(H2OKVCache):
    """Records every slot's position and accumulated score just before eviction."""

    def _evict(self):
        n = self.used
        self.snapshot = (np.array(self.positions[0, :, :n]), np.array(self.scores[0, :, :n]))
        super()._evict()


@pytest.mark.parametrize("n_new", [1, 9])
def test_kept_middle_is_top_heavy_by_score(n_new):
    rng = np.random.default_rng(2)
    c = SnapshotCache(16, sink=2, heavy=8, recent=6, score="attn", evict_batch=1)
    oracle = Oracle(16, 2, 6, "attn")
    feed(c, oracle, rng, 12)
    for _ in range(8):
        c.snapshot = None
        feed(c, oracle, rng, n_new)
        if c.snapshot is None:
            continue  # not over budget: nothing was evicted
        positions, scores = c.snapshot
        held = cache_positions(c)
        for h in range(N_KV):
            middle = (positions[h] >= 2) & (positions[h] < c.offset - 6)
            kept = np.array([p in held[h] for p in positions[h]])
            assert (kept | middle).all()  # only middle tokens are ever evicted
            assert (kept & middle).sum() == 8  # exactly `heavy` of them stay
            assert scores[h][kept & middle].min() >= scores[h][~kept].max()


def decode_uniform(c: H2OKVCache, steps: int):
    """Decode `steps` single tokens with all-zero keys and logits; yields after each."""
    k = mx.zeros((1, 1, 1, 4))
    for i in range(steps):
        c.update_and_fetch(k, k)
        c.update_scores(mx.zeros((1, 1, 1, c.used)))
        yield i


def test_offset_counts_every_token_and_size_is_bounded():
    c = H2OKVCache(8, sink=1, heavy=3, recent=4)
    for i in decode_uniform(c, 50):
        assert c.offset == i + 1
        assert c.size() == min(i + 1, 8)
    assert c.evicted == 42


def test_mask_for_chunk_after_eviction():
    c = H2OKVCache(8, sink=1, heavy=3, recent=4)
    k = mx.zeros((1, 1, 20, 4))
    c.update_and_fetch(k, k)
    c.update_scores(mx.zeros((1, 1, 20, 20)))
    assert c.size() == 8 and c.offset == 20
    mask = c.make_mask(3, return_array=True)
    expected = np.concatenate([np.ones((3, 8), bool), np.tril(np.ones((3, 3), bool))], axis=1)
    np.testing.assert_array_equal(np.array(mask), expected)
    assert c.make_mask(1) is None
    assert c.make_mask(3) == "causal"


def test_nbytes_counts_every_buffer():
    c = H2OKVCache(16, sink=2, heavy=6, recent=8)
    assert c.nbytes == 0
    k = mx.zeros((1, 2, 5, 8))
    c.update_and_fetch(k, k)
    cap = c.keys.shape[2]
    assert c.nbytes == 2 * (2 * cap * 8 * 4) + 2 * cap * 4 + 2 * cap * 4


def test_trim_stops_at_the_newest_evicted_token():
    """After evictions the newest tokens still held in order (the recent window at
    least) can be trimmed; one more would need an evicted token back."""
    c = H2OKVCache(8, sink=1, heavy=3, recent=4)
    for _ in decode_uniform(c, 12):
        pass
    held = sorted(cache_positions_of(c)[0])
    in_order = 0
    while held and held[-1 - in_order] == c.offset - 1 - in_order:
        in_order += 1
    assert c.trimmable_tokens() == in_order >= 4
    assert c.trim(3) == 3 and c.offset == 9 and c.size() == 5
    assert sorted(cache_positions_of(c)[0]) == held[:-3]
    # asked for more, it stops before the evicted token, as mlx-lm's trim clips
    assert c.trim(100) == in_order - 3 and not c.is_trimmable()
    c2 = H2OKVCache(64)
    c2.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    assert c2.trim(4) == 4 and c2.offset == 6 and c2.size() == 6


def test_batched_eviction_stays_inside_max_size():
    """evict_batch=4: the cache drops to max_size - 3 and refills before evicting again."""
    c = H2OKVCache(16, sink=2, heavy=6, recent=8, evict_batch=4)
    sizes = [c.size() for _ in decode_uniform(c, 40)]
    assert max(sizes) == 16 and min(sizes[16:]) == 13
    assert sizes[16:24] == [13, 14, 15, 16, 13, 14, 15, 16]
    assert c.evicted == 40 - c.size()
    assert c.keys.shape[2] == 17  # one preallocated buffer, never regrown


def test_bad_budgets_are_rejected():
    with pytest.raises(ValueError):
        split_segments(16, "nope")
    with pytest.raises(ValueError):
        H2OKVCache(8, sink=4, heavy=6, recent=2)
    with pytest.raises(ValueError):
        H2OKVCache(8, score="nope")
    with pytest.raises(ValueError):
        H2OKVCache(16, sink=2, heavy=6, recent=8, evict_batch=7)


def test_snap_counts_the_observation_window_and_pools_neighbours():
    """Pooled ties break arbitrarily, so snap is checked by its two parts, not the oracle."""
    rule = make_score_rule("snap", window=2, kernel=3)
    logits = mx.array(np.log(np.array([[[[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]]],
                                      np.float32) + 1e-9))  # fmt: skip
    got = np.array(rule.accumulate(mx.zeros((1, 1, 4)), logits, 1))[0, 0]
    np.testing.assert_allclose(got, [0, 0, 1, 1], atol=1e-6)  # rows 0, 1 are outside
    importance = mx.array([[[5.0, 0.0, 0.0, 0.0, 2.0, 0.0]]])
    positions = mx.array([[[4, 0, 1, 2, 3, 9]]], dtype=mx.int32)  # slots out of order
    ranked = np.array(rule.rank(importance, positions, 10))[0, 0]
    # by position 0..4, 9: scores 0, 0, 0, 2, 5, 0 -> pooled 0, 0, 2, 5, 5, 5
    np.testing.assert_allclose(ranked, [5, 0, 0, 2, 5, 5])


def _twin_decode(make, steps: int, rng: np.random.Generator) -> H2OKVCache:
    """A cache from `make` after a 12-token prompt and `steps` decode tokens, scored by
    random logits over its held slots."""
    c = make()
    for n_new in [12] + [1] * steps:
        k = mx.array(rng.standard_normal((B, N_KV, n_new, 64)).astype(np.float32))
        c.update_and_fetch(k, k * 0.5)
        logits = rng.standard_normal((B, N_Q, n_new, c.used)).astype(np.float32) * 3
        c.update_scores(mx.array(logits))
    return c


@pytest.mark.parametrize(
    "make",
    [
        lambda: H2OKVCache(24, 2, 10, 12, "attn", evict_batch=4),
        lambda: H2OKVCache(24, 2, 10, 12, "snap", evict_batch=1),
        lambda: H2OKVCache(24, 2, 10, 12, "ema", evict_batch=3),
        lambda: QuantizedH2OKVCache(24, sink=2, heavy=10, recent=12, bits=8, evict_batch=4),
        lambda: QuantizedH2OKVCache(
            24, sink=2, heavy=10, recent=12, bits=4, rotate=True, evict_batch=2, score="tova"
        ),
        lambda: MergingH2OKVCache(24, sink=2, heavy=10, recent=12, score="mean", evict_batch=4),
    ],
    ids=["dense-attn", "dense-snap", "dense-ema", "q8", "q4-rotated-tail", "merge"],
)
def test_a_decode_eviction_is_one_compiled_call_with_the_same_result(make, monkeypatch):
    """At the buffers' final size a decode's eviction is one compiled call; it keeps exactly
    what the op-by-op eviction keeps (slots, K/V, scores, positions, counters)."""
    import cache.policies.h2o

    calls = []
    compiled = cache.policies.h2o._compiled_eviction
    monkeypatch.setattr(
        cache.policies.h2o, "_compiled_eviction", lambda c: calls.append(c) or compiled(c)
    )
    fused = _twin_decode(make, 40, np.random.default_rng(5))
    assert calls and len(calls) == fused.evicted // fused.evict_batch  # every eviction
    monkeypatch.setattr(cache.policies.h2o, "_compiled_eviction", lambda c: None)
    plain = _twin_decode(make, 40, np.random.default_rng(5))
    assert (fused.used, fused.seen, fused.evicted) == (plain.used, plain.seen, plain.evicted)
    for name in fused.eviction_buffers():  # a merge's counts too
        a, b = tree_flatten(getattr(fused, name)), tree_flatten(getattr(plain, name))
        for (_, x), (_, y) in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=name)


@pytest.mark.parametrize(
    "make",
    [
        lambda: H2OKVCache(24, 2, 10, 12, "attn", evict_batch=4),
        lambda: QuantizedH2OKVCache(24, sink=2, heavy=10, recent=12, bits=8, evict_batch=4),
    ],
    ids=["dense", "q8"],
)
def test_a_decode_eviction_moves_only_the_kept_newest_tokens(make):
    """At the final size the kept tokens below `keep` stay in their slots; only the kept
    ones among the newest slots move, into the slots the leavers left: at most evict_batch
    slots of K/V written per head, not the whole buffer. Every kept token keeps its K/V."""
    rng = np.random.default_rng(9)
    c = _twin_decode(make, 20, rng)  # past its first decode evictions
    evictions = 0
    for _ in range(12):
        k = mx.array(rng.standard_normal((B, N_KV, 1, 64)).astype(np.float32))
        c.update_and_fetch(k, k * 0.5)
        before_pos = np.array(c.positions)
        before_keys = [np.array(a) for _, a in tree_flatten(c.keys)]
        n = c.used
        logits = rng.standard_normal((B, N_Q, 1, n)).astype(np.float32) * 3
        c.update_scores(mx.array(logits))
        if c.used == n:
            continue
        evictions += 1
        keep, after_pos = c.used, np.array(c.positions)
        after_keys = [np.array(a) for _, a in tree_flatten(c.keys)]
        for h in range(N_KV):
            kept = set(after_pos[0, h, :keep].tolist())
            stayed = [s for s in range(keep) if before_pos[0, h, s] in kept]
            assert (after_pos[0, h, stayed] == before_pos[0, h, stayed]).all()
            assert keep - len(stayed) <= c.evict_batch  # the holes the movers filled
            for s in range(keep):  # each kept token's K/V, wherever it sits now
                was = int(np.nonzero(before_pos[0, h, :n] == after_pos[0, h, s])[0][0])
                for b, a in zip(before_keys, after_keys, strict=True):
                    np.testing.assert_array_equal(a[0, h, s], b[0, h, was])
    assert evictions >= 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: H2OKVCache(24, 2, 10, 12, "attn", evict_batch=4),
        lambda: QuantizedH2OKVCache(
            24, sink=2, heavy=10, recent=12, bits=4, rotate=True, evict_batch=2, score="tova"
        ),
    ],
    ids=["dense", "q4-rotated-tail"],
)
def test_a_fixed_shape_decode_mask_shows_the_held_slots_and_is_built_once_per_count(make):
    """A decode reading every slot masks the free ones: `attention_mask` shows exactly the
    keys `_slots_of_keys` puts below `_slots_served`, and a count served that comes round
    again (every eviction cycle) reuses its mask, evaluated: no op in that step."""
    rng = np.random.default_rng(3)
    c = _twin_decode(make, 20, rng)  # at the final size, past its first evictions
    seen: dict[int, mx.array] = {}
    for _ in range(4 * c.evict_batch + 3):
        k = mx.array(rng.standard_normal((B, N_KV, 1, 64)).astype(np.float32))
        c.update_and_fetch(k, k * 0.5)
        assert c.fused_decode
        mask = c.attention_mask(N_Q, 1)
        n, served = c.positions.shape[-1], c._slots_served()
        expected = np.array(c._slots_of_keys(n)) < served
        np.testing.assert_array_equal(np.array(mask).reshape(-1), expected)
        if served in seen:
            assert mask is seen[served]  # the same array, evaluated when first used
        seen[served] = mask
        logits = rng.standard_normal((B, N_Q, 1, c.used)).astype(np.float32) * 3
        c.update_scores(mx.array(logits))
    assert len(seen) <= c.evict_batch + 1 < 4 * c.evict_batch + 3


def test_presets_split_max_kv():
    """(sink, heavy, recent) of each preset: `lean` keeps an eighth as the recent window."""
    split = {p: split_segments(128, p) for p in ("heavy", "balanced", "lean")}
    assert [(s.sink, s.heavy, s.recent) for s in split.values()] == [
        (4, 64, 60), (4, 32, 92), (4, 108, 16),
    ]  # fmt: skip
    tiny = split_segments(4, "lean")
    assert (tiny.sink, tiny.heavy, tiny.recent) == (1, 2, 1)
