"""Context shift: H2O caches re-index RoPE positions before they reach the model's context.

A conversation under an evicting policy may outgrow the model's context: the
held keys are re-rotated to positions 0..n-1 in token order (cache/policies/h2o.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from cache import H2OKVCache, QuantizedH2OKVCache, adopt, make_cache, tokens_seen

H, D = 2, 64


def fill(cache: H2OKVCache, rope, steps: int, seed: int = 0) -> mx.array:
    """Decode `steps` random keys the way a model does (RoPE at cache.offset, then store,
    then score); return the raw (pre-RoPE) keys by token index [steps, H, D]."""
    mx.random.seed(seed)
    raw = mx.random.normal((steps, H, D))
    for t in range(steps):
        assert cache.offset < cache.wall, "RoPE positions reached the wall"
        key = rope(raw[t][None, :, None, :], offset=cache.offset)
        cache.update_and_fetch(key, key)
        cache.update_scores(mx.random.uniform(shape=(1, H, 1, cache.size())))
    return raw


def rope_positions(cache: H2OKVCache) -> mx.array:
    n = cache.size()
    pos = cache.positions[..., :n]
    return pos if cache.lags is None else pos - cache.lags[..., :n]


@pytest.mark.parametrize("cls", [H2OKVCache, QuantizedH2OKVCache])
def test_keys_are_re_rotated_to_their_rank(cls):
    rope = nn.RoPE(D, base=10000)
    cache = cls(16, sink=2, heavy=6, recent=8, evict_batch=1)
    cache.wall, cache.rope = 64, rope
    raw = fill(cache, rope, 300)  # > 4 walls: several re-indexings, lags of earlier ones
    assert cache.seen == 300 and tokens_seen(cache) == 300
    assert cache.shift > 0 and cache.offset == 300 - cache.shift
    n = cache.size()
    pos, rpos = cache.positions[0, :, :n], rope_positions(cache)[0]
    # RoPE positions follow token order, below the next token's, all different
    order = mx.argsort(pos, axis=-1)
    ranked = mx.take_along_axis(rpos, order, axis=-1)
    assert mx.all(ranked[:, 1:] > ranked[:, :-1]).item()
    assert mx.all(ranked < cache.offset).item()
    # every held key is its raw key rotated to its RoPE position (packed: stored centred,
    # the sinks served from the dense pool)
    held = cache.keys
    if cls is QuantizedH2OKVCache:
        packed = (a[:, :, :n] for a in cache.keys)
        held = mx.dequantize(*packed, group_size=cache.group_size, bits=cache.bits)
        pool = cache._pool()
        assert pool == 2
        held = mx.concatenate([cache.sink_keys[:, :, :pool], held[:, :, pool:]], axis=2)
        held = held + cache.key_center
    for h in range(H):
        for s in range(n):
            t, r = pos[h, s].item(), rpos[h, s].item()
            want = rope(raw[t, h][None, None, None, :], offset=r)[0, 0, 0]
            err = mx.abs(held[0, h, s] - want).max().item()
            assert err < (1e-4 if cls is H2OKVCache else 0.1), (h, s, t, r, err)


def test_state_and_trim_survive_re_indexing():
    rope = nn.RoPE(D, base=10000)
    cache = H2OKVCache(16, sink=2, heavy=6, recent=8, evict_batch=1)
    cache.wall, cache.rope = 64, rope
    fill(cache, rope, 150)
    copy = H2OKVCache.from_state(cache.state)
    assert (copy.seen, copy.shift, copy.offset) == (cache.seen, cache.shift, cache.offset)
    assert mx.array_equal(copy.lags[..., : copy.size()], cache.lags[..., : cache.size()])
    # trimming the newest tokens steps RoPE back with them
    offset = cache.offset
    assert cache.trim(3) == 3
    assert (cache.seen, cache.offset) == (147, offset - 3)
    # a file cannot hold the layer's RoPE: a restored cache gets it from a fresh one
    assert copy.rope is None and copy.wall is None
    fresh = H2OKVCache(16, sink=2, heavy=6, recent=8, evict_batch=1)
    fresh.wall, fresh.rope = 64, rope
    adopt([copy], [fresh])
    shift = copy.shift
    fill(copy, rope, 100, seed=1)  # asserts the RoPE positions stay below the wall
    assert copy.seen == 250 and copy.shift > shift


def test_re_indexing_a_sliding_window_changes_nothing(default_model):
    """With no sinks and no heavy hitters H2O is a sliding window: re-indexing shifts every
    key by the same amount, and RoPE attention depends on distances only. So the logits of
    a cache that re-indexes equal those of one that never does, on the real model."""
    model, tokenizer = default_model
    ids = tokenizer.encode("The river ran past the old mill and the town. " * 30)[:240]
    window = {"max_kv": 48, "sink": 0, "heavy": 0, "recent": 48}
    shifted = make_cache(model, "h2o", context=96, **window)
    plain = make_cache(model, "h2o", context=10**6, **window)
    for start in range(0, len(ids), 8):
        chunk = mx.array(ids[start : start + 8])[None]
        a, b = model(chunk, cache=shifted), model(chunk, cache=plain)
        # float32 rounding of the extra rotation: ~1e-3 on logits of magnitude ~10
        assert mx.allclose(a, b, atol=1e-2, rtol=1e-3).item(), start
        assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item(), start
        assert shifted[0].offset < 96 + 8
    assert shifted[0].shift > 0 and plain[0].shift == 0
    assert tokens_seen(shifted[0]) == tokens_seen(plain[0]) == len(ids)
