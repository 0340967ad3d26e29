"""h2o-recall (cache/policies/recall.py): evicted tokens wait in a packed archive, and a prompt
chunk
that attends to them brings them back."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.attention import ScoredAttention
from cache.policies.h2o import H2OKVCache
from cache.policies.recall import RecallH2OKVCache
from config.cache_spec import CacheSpec, default_recall

H, D = 2, 64  # KV heads, head dim (one 8-bit group of 64)
SCALE = D**-0.5
ATTENTION = ScoredAttention("reference")


def random_kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1))
    return k, v


def feed(cache, keys: mx.array, values: mx.array, queries: mx.array | None = None) -> mx.array:
    """What a routed layer does: store, then attend with scores (queries default to keys)."""
    q = keys if queries is None else queries
    k, v = cache.update_and_fetch(keys, values)
    mask = "causal" if q.shape[2] > 1 else None
    out = ATTENTION.attend_scored(q, k, v, cache, SCALE, mask)
    mx.eval(out, cache.scores)
    return out


def held(cache) -> list[set[int]]:
    return [set(np.array(cache.positions[0, h, : cache.size()]).tolist()) for h in range(H)]


def archived(cache) -> list[set[int]]:
    if cache.archived_positions is None:
        return [set() for _ in range(H)]
    return [set(np.array(cache.archived_positions[0, h]).tolist()) for h in range(H)]


def decode(cache, n: int, seed: int) -> None:
    k, v = random_kv(n, seed)
    for t in range(n):
        feed(cache, k[:, :, t : t + 1], v[:, :, t : t + 1])


def test_evicted_tokens_are_archived_until_the_archive_is_full():
    cache = RecallH2OKVCache(32, archive=64, evict_batch=1)
    decode(cache, 80, seed=0)
    for kept, gone in zip(held(cache), archived(cache), strict=True):
        assert not kept & gone
        assert kept | gone == set(range(80))  # nothing lost: 80 - 32 = 48 archived
    decode(cache, 60, seed=5)
    assert cache.archived_tokens() == 64  # full: the lowest-ranked archived tokens left
    assert cache.size() == 32


def test_a_chunk_that_asks_for_an_archived_token_brings_it_back_pinned():
    cache = RecallH2OKVCache(32, archive=128, evict_batch=1)
    k, v = random_kv(100, seed=1)
    feed(cache, k[:, :, :8], v[:, :, :8])
    decode(cache, 92, seed=3)  # positions 8.. are noise; 8..99 get evicted and archived
    target = next(p for p in range(20, 60) if all(p in a for a in archived(cache)))
    # The target's key (8-bit in the archive) as the new chunk's last queries: they attend to it.
    key = mx.dequantize(*cache.archived[0], group_size=64, bits=8)
    where = np.array(cache.archived_positions[0])
    slots = [np.flatnonzero(where[h] == target)[0] for h in range(H)]
    probe = mx.stack([key[0, h, int(slots[h])] for h in range(H)])[None, :, None, :] * 8.0
    chunk_k, chunk_v = random_kv(6, seed=9)
    feed(cache, chunk_k[:, :, :5], chunk_v[:, :, :5])  # a prompt's chunk: nothing back yet
    assert cache.recalled == 0
    # The prompt's last token, fed alone (the server's first decode step), asks for it.
    feed(cache, chunk_k[:, :, 5:], chunk_v[:, :, 5:], probe)
    assert cache.recalled > 0
    assert all(target in h for h in held(cache)) and all(target not in a for a in archived(cache))
    pinned = set(np.array(cache.pinned).reshape(-1).tolist())
    assert target in pinned and cache.size() <= 32 + 1
    decode(cache, 40, seed=11)  # decode evicts around it: pinned until the next chunk
    assert all(target in h for h in held(cache))


def test_a_chunk_reads_the_archive_as_if_its_tokens_were_held():
    """With every evicted token archived, a chunk's output is full attention's (8-bit)."""
    cache, full = RecallH2OKVCache(24, archive=256, evict_batch=1), H2OKVCache(10_000)
    k, v = random_kv(100, seed=2)
    for c in (cache, full):
        for t in range(90):
            feed(c, k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert cache.archived_tokens() == 90 - 24
    a = feed(cache, k[:, :, 90:], v[:, :, 90:])
    b = feed(full, k[:, :, 90:], v[:, :, 90:])
    assert mx.abs(a - b).max().item() < 2e-2  # 8-bit archived K/V
    plain = H2OKVCache(24, evict_batch=1)
    for t in range(90):
        feed(plain, k[:, :, t : t + 1], v[:, :, t : t + 1])
    c = feed(plain, k[:, :, 90:], v[:, :, 90:])
    assert mx.abs(c - b).max().item() > 5 * mx.abs(a - b).max().item()  # eviction shows


def test_state_round_trip_keeps_the_archive():
    cache = RecallH2OKVCache(16, archive=64, evict_batch=2)
    decode(cache, 50, seed=4)
    loaded = RecallH2OKVCache.from_state(cache.state)
    assert loaded.meta_state == cache.meta_state and loaded.archived_tokens() == 50 - cache.size()
    assert archived(loaded) == archived(cache) and held(loaded) == held(cache)
    k, v = random_kv(12, seed=6)
    np.testing.assert_allclose(np.array(feed(loaded, k, v)), np.array(feed(cache, k, v)), atol=1e-5)


def test_recall_size_is_checked_and_defaults_to_a_phrase():
    assert default_recall(heavy=64, evict_batch=8) == 16
    assert default_recall(heavy=256, evict_batch=32) == 64
    assert default_recall(heavy=8, evict_batch=2) == 7  # what pinning leaves room for
    with pytest.raises(ValueError, match="recall must be between"):
        RecallH2OKVCache(32, archive=64, recall=40)
    with pytest.raises(ValueError, match="archive"):
        RecallH2OKVCache(32, archive=-1)
    assert CacheSpec("h2o-recall", 64).info.scored


@pytest.mark.parametrize("steps", [10, 50])  # archive empty, then holding tokens
def test_prompt_cache_file_round_trip(tmp_path, steps):
    """What the server's spill does (mlx-lm's save/load_prompt_cache): the archive comes back."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    original = RecallH2OKVCache(16, archive=64, evict_batch=2)
    decode(original, steps, seed=4)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [original])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is RecallH2OKVCache and loaded.meta_state == original.meta_state
    assert archived(loaded) == archived(original) and held(loaded) == held(original)
    k, v = random_kv(12, seed=6)
    np.testing.assert_allclose(
        np.array(feed(loaded, k, v)), np.array(feed(original, k, v)), atol=1e-5
    )
