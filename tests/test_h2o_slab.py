"""Dense H2O sessions decode in an H2OSlab (cache/h2o_slab.py) as they would alone.

Real default model, through the server's Batcher. Outputs must be greedy-identical
(up to a near-tie, as tests/test_batching.py allows), and afterwards each session's
caches must hold the positions, keys, values and scores it holds after running alone:
rows evict on their own schedule inside the slab. Joining, cancelling, reading
between rounds and a second configuration (its own slab) change none of that.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache import H2OKVCache
from cache.h2o_slab import H2OSlab, near_wall, slab_key
from config.cache_spec import CacheSpec
from server.batcher import Batcher
from tests.test_batching import STEPS, assert_same_greedy, drive, start

H2O = CacheSpec("h2o", 96)
OFTEN = CacheSpec("h2o", 64, evict_batch=1)


def held(cache: H2OKVCache) -> dict[str, np.ndarray]:
    """A cache's slots in position order, per head: what it holds, not where."""
    n = cache.size()
    order = mx.argsort(cache.positions[..., :n], axis=-1)
    out = {
        "positions": mx.take_along_axis(cache.positions[..., :n], order, axis=-1),
        "scores": mx.take_along_axis(cache.scores[..., :n], order, axis=-1),
    }
    for name in ("keys", "values"):
        buf = getattr(cache, name)[:, :, :n]
        out[name] = mx.take_along_axis(buf, order[..., None], axis=2)
    return {k: np.array(v) for k, v in out.items()}


def test_h2o_sessions_share_a_slab_and_match_alone(default_model, essay_text):
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    # two past max_kv (evicting from the first step), one short (evicts mid-run), and
    # two of another configuration: a slab of their own
    runs = [(H2O, ids[:230]), (H2O, ids[300:385]), (H2O, ids[600:780]), (OFTEN, ids[900:1020]),
            (OFTEN, ids[1200:1300]), (H2O, ids[1500:1700])]  # fmt: skip
    alone = []
    for spec, prompt in runs:
        g = start(model, tokenizer, spec, prompt)
        alone.append((drive(Batcher(model, prefill_step=64, prefill_budget=100), [g])[id(g)], g))
    batcher = Batcher(model, prefill_step=64, prefill_budget=300)
    gens = [start(model, tokenizer, spec, prompt) for spec, prompt in runs]
    first, short, doomed, often, often2, late = gens
    seen = {}

    def join(active, out):
        out[id(late)] = []
        return [*active, late]

    def cancel_and_read(active, out):
        slabs = list(batcher.h2o_slabs.values())
        assert sorted(s.rows for s in slabs) == [2, 3]
        assert {first, short, doomed} == set(batcher.h2o_slabs[slab_key(H2O_caches())].members)
        batcher.lend()  # as the worker does before a cache-view read
        seen["offsets"] = {c.offset for c in first.session.caches}
        seen["sizes"] = {c.size() for c in first.session.caches}
        seen["tokens"] = len(first.session.tokens)
        return [g for g in active if g is not doomed]

    def H2O_caches():  # a lone session's caches of the H2O configuration, for its key
        return alone[0][1].session.caches

    out = drive(batcher, [first, short, doomed, often, often2], {10: cancel_and_read, 12: join})
    assert seen["offsets"] == {seen["tokens"]} and len(seen["sizes"]) == 1
    assert not batcher.h2o_slabs  # everyone left, their caches written back
    compared = 0
    for g, (ref_deltas, ref) in zip(gens, alone, strict=True):
        assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
        if g is doomed:
            assert 0 < len(out[id(g)]) < STEPS
            continue
        assert_same_greedy(out[id(g)], ref_deltas, g.session.spec)
        if g.generated != ref.generated:
            continue  # a near-tie flipped (allowed above): the states may differ from there
        for mine, theirs in zip(g.session.caches, ref.session.caches, strict=True):
            assert mine.evicted == theirs.evicted and mine.size() == theirs.size()
            a, b = held(mine), held(theirs)
            np.testing.assert_array_equal(a["positions"], b["positions"])
            for name in ("keys", "values", "scores"):
                np.testing.assert_allclose(a[name], b[name], atol=1e-4, rtol=1e-4)
            compared += 1
    assert compared >= 3 * len(model.layers)
    assert all(c.evicted > 0 for g in gens if g is not doomed for c in g.session.caches)


def test_who_may_join(default_model, essay_text):
    """Dense H2O caches of one configuration share a key; packed ones, other sizes and
    caches near the model's context (they will re-index) do not join."""
    from cache import make_cache

    model, tokenizer = default_model
    ids = mx.array(tokenizer.encode(essay_text)[:40])[None]

    def prefilled(spec: CacheSpec) -> list:
        caches = make_cache(model, spec)
        model(ids, cache=caches)
        return caches

    a, b = prefilled(H2O), prefilled(H2O)
    assert slab_key(a) is not None and slab_key(a) == slab_key(b)
    assert slab_key(prefilled(OFTEN)) not in (None, slab_key(a))
    assert slab_key(prefilled(CacheSpec("h2o-q8", 96))) is None
    assert slab_key(make_cache(model, H2O)) is None  # nothing stored yet
    assert not near_wall(a)
    for c in a:
        c.offset = c.wall - c.wall // 4 - 1
    assert near_wall(a)


def test_a_slab_refuses_a_prompt_chunk(default_model, essay_text):
    from cache import make_cache
    from cache.batch import batch_caches

    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    slab = H2OSlab(None)
    sessions = [make_cache(model, H2O) for _ in range(2)]
    for caches, start_at in zip(sessions, (0, 100), strict=True):
        model(mx.array(ids[start_at : start_at + 30])[None], cache=caches)
    slab.join([("a", sessions[0]), ("b", sessions[1])])
    with pytest.raises(ValueError, match="one token per row"):
        model(mx.array([ids[:2], ids[2:4]]), cache=batch_caches([], slab))
