"""KVarNPaddedSlab (cache/batching/kvarn_padded.py): `kvarn` sessions holding different counts
decode as the rows of one layer cache, tiles padded, under a mask of what each row holds.

A tiny random llama (head dim 64: KVarN's Hadamard blocks and value groups fit) with
KVarN's own pools (128-token sink and tiles). Rows under the sink, with a full front and
no tile, and with tiles, are fed the same tokens alone and as slab rows, across a front
pool filling and tails packing, with a row joining mid-run: the logits must agree and
every cache must end holding what it holds alone. The server-level test (the Batcher
putting kvarn sessions in one slab) is in tests/test_batching.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_h2o_slab import counted_calls
from test_kvarn_slab import _leaves, decode_in_slab, decoded_alone, leave_all, stepped_pair
from tiny import tiny

from cache import install_router, make_cache
from cache.batching.batch import batch_caches, open_h2o_slab
from cache.batching.h2o_slab import slab_key
from cache.batching.kvarn_padded import KVarNPaddedSlab
from cache.policies.kvarn import KVarNCache
from config.cache_spec import CacheSpec

SPEC = CacheSpec("kvarn", 1024)
# Under the sink (its front fills mid-run, then its tail); a full front, no tile yet (its
# tail packs mid-run); two tiles held (its tail packs too); the fourth joins at JOINS_AT.
PROMPTS = (100, 200, 420, 300)
JOINS_AT = 20
STEPS = 150


@pytest.fixture(scope="module")
def model():
    model = tiny("llama", head_dim=64)
    install_router(model)
    return model


def prefilled(model, n: int, seed: int) -> list[KVarNCache]:
    caches = make_cache(model, SPEC)
    prompt = np.random.default_rng(seed).integers(0, 64, n)
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    return caches


def held(cache: KVarNCache) -> dict[str, np.ndarray]:
    """Everything a cache holds, by name (its layout's counters beside its arrays; its
    pools' slots in use: a token that filled the tail packed without waiting there)."""
    out = {"layout": np.array([cache.offset, cache.n_front, cache.n_tiles(), cache.n_tail])}
    used = {"front": cache.n_front, "tail": cache.n_tail, "tiles": None}
    for name, n in used.items():
        tree = getattr(cache, name)
        flat = [a[:, :, :n].reshape(-1).astype(mx.float32) for a in _leaves(tree)] if tree else []
        out[name] = np.array(mx.concatenate(flat)) if flat else np.zeros(0)
    out["nbytes"] = np.array(cache.nbytes)
    return out


def test_rows_of_any_size_compute_what_each_session_computes_alone(model, monkeypatch):
    fed = np.random.default_rng(9).integers(0, 64, (len(PROMPTS), STEPS)).tolist()
    first = [JOINS_AT if n == 3 else 0 for n in range(len(PROMPTS))]
    alone, logits_alone = decoded_alone(model, prefilled, PROMPTS, fed, first)

    calls = counted_calls(monkeypatch, KVarNCache, ("update_and_fetch",))
    rows = [prefilled(model, length, n) for n, length in enumerate(PROMPTS)]
    assert len({slab_key(r) for r in rows}) == 1  # whatever they hold
    calls["update_and_fetch"].clear()
    slab = open_h2o_slab(slab_key(rows[0]))
    assert isinstance(slab, KVarNPaddedSlab)
    slab.join([(n, caches) for n, caches in enumerate(rows[:3])])
    assert all(c.front is None for c in rows[0])  # the slab holds the arrays now
    # 1e-4: under the mask a row sums its keys in another order than alone
    decode_in_slab(model, slab, rows, fed, first, logits_alone, 1e-4)
    assert not calls["update_and_fetch"]  # no row stored as a session of its own
    leave_all(slab, rows)
    for mine, theirs in zip(rows, alone, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            got, want = held(a), held(b)
            for name in want:  # float16 tile scales: one step of theirs apart at most
                rtol = 1e-3 if name == "tiles" else 1e-7
                np.testing.assert_allclose(got[name], want[name], rtol, 1e-5, err_msg=name)
    # every kind of row was met: the short one filled its front, the others' tails packed
    assert [c[0].n_tiles() for c in alone] == [0, 1, 3, 2]


def test_a_lent_row_shows_its_contents_and_counters_between_steps(model):
    rows = [prefilled(model, n, seed) for seed, n in enumerate((130, 300))]
    slab = stepped_pair(model, KVarNPaddedSlab, rows)
    slab.lend("a", rows[0])
    c = rows[0][0]
    assert (c.offset, c.n_front, c.n_tiles(), c.n_tail) == (135, 128, 0, 7)
    assert c.size() == 135 and c.tail[0].shape[2] == 128  # both pools whole, as alone
    slab.reclaim()
    assert rows[0][0].front is None  # the slab holds the row again
    model(mx.array([[1], [2]]), cache=batch_caches([], slab))
    slab.leave("b", rows[1])
    assert [c.offset for c in rows[1]] == [306, 306] and rows[1][0].n_tiles() == 1
    assert slab.rows == 1 and slab.layers[0].tiles is None  # no padding left for "a"


def test_padding_is_admitted_while_it_stays_under_what_the_rows_hold(model):
    long, short = prefilled(model, 900, 0), prefilled(model, 140, 1)  # 6 tiles, none
    slab = KVarNPaddedSlab(slab_key(long))
    assert slab.admits([long, short, short]) == [True, True, False]  # 3 x 6 > 2 x 6 + 3
    assert slab.admits([short, short, long]) == [True, True, False]
    medium = prefilled(model, 600, 2)  # 3 tiles: 3 x 6 <= 2 x 9 + 3
    assert slab.admits([long, short, medium]) == [True, True, True]
    slab.join([("long", long), ("short", short)])
    assert slab.admits([short]) == [False]  # the members count too


def test_other_configurations_and_empty_caches_get_other_keys(model):
    one = prefilled(model, 40, 0)
    k8 = make_cache(model, CacheSpec("kvarn", 1024, kvarn="k4v4"))
    mx.eval(model(mx.array([list(range(40))]), cache=k8))
    assert slab_key(one) != slab_key(k8)
    assert slab_key(make_cache(model, SPEC)) is None  # nothing stored yet


def test_a_gpu_kernel_reads_the_padded_rows_under_their_mask(model, emulated_gpu):
    """With a GPU backend present (here "metal" played by the CPU emulation of its kernel
    bodies), the slab's decode goes to the KVarN decode kernel, one call per layer for
    every row (dense pools, padded tiles, the mask), and gives the reference's logits."""
    from cache.attention import ATTENTION

    fed = np.random.default_rng(4).integers(0, 64, (2, 12)).tolist()
    out = {}
    saved = ATTENTION.backend
    try:
        for backend in ("reference", "metal"):
            ATTENTION.configure(backend=backend)
            rows = [prefilled(model, n, seed) for seed, n in enumerate((200, 420))]
            slab = KVarNPaddedSlab(slab_key(rows[0]))
            slab.join([("a", rows[0]), ("b", rows[1])])
            steps = [mx.array([[a], [b]]) for a, b in zip(*fed, strict=True)]
            out[backend] = [model(t, cache=batch_caches([], slab))[:, -1] for t in steps]
    finally:
        ATTENTION.configure(backend=saved)
    for got, want in zip(out["metal"], out["reference"], strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    decodes = [(name, shape[0]) for name, shape, _ in emulated_gpu]
    assert decodes == [("kvarn", 2)] * (12 * len(model.layers))
