"""AdaptiveH2OKVCache (h2o-ada): one pool of slots per layer shared by its KV heads."""

import mlx.core as mx
import numpy as np
import pytest

from cache.attention import ATTENTION
from cache.policies.adaptive import AdaptiveH2OKVCache
from cache.policies.h2o import H2OKVCache

SEGMENTS = dict(sink=2, heavy=6, recent=8, evict_batch=2)
STEPS = [300] + [1] * 40 + [7] + [1] * 10  # a prompt past one query block, decode, a chunk


def attend_all(c, n_kv: int, seed: int, group: int = 2, dim: int = 8, sharp: float = 1.0):
    """Random K/V/Q through the scored attention path, as the router drives it.

    sharp: head 0's keys are scaled by it, so its attention is more concentrated.
    """
    rng = np.random.default_rng(seed)
    scale = np.ones((1, n_kv, 1, 1), np.float32)
    scale[:, 0] = sharp
    outs = []
    for n in STEPS:
        k = mx.array(rng.standard_normal((1, n_kv, n, dim), np.float32) * scale)
        v = mx.array(rng.standard_normal((1, n_kv, n, dim), np.float32))
        q = mx.array(rng.standard_normal((1, n_kv * group, n, dim), np.float32))
        keys, values = c.update_and_fetch(k, v)
        # attend_scored asks the cache for its own mask (each KV head's pool slots)
        outs.append(ATTENTION.attend_scored(q, keys, values, c, 0.3, c.make_mask(n)))
    return outs


def per_head_positions(c: AdaptiveH2OKVCache) -> list[list[int]]:
    pos, heads = np.array(c.positions[0, 0, : c.used]), np.array(c.heads[0, 0, : c.used])
    return [sorted(pos[heads == h].tolist()) for h in range(c.n_heads)]


@pytest.mark.parametrize("rule", ["attn", "mean"])
def test_one_head_is_plain_h2o(rule):
    """With a single KV head the pool is H2O's buffer: same outputs, same kept tokens."""
    plain = H2OKVCache(16, **SEGMENTS, score=rule)
    pooled = AdaptiveH2OKVCache(16, **SEGMENTS, score=rule, floor=0.0)
    for a, b in zip(attend_all(plain, 1, 0), attend_all(pooled, 1, 0), strict=True):
        assert mx.allclose(a, b, atol=1e-5)
    assert per_head_positions(pooled)[0] == sorted(
        np.array(plain.positions[0, 0, : plain.used]).tolist()
    )


def test_heads_share_the_budget_and_keep_their_guards():
    c = AdaptiveH2OKVCache(16, **SEGMENTS, floor=0.5)
    attend_all(c, 3, 1, sharp=4.0)
    held = per_head_positions(c)
    counts = [len(h) for h in held]
    assert sum(counts) == 3 * c.size() and sum(counts) <= 3 * 16
    assert len(set(counts)) > 1  # some head gave slots to another
    for positions in held:
        assert set(range(2)) <= set(positions)  # sinks
        assert set(range(c.offset - 8, c.offset)) <= set(positions)  # recent window
        assert len(positions) >= 2 + 8 + 3  # floor 0.5 of heavy 6 kept per head
    assert c.nbytes > 0 and c.evicted == c.offset - c.size()


def test_trim_and_state_round_trip():
    c = AdaptiveH2OKVCache(16, **SEGMENTS)
    attend_all(c, 3, 2)
    assert c.trimmable_tokens() >= 8
    before = per_head_positions(c)
    assert c.trim(3) == 3 and c.offset == sum(STEPS) - 3
    assert per_head_positions(c) == [p[:-3] for p in before]
    restored = AdaptiveH2OKVCache.from_state(c.state)
    assert per_head_positions(restored) == per_head_positions(c)
    assert restored.offset == c.offset and restored.floor == c.floor
