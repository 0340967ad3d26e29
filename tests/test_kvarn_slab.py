"""KVarNSlab (cache/batching/kvarn_slab.py): h2o-kvarn sessions holding equally many tokens decode
as the rows of one H2OKVarNCache per layer.

A tiny random llama (head dim 64: KVarN's Hadamard blocks and value groups fit), max_kv
64 (32-token tiles, a tile's worth evicted at a time). Sessions whose prompts left them
holding as many tokens at different positions are fed the same tokens alone and as slab
rows, across tails packed and evictions re-packed, with a row joining mid-run: the logits
must agree and every cache must end holding what it holds alone. The server-level test
(the Batcher grouping sessions by size) is in tests/test_batching.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_h2o_slab import counted_calls
from tiny import tiny

from cache import install_router, make_cache
from cache.batching.batch import batch_caches, open_h2o_slab
from cache.batching.h2o_slab import slab_key
from cache.batching.kvarn_slab import KVarNSlab
from cache.policies.h2o_kvarn import H2OKVarNCache
from config.cache_spec import CacheSpec

SPEC = CacheSpec("h2o-kvarn", 64)
# One pass over a prompt past max_kv evicts down to keep (33 tokens), wherever it ends:
# three rows of one size at different positions. The fourth holds 43 tokens, the size
# the others reach after 10 steps, when it joins them.
PROMPTS = (70, 90, 130, 43)
JOINS_AT = 10
STEPS = 70  # more than two eviction periods: tails packed, every row evicting


@pytest.fixture(scope="module")
def model():
    model = tiny("llama", head_dim=64)
    install_router(model)
    return model


def prefilled(model, n: int, seed: int, with_step: bool = False) -> list:
    """`with_step`: a step owner's caches (`scores_with_step`, the server's), whose decode
    token's store joins the compiled attention call (`store_and_attend`)."""
    caches = make_cache(model, SPEC, scores_with_step=with_step)
    prompt = np.random.default_rng(seed).integers(0, 64, n)
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    return caches


def held(cache: H2OKVarNCache) -> dict[str, np.ndarray]:
    """Everything a cache holds, by name (its layout's counters beside its arrays)."""
    out = {"layout": np.array([cache.offset, cache.evicted, cache.n_front, cache.n_tail])}
    out |= {"tiles": np.array(cache.n_tiles()), "scores": np.array(cache.scores)}
    out["positions"] = np.array(cache.positions)
    for name in ("front", "tiles", "tail"):
        flat = [] if getattr(cache, name) is None else mx.concatenate(
            [a.reshape(-1).astype(mx.float32) for a in _leaves(getattr(cache, name))]
        )  # fmt: skip
        out[name + " arrays"] = np.array(flat)
    return out


def _leaves(tree) -> list[mx.array]:
    return tree if isinstance(tree[0], mx.array) else [a for t in tree for a in _leaves(t)]


def decoded_alone(model, prefill, prompts, fed, first: list[int]) -> tuple[list, list]:
    """Each prompt's session (`prefill(model, length, n)`) fed its tokens alone, as many
    as it decodes in a slab it joins at step first[n]: (its caches, its logits a step)."""
    alone, logits = [], []
    for n, (length, tokens) in enumerate(zip(prompts, fed, strict=True)):
        caches = prefill(model, length, n)
        steps = len(tokens) - first[n]
        logits.append([model(mx.array([[t]]), cache=caches)[0, -1] for t in tokens[:steps]])
        alone.append(caches)
    return alone, logits


def leave_all(slab, rows: list) -> None:
    """Every member (row n: member n) leaves, its caches written back; the slab empties."""
    for m, caches in enumerate(rows):
        slab.leave(m, caches)
    assert not slab.members and not slab.layers


def decode_in_slab(model, slab, rows, fed, first, logits_alone, tol: float) -> None:
    """Every member decodes its fed tokens in `slab`, row 3 joining at first[3] (its key
    the slab's then); each step's logits are each row's alone, within `tol`."""
    for step in range(len(fed[0])):
        if step == first[3]:
            assert slab.key == slab_key(rows[3])  # an h2o-kvarn slab: its size moved there
            slab.join([(3, rows[3])])
        members = slab.members
        inputs = mx.array([[fed[m][step - first[m]]] for m in members])
        out = model(inputs, cache=batch_caches([], slab))[:, -1]
        for row, m in enumerate(members):
            want = logits_alone[m][step - first[m]]
            np.testing.assert_allclose(np.array(out[row]), np.array(want), atol=tol, rtol=tol)


