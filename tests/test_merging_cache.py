"""MergingH2OKVCache (h2o-merge): evicted tokens are folded into their nearest kept slot."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from bench.merge_eviction import AllPairsMerging
from cache.attention import ATTENTION
from cache.policies.h2o import H2OKVCache
from cache.policies.merging import MergingH2OKVCache
from kernels.reference import bias_as_mask, sdpa_with_scores

SEGMENTS = dict(sink=2, heavy=6, recent=8, evict_batch=2)
STEPS = [300] + [1] * 40 + [7] + [1] * 10  # a prompt past one query block, decode, a chunk
N_KV, GROUP, DIM = 2, 2, 8


def feed(c, seed: int, steps=STEPS):
    """Random K/V/Q through the scored attention path, as the router drives it; returns
    every key and value fed, [1, N_KV, tokens, DIM] each."""
    rng = np.random.default_rng(seed)
    ks, vs = [], []
    for n in steps:
        k = mx.array(rng.standard_normal((1, N_KV, n, DIM), np.float32))
        v = mx.array(rng.standard_normal((1, N_KV, n, DIM), np.float32))
        q = mx.array(rng.standard_normal((1, N_KV * GROUP, n, DIM), np.float32))
        keys, values = c.update_and_fetch(k, v)
        mx.eval(ATTENTION.attend_scored(q, keys, values, c, 0.3, c.make_mask(n), c.logit_bias()))
        ks.append(k)
        vs.append(v)
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def held(c, buf):
    return buf[:, :, : c.used]


@pytest.mark.parametrize("rule", ["attn", "mean"])
def test_nothing_is_lost_every_token_lives_in_one_slot(rule):
    """The counts add up to every token seen; every value is a weighted mean of values fed
    (inside their range) and every key's length inside the fed keys' lengths. Sinks and
    the recent window hold their own token only."""
    c = MergingH2OKVCache(16, **SEGMENTS, score=rule)
    keys, values = feed(c, 0)
    counts = held(c, c.counts)
    assert c.evicted > 0 and c.size() <= 16
    assert mx.array_equal(counts.sum(axis=-1), mx.full((1, N_KV), float(c.seen)))
    kept = held(c, c.values)
    assert mx.all(kept <= values.max(axis=2, keepdims=True) + 1e-4).item()
    assert mx.all(kept >= values.min(axis=2, keepdims=True) - 1e-4).item()
    # A merged key is no longer than the longest key fed, no shorter than the shortest.
    lengths, fed = (mx.linalg.norm(x, axis=-1) for x in (held(c, c.keys), keys))
    assert lengths.max().item() <= fed.max().item() + 1e-4
    assert lengths.min().item() >= fed.min().item() - 1e-4
    pos = held(c, c.positions)
    single = (pos < c.sink) | (pos >= c.seen - c.recent)
    assert mx.all(mx.where(single, counts == 1, True)).item()
    assert mx.any(counts > 1).item()
    assert mx.all(counts >= 1).item()


def test_after_a_trim_left_holes_in_the_recent_window_evictions_lose_nothing():
    """A trim (an edited reply) takes the newest tokens: the recent window then reaches
    back over evicted positions and holds fewer than `recent` tokens, so the ranking's
    n - sink - recent lowest ranks leave out a few middle slots; they stay, and every
    token is still in exactly one slot."""
    c = MergingH2OKVCache(16, **SEGMENTS)
    feed(c, 0)
    assert c.trim(6) == 6
    recent = held(c, c.positions) >= c.seen - c.recent
    assert mx.all(recent.sum(axis=-1) < c.recent).item()  # holes
    evicted = c.evicted
    feed(c, 1, steps=[1] * 30)
    assert c.evicted > evicted and c.size() <= 16
    assert mx.array_equal(held(c, c.counts).sum(axis=-1), mx.full((1, N_KV), float(c.seen)))


def overfull(seed: int, n: int = 20, score: str = "attn") -> MergingH2OKVCache:
    """A cache holding n > max_kv random tokens, not yet evicted."""
    rng = np.random.default_rng(seed)
    c = MergingH2OKVCache(16, **SEGMENTS, score=score)
    k, v = (mx.array(rng.standard_normal((1, N_KV, n, DIM), np.float32)) for _ in range(2))
    c.update_and_fetch(k, v)
    return c


def test_leavers_are_the_lowest_score_times_distance_to_a_higher_ranked_key():
    """Brute-force oracle: a middle token's worth is its rank times 1 - the cosine to the
    nearest middle key ranked at least as high; the lowest leave, sinks and recent stay."""
    c = overfull(6)
    n = c.used
    rng = np.random.default_rng(7)
    c.scores[..., :n] = mx.array(rng.uniform(0.1, 1.0, (1, N_KV, n)).astype(np.float32))
    rank = np.array(c.scores[0, :, :n])
    keys = np.array(c.keys[0, :, :n])
    pos = np.arange(n)
    middle = (pos >= c.sink) & (pos < n - c.recent)
    keep_middle = c.max_size + 1 - c.evict_batch - int((~middle).sum())
    c.evict_if_full()
    for h in range(N_KV):
        unit = keys[h] / np.linalg.norm(keys[h], axis=-1, keepdims=True)
        worth = {}
        for i in pos[middle]:
            above = [
                j
                for j in pos[middle]
                if rank[h, j] > rank[h, i] or (rank[h, j] == rank[h, i] and j < i)
            ]
            nearest = max((unit[i] @ unit[j] for j in above), default=-np.inf)
            worth[i] = rank[h, i] * np.clip(1 - nearest, 1e-3, 2.0)
        best = sorted(worth, key=worth.get)[-keep_middle:]
        expected = sorted([*pos[~middle], *best])
        assert sorted(np.array(held(c, c.positions)[0, h]).tolist()) == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_middle_cosines_evict_what_every_pair_evicts(seed, monkeypatch):
    """Over a prompt, decode steps (compiled evictions) and a chunk, comparing middle keys
    only keeps the same tokens as comparing every slot, and its cosines are [middle x
    middle]: sinks and the recent window (half of max_kv) never enter them."""
    import cache.policies.merging

    shapes = []
    unit = cache.policies.merging._unit
    monkeypatch.setattr(
        cache.policies.merging, "_unit", lambda x: shapes.append(x.shape) or unit(x)
    )
    reference = AllPairsMerging(16, **SEGMENTS)
    feed(reference, seed)
    shapes.clear()
    c = MergingH2OKVCache(16, **SEGMENTS)
    feed(c, seed)
    assert c.evicted == reference.evicted > 10 * c.evict_batch
    for name in ("positions", "counts", "keys", "values"):
        a, b = held(c, getattr(c, name)), held(reference, getattr(reference, name))
        assert mx.allclose(a, b, atol=1e-5).item(), name
    # An eviction normalises the ranked keys, then what leaves and what stays.
    ranked, gone, kept = (np.array([x[2] for x in shapes[i::3]]) for i in range(3))
    assert len(ranked) and np.array_equal(ranked, gone + kept - c.sink - c.recent)


def test_a_token_a_higher_ranked_slot_repeats_is_merged_into_it_first():
    """Of two middle keys pointing the same way, the lower-ranked one is redundant: it
    leaves first, even when ranked above every other middle token, and folds into its
    twin; plain H2O would keep both and drop distinct tokens instead."""
    c = overfull(8)
    n = c.used
    twin, kept = 5, 4  # middle slots (positions 2..11); `kept` ranks highest
    c.keys[:, :, twin] = 2.0 * c.keys[:, :, kept]
    scores = np.full((1, N_KV, n), 0.5, np.float32)
    scores[..., kept], scores[..., twin] = 1.0, 0.9
    c.scores[..., :n] = mx.array(scores)
    c.evict_if_full()
    pos = held(c, c.positions)
    assert not mx.any(pos == twin).item() and mx.all(mx.any(pos == kept, axis=-1)).item()
    assert mx.all(mx.where(pos == kept, held(c, c.counts), 0).sum(-1) >= 2).item()


def test_a_slot_of_count_c_attends_like_c_copies_of_its_token():
    """log(count) on the logit is exact for identical tokens (proportional attention),
    taken by the kernel as a bias or folded into a mask (what the GPU kernels get)."""
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((1, N_KV, 5, DIM), np.float32))
    v = mx.array(rng.standard_normal((1, N_KV, 5, DIM), np.float32))
    q = mx.array(rng.standard_normal((1, N_KV * GROUP, 1, DIM), np.float32))
    counts = mx.array([1, 3, 1, 2, 1], dtype=mx.float32)
    c = MergingH2OKVCache(16, **SEGMENTS)
    c.update_and_fetch(k, v)
    c.counts[..., :5] = counts
    copies = mx.array(np.repeat(np.arange(5), np.array(counts, dtype=np.int64)))
    expanded, _ = sdpa_with_scores(q, k[:, :, copies], v[:, :, copies], 0.3)
    biased, _ = sdpa_with_scores(q, k, v, 0.3, None, c.logit_bias())
    folded, _ = sdpa_with_scores(q, k, v, 0.3, bias_as_mask(None, c.logit_bias(), 4, 1, 5))
    assert mx.allclose(biased, expanded, atol=1e-5)
    assert mx.allclose(folded, expanded, atol=1e-5)


def test_a_prompt_chunk_attends_causally_with_the_counts_block_by_block():
    """A chunk longer than a query block (scored block by block, each seeing a prefix of
    the slots) computes what one causal pass with the counts' bias computes."""
    c = MergingH2OKVCache(16, **SEGMENTS)
    feed(c, 3, steps=[40, 1, 1])
    assert mx.any(c.counts > 1).item()
    rng = np.random.default_rng(3)
    n = ATTENTION.block + 20
    k, v = (mx.array(rng.standard_normal((1, N_KV, n, DIM), np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((1, N_KV * GROUP, n, DIM), np.float32))
    keys, values = c.update_and_fetch(k, v)
    bias = c.logit_bias()
    whole, _ = sdpa_with_scores(q, keys, values, 0.3, "causal", bias)
    folded, _ = sdpa_with_scores(
        q, keys, values, 0.3, bias_as_mask("causal", bias, 4, n, bias.shape[-1])
    )
    blocks = ATTENTION.attend_scored(q, keys, values, c, 0.3, "causal", bias)
    assert mx.allclose(blocks, whole, atol=1e-5)
    assert mx.allclose(folded, whole, atol=1e-5)


def test_counts_survive_save_load_and_trim(tmp_path):
    c = MergingH2OKVCache(16, **SEGMENTS)
    feed(c, 4)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is MergingH2OKVCache
    for name in ("counts", "keys", "values", "positions", "scores"):
        assert mx.array_equal(held(c, getattr(c, name)), held(loaded, getattr(loaded, name)))
    total = held(loaded, loaded.counts).sum().item()
    assert loaded.trim(3) == 3
    # The 3 newest are in the recent window, which holds its own tokens only.
    assert held(loaded, loaded.counts).sum().item() == total - 3 * N_KV
    assert loaded.nbytes == H2OKVCache.nbytes.fget(loaded) + loaded.counts.nbytes


@pytest.mark.parametrize("rule", ["attn", "mean"])
def test_a_merge_weighs_each_slot_by_its_rank(rule):
    """Oracle for one eviction: each kept middle slot's value is the mean of its own and
    its leavers' values, each weighted by the rule's rank (not by count); its key the
    weighted mean direction at the weighted mean length; its count the sum. A leaver goes
    to the kept middle slot nearest in direction."""
    c = overfull(9, score=rule)
    n = c.used
    rng = np.random.default_rng(10)
    c.scores[..., :n] = mx.array(rng.uniform(0.1, 1.0, (1, N_KV, n)).astype(np.float32))
    c.counts[..., :n] = mx.array(rng.integers(1, 4, (1, N_KV, n)).astype(np.float32))
    rank = np.array(c.score_rule.rank(c.scores[..., :n], c.positions[..., :n], c.seen))[0]
    before = {name: np.array(getattr(c, name)[0, :, :n]) for name in ("keys", "values", "counts")}
    c.evict_if_full()
    pos = np.array(held(c, c.positions)[0])
    for h in range(N_KV):
        weight = rank[h]
        keys, values = before["keys"][h], before["values"][h]
        unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
        kept = pos[h]
        middle_kept = [p for p in kept if c.sink <= p < c.seen - c.recent]
        groups = {p: [p] for p in kept}
        for g in sorted(set(range(n)) - set(kept.tolist())):
            groups[max(middle_kept, key=lambda p: unit[g] @ unit[p])].append(g)
        for slot, p in enumerate(kept):
            members = groups[p]
            w = weight[members][:, None]
            want_v = (w * values[members]).sum(0) / w.sum()
            direction = (w * keys[members]).sum(0)
            length = (w[:, 0] * np.linalg.norm(keys[members], axis=-1)).sum() / w.sum()
            want_k = direction / np.linalg.norm(direction) * length
            np.testing.assert_allclose(np.array(c.values[0, h, slot]), want_v, atol=1e-5)
            np.testing.assert_allclose(np.array(c.keys[0, h, slot]), want_k, atol=1e-5)
            assert c.counts[0, h, slot].item() == before["counts"][h][members].sum()


def test_without_a_heavy_segment_leavers_are_dropped_not_merged_into_sinks():
    c = MergingH2OKVCache(16, sink=2, heavy=0, recent=14)
    feed(c, 5, steps=[40, 1, 1])
    assert c.evicted > 0
    assert mx.all(held(c, c.counts) == 1).item()