@pytest.mark.parametrize("with_step", [False, True], ids=["store-apart", "store-joined"])
def test_rows_of_one_size_compute_what_each_session_computes_alone(model, monkeypatch, with_step):
    fed = np.random.default_rng(9).integers(0, 64, (len(PROMPTS), STEPS)).tolist()
    first = [JOINS_AT if n == 3 else 0 for n in range(len(PROMPTS))]
    alone, logits_alone = decoded_alone(model, prefilled, PROMPTS, fed, first)

    # calls per layer and step, for every row at once
    calls = counted_calls(monkeypatch, H2OKVarNCache, ("attend_decode", "store_and_attend"))
    rows = [prefilled(model, length, n, with_step) for n, length in enumerate(PROMPTS)]
    assert len({slab_key(r) for r in rows[:3]}) == 1 and slab_key(rows[3]) != slab_key(rows[0])
    slab = open_h2o_slab(slab_key(rows[0]))
    assert isinstance(slab, KVarNSlab)
    slab.join([(n, caches) for n, caches in enumerate(rows[:3])])
    assert all(c.front is None for c in rows[0])  # the slab holds the arrays now
    # 1e-3: a batched matmul reduces in another float32 order (mlx 0.32.4), and a packed
    # tile can round one step apart from then on; a wrong row is off by 0.1 or more.
    decode_in_slab(model, slab, rows, fed, first, logits_alone, 1e-3)
    # Joined, the store waits for the call but on the steps that fill a tail (packed then)
    joined, apart = (len(calls[name]) for name in ("store_and_attend", "attend_decode"))
    assert joined + apart == STEPS * len(model.layers)
    assert (joined > apart > 0) if with_step else joined == 0
    leave_all(slab, rows)
    for mine, theirs in zip(rows, alone, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            got, want = held(a), held(b)
            assert want["layout"][1] > 0 and want["tiles"] >= 1  # evicted, tiles packed
            for name in want:
                # rtol: a float16 scale may round one step apart (mlx 0.32.4 reduction order)
                np.testing.assert_allclose(
                    got[name], want[name], atol=1e-5, rtol=1e-3, err_msg=name
                )


def stepped_pair(model, slab_class, rows: list, steps: int = 5):
    """A slab of `slab_class` holding two sessions' caches ("a", "b"), `steps` decoded."""
    slab = slab_class(slab_key(rows[0]))
    slab.join([("a", rows[0]), ("b", rows[1])])
    for _ in range(steps):
        model(mx.array([[1], [2]]), cache=batch_caches([], slab))
    return slab


def test_a_lent_row_shows_its_contents_and_counters_between_steps(model):
    rows = [prefilled(model, n, seed) for seed, n in enumerate((70, 90))]
    slab = stepped_pair(model, KVarNSlab, rows)
    slab.lend("b", rows[1])
    layer = slab.layers[0]
    np.testing.assert_array_equal(np.array(rows[1][0].positions), np.array(layer.positions[1:]))
    assert [c.offset for c in rows[1]] == [95, 95] and rows[1][0].size() == layer.size()
    slab.reclaim()
    assert rows[1][0].front is None  # the slab holds the row again
    model(mx.array([[1], [2]]), cache=batch_caches([], slab))
    slab.leave("b", rows[1])
    assert rows[1][0].offset == 96 and rows[1][0].positions.shape[-1] == rows[1][0].size()
    assert slab.rows == 1 and slab.layers[0].offset.shape == (2,)  # until the next step


def test_only_rows_of_one_size_and_rule_share_a_key(model):
    one, other = prefilled(model, 70, 0), prefilled(model, 40, 1)
    assert slab_key(one) != slab_key(other)  # 33 tokens held against 40
    slab = KVarNSlab(slab_key(one))
    slab.join([("one", one)])
    with pytest.raises(ValueError, match="equally many tokens"):
        slab.join([("other", other)])
    # whole-tile eviction drops as many tiles as each row's candidates allow: alone
    tiles = make_cache(model, CacheSpec("h2o-kvarn", 64, kvarn_strategy="tile"))
    mx.eval(model(mx.array([list(range(40))]), cache=tiles))
    assert slab_key(tiles) is None


class _Row:
    """What the batcher's grouping reads of a generation: its session's caches and spec."""

    def __init__(self, caches: list):
        self.session = type("Session", (), {"caches": caches, "spec": SPEC})()


def test_two_slabs_that_come_to_one_size_merge(model):
    """A slab of rows that never evicted (32 held) and one about to evict (64 held, keep
    33) hold 33 tokens each after one step: the batcher's next grouping makes them one."""
    from server.engine.batcher import Batcher

    batcher = Batcher(model, prefill_step=64, prefill_budget=100)
    short, full = ([_Row(prefilled(model, n, seed)) for seed in (0, 1)] for n in (32, 64))
    for pair in (short, full):
        slab = open_h2o_slab(slab_key(pair[0].session.caches))
        slab.join([(g, g.session.caches) for g in pair])
        batcher.h2o_slabs[slab.key] = slab
    rows = [*short, *full]
    model(mx.array([[1]] * 4), cache=batch_caches([], *batcher.h2o_slabs.values()))
    assert batcher._regroup_h2o(rows) == []  # every row in a slab
    (merged,) = batcher.h2o_slabs.values()
    assert set(merged.members) == set(rows) and merged.layers[0].size() == 33
    out = model(mx.array([[2]] * 4), cache=batch_caches([], merged))
    for g in rows:
        merged.leave(g, g.session.caches)
    assert {c.offset for g in full for c in g.session.caches} == {66}
    assert out.shape[0] == 4 and all(c.size() == 34 for g in rows for c in g.session.caches)
