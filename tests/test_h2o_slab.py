"""H2OSlab (cache/batching/h2o_slab.py): H2O sessions, dense or packed, as rows of shared buffers.

Tiny random llamas (these tests also run on a lent GPU, where no model file travels).
Sessions of different prompt lengths, some evicting from the first step and some
starting to evict mid-run, are fed the same tokens alone and as slab rows: the logits
must agree and every cache must end holding the same positions, keys, values and
scores (packed K/V within one quantization step; their key centres and sink pools).
The server-level test (the Batcher grouping sessions, joining, cancelling, reading
between rounds) is in tests/test_batching.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny import tiny

from cache import H2OKVCache, install_router, make_cache
from cache.attention import ATTENTION
from cache.batching.batch import batch_caches
from cache.batching.h2o_slab import H2OSlab, H2OSlabLayer, near_wall, slab_key
from config.cache_spec import CacheSpec
from config.policies import POLICIES

SPEC = CacheSpec("h2o", 24, evict_batch=4)
OFTEN = CacheSpec("h2o", 24, evict_batch=1)
# Packed rows: keys centred, a dense sink pool, h2o-q4 Hadamard-rotated (head dim 32), with
# and without its dense tail of the newest tokens.
PACKED = {
    "q8": CacheSpec("h2o-q8", 24, evict_batch=4, group_size=32),
    "q4-rotated": CacheSpec("h2o-q4", 24, evict_batch=1, group_size=32, dense_recent=0),
    "q4-tail": CacheSpec("h2o-q4", 24, evict_batch=1, group_size=32),  # newest 8 dense
    "k8v4": CacheSpec("h2o-mixed", 24, evict_batch=4, group_size=32),
}
CASES = {"batch-4": SPEC, "one-per-step": OFTEN, **PACKED}
SCORES = ("attn", "ema", "tova")


def held(cache: H2OKVCache) -> dict[str, np.ndarray]:
    """A cache's slots in position order, per head: what it holds, not where. Packed
    K/V come dequantized, with each element's quantization step beside them (the packed
    copies a lone cache's newest tokens still wait for written first:
    cache/policies/quantized.py)."""
    if hasattr(cache, "pack_pending"):
        cache.pack_pending()
    n = cache.size()
    order = mx.argsort(cache.positions[..., :n], axis=-1)

    def in_order(a: mx.array) -> mx.array:
        return mx.take_along_axis(a[:, :, :n], order.reshape(*order.shape, *[1] * (a.ndim - 3)), 2)

    out = {"positions": in_order(cache.positions), "scores": in_order(cache.scores)}
    for name, bits in (
        ("keys", getattr(cache, "bits", 0)),
        ("values", getattr(cache, "value_bits", 0)),
    ):
        buf = getattr(cache, name)
        if isinstance(buf, mx.array):
            out[name] = in_order(buf)
            continue
        words, scales, biases = (in_order(a) for a in buf)
        group = cache.group_size
        out[name] = mx.dequantize(words, scales, biases, group_size=group, bits=bits)
        out[f"{name} step"] = mx.repeat(scales, group, axis=-1)
    if getattr(cache, "counts", None) is not None:  # a merging cache's tokens per slot
        out["counts"] = in_order(cache.counts)
    for name in ("key_center", "sink_keys", "sink_values", "tail_keys", "tail_values"):
        if getattr(cache, name, None) is not None:
            out[name] = getattr(cache, name)
    return {k: np.array(v) for k, v in out.items()}


def assert_holds_the_same(
    mine: H2OKVCache,
    theirs: H2OKVCache,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    contents: bool = True,
    swaps: int = 0,
) -> None:
    """Counters equal, the same positions held per head and, with `contents`, their K/V
    and scores alike (packed K/V: within one quantization step). `swaps`: tokens a head
    may hold in place of others (an eviction near-tie decided apart by packed scores a
    code apart; without `contents`)."""
    assert (mine.offset, mine.evicted, mine.size()) == (
        theirs.offset,
        theirs.evicted,
        theirs.size(),
    )
    a, b = held(mine), held(theirs)
    assert a.keys() == b.keys()
    if swaps:
        assert not contents, "K/V are compared position by position"
        for pa, pb in zip(
            a["positions"].reshape(-1, a["positions"].shape[-1]),
            b["positions"].reshape(-1, b["positions"].shape[-1]),
            strict=True,
        ):
            assert len(set(pa.tolist()) - set(pb.tolist())) <= swaps, (pa, pb)
        return
    np.testing.assert_array_equal(a["positions"], b["positions"])
    for name in a if contents else ():
        if f"{name} step" in a:
            # A key from a batched matmul rounds apart from a one-row one (~1e-7, more
            # after a real model's layers) and can land one code over: never more.
            step = np.maximum(np.abs(a[f"{name} step"]), np.abs(b[f"{name} step"]))
            assert np.all(np.abs(a[name] - b[name]) <= step * 1.01 + atol), name
        else:
            np.testing.assert_allclose(a[name], b[name], atol=atol, rtol=rtol, err_msg=name)


def prefilled(model, spec: CacheSpec, prompt: list[int], with_step: bool = False) -> list:
    """`with_step`: a step owner's caches (`scores_with_step`), as the server's."""
    caches = make_cache(model, spec, scores_with_step=with_step)
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    return caches


@pytest.mark.parametrize("select_writes", [False, True], ids=["scatter", "select"])
@pytest.mark.parametrize("spec", CASES.values(), ids=CASES.keys())
def test_slab_rows_compute_what_each_session_computes_alone(spec, select_writes):
    model = tiny("llama", head_dim=32)
    install_router(model)
    rng = np.random.default_rng(0)
    lengths = [40, 12, 30, 17]  # past max_kv, and short ones that start evicting later
    prompts = [rng.integers(0, 64, n).tolist() for n in lengths]
    fed = rng.integers(0, 64, (len(prompts), 30)).tolist()  # the same tokens both ways
    alone, logits_alone = [], []
    for prompt, tokens in zip(prompts, fed, strict=True):
        caches = prefilled(model, spec, prompt)
        logits_alone.append([model(mx.array([[t]]), cache=caches)[0, -1] for t in tokens])
        alone.append(caches)
    rows = [prefilled(model, spec, p) for p in prompts]
    slab = H2OSlab(slab_key(rows[0]))
    slab.select_writes = select_writes  # how tokens are written: the GPU's way, the CPU's
    slab.join([(n, caches) for n, caches in enumerate(rows[:3])])
    slab.join([(3, rows[3])])  # a second join appends a row
    assert all(c.keys is None for c in rows[0])  # the slab holds the arrays now
    assert (slab.layers[0].tail_keys is not None) == (spec is PACKED["q4-tail"])
    # A packed key one code over (see assert_holds_the_same) moves logits by a few 1e-3
    # (1.3e-3 seen on an H100, where one-row and batched matmuls round apart).
    tol = 5e-3 if spec in PACKED.values() else 1e-4
    for step in range(len(fed[0])):
        column = mx.array([[tokens[step]] for tokens in fed])
        out = model(column, cache=batch_caches([], slab))[:, -1]
        for n in range(len(fed)):
            np.testing.assert_allclose(
                np.array(out[n]), np.array(logits_alone[n][step]), atol=tol, rtol=tol
            )
    for n, caches in enumerate(rows):
        slab.leave(n, caches)
    assert not slab.members and not slab.layers
    for mine, theirs in zip(sum(rows, []), sum(alone, []), strict=True):
        # the scores sum those probabilities: 4e-4 apart on the H100 for packed rows
        assert_holds_the_same(mine, theirs, atol=1e-5 if tol < 1e-3 else 1e-3)
    assert all(c.evicted > 0 for c in sum(rows, []))
    # written back whole: each cache goes on alone as it would have
    for caches, twin in zip(rows, alone, strict=True):
        np.testing.assert_allclose(
            np.array(model(mx.array([[7]]), cache=caches)),
            np.array(model(mx.array([[7]]), cache=twin)),
            atol=tol,
        )


def counted_calls(monkeypatch, cls: type, names: tuple[str, ...]) -> dict[str, list]:
    """Each method's calls, one entry per call, in lists the caller may clear."""
    calls = {name: [] for name in names}
    for name, taken in calls.items():
        real = getattr(cls, name)
        counted = lambda self, *a, real=real, taken=taken: taken.append(1) or real(self, *a)  # noqa: E731
        monkeypatch.setattr(cls, name, counted)
    return calls


COMPILED = {
    **{f"dense-{rule}": CacheSpec("h2o", 24, evict_batch=4, score=rule) for rule in SCORES},
    **{name: PACKED[name] for name in ("q8", "q4-tail", "k8v4")},
}


@pytest.mark.parametrize("spec", COMPILED.values(), ids=COMPILED.keys())
def test_the_compiled_decode_equals_the_op_by_op_one(monkeypatch, spec):
    """Rows store, attend and score in one compiled call per layer (`store_and_attend`),
    or attend and score in one after a compiled store (`attend_decode`, where a GPU serves
    other shapes): the same logits, scores and evictions as the op-by-op path, under
    every kind of rule (sums, decays, the last query's) and packed rows (a sink pool, a
    dense tail), and each is the path taken."""
    model = tiny("llama", head_dim=32)
    install_router(model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (40, 12, 30)]
    fed = rng.integers(0, 64, (len(prompts), 20)).tolist()
    calls = counted_calls(monkeypatch, H2OSlabLayer, ("store_and_attend", "attend_decode"))
    joined = ATTENTION.stores_with_decode
    runs = {}
    for path in ("store_and_attend", "attend_decode", "op by op"):
        monkeypatch.setattr(ATTENTION, "compiled_decode", path != "op by op")
        monkeypatch.setattr(
            ATTENTION, "stores_with_decode", lambda c, p=path: p != "attend_decode" and joined(c)
        )
        rows = [prefilled(model, spec, p, with_step=True) for p in prompts]
        slab = H2OSlab(slab_key(rows[0]))
        slab.join(list(enumerate(rows)))
        outs = []
        for step in range(len(fed[0])):
            column = mx.array([[tokens[step]] for tokens in fed])
            outs.append(model(column, cache=batch_caches([], slab))[:, -1])
        for n, caches in enumerate(rows):
            slab.leave(n, caches)
        runs[path] = (np.array(mx.stack(outs)), rows)
        # one call per layer and step on the path under test, none on the others
        assert {name: len(taken) > 0 for name, taken in calls.items()} == {
            name: name == path for name in calls
        }
        for taken in calls.values():
            taken.clear()
    for path in ("store_and_attend", "attend_decode"):
        np.testing.assert_allclose(runs[path][0], runs["op by op"][0], atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(sum(runs[path][1], []), sum(runs["op by op"][1], []), strict=True):
            assert mine.evicted == theirs.evicted > 0
            assert_holds_the_same(mine, theirs)


# A merging cache is no slab row (the slab holds no counts) but decodes at fixed shapes.
LONE = {**COMPILED, "merge": CacheSpec("h2o-merge", 24, evict_batch=4)}


@pytest.mark.parametrize("spec", LONE.values(), ids=LONE.keys())
def test_a_lone_cache_decodes_every_slot_as_it_would_its_held_ones(monkeypatch, spec):
    """A lone cache at its final size attends every slot, the free ones (and the packed
    copies its pools shadow) masked, so each step has the same shapes: compiled (a packed
    one's token stored in the same call, under a step owner; a merging one's log(count)
    bias read with every slot) or op by op, the same logits, scores, counts and evictions
    as attending the held slots alone, and the compiled call is the path taken once the
    buffers are full."""
    model = tiny("llama", head_dim=32)
    install_router(model)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 64, n).tolist() for n in (40, 12)]  # evicting, then later
    fed = rng.integers(0, 64, 30).tolist()
    calls = counted_calls(monkeypatch, H2OKVCache, ("store_and_attend", "attend_decode"))
    packed = POLICIES[spec.policy].quantized
    runs = {}
    for how in ("with its store", "compiled", "op-by-op", "held slots"):
        monkeypatch.setattr(ATTENTION, "compiled_decode", how in ("with its store", "compiled"))
        if how == "held slots":
            monkeypatch.setattr(H2OKVCache, "_every_slot", lambda self, n: False)
        outs, caches = [], []
        for prompt in prompts:
            cache = prefilled(model, spec, prompt, with_step=how == "with its store")
            outs += [model(mx.array([[t]]), cache=cache)[0, -1] for t in fed]
            caches += cache
        runs[how] = np.array(mx.stack(outs)), caches
        # A dense cache's store is not compiled; a packed tail's step that packs its copies
        # stores apart.
        stored = how == "with its store" and packed
        assert (len(calls["store_and_attend"]) > 0) == stored
        if not stored:
            assert (len(calls["attend_decode"]) > 0) == (how in ("compiled", "with its store"))
        for taken in calls.values():
            taken.clear()
    for how in ("compiled", "op-by-op", "held slots"):
        np.testing.assert_allclose(runs[how][0], runs["with its store"][0], atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(runs["with its store"][1], runs[how][1], strict=True):
            assert mine.evicted == theirs.evicted > 0
            assert_holds_the_same(mine, theirs)


def test_a_member_dropped_or_lent_leaves_the_others_whole():
    model = tiny("llama")
    install_router(model)
    prompts = [[1, 2, 3] * 10, [4, 5] * 7, [6] * 20]
    rows = [prefilled(model, SPEC, p) for p in prompts]
    twins = [prefilled(model, SPEC, p) for p in prompts]
    slab = H2OSlab(slab_key(rows[0]))
    slab.join(list(enumerate(rows)))
    model(mx.array([[9], [9], [9]]), cache=batch_caches([], slab))
    for twin in twins:
        model(mx.array([[9]]), cache=twin)
    slab.lend(2, rows[2])  # a reader sees the row as the cache's own, counters too
    for mine, theirs in zip(rows[2], twins[2], strict=True):
        assert (mine.offset, mine.size(), mine.evicted) == (
            theirs.offset,
            theirs.size(),
            theirs.evicted,
        )
    np.testing.assert_array_equal(held(rows[2][0])["positions"], held(twins[2][0])["positions"])
    slab.leave(1, None)  # cancelled: its row is dropped, the lent views reclaimed
    assert rows[2][0].keys is None and slab.members == [0, 2]
    out = model(mx.array([[8], [8]]), cache=batch_caches([], slab))[:, -1]
    for row, n in enumerate((0, 2)):
        ref = model(mx.array([[8]]), cache=twins[n])[0, -1]
        np.testing.assert_allclose(np.array(out[row]), np.array(ref), atol=1e-4, rtol=1e-4)


def test_who_may_join():
    """H2O caches of one configuration share a key (dense or packed); other layouts (a
    subclass), other sizes or widths, empty caches, packed ones whose sink pool still
    fills and caches near the model's context (they will re-index) do not."""
    model = tiny("llama", head_dim=32, max_position_embeddings=256)  # caches may re-index
    install_router(model)
    a, b = prefilled(model, SPEC, [1, 2, 3]), prefilled(model, SPEC, [4] * 30)
    assert slab_key(a) is not None and slab_key(a) == slab_key(b)
    q8 = prefilled(model, PACKED["q8"], [5] * 10)
    assert slab_key(q8) == slab_key(prefilled(model, PACKED["q8"], [6] * 30)) != slab_key(a)
    assert slab_key(q8) != slab_key(prefilled(model, PACKED["k8v4"], [5] * 10))
    assert q8[0].sink > 1 and slab_key(prefilled(model, PACKED["q8"], [5])) is None  # pool filling
    assert slab_key(prefilled(model, OFTEN, [1, 2])) not in (None, slab_key(a))
    assert slab_key(prefilled(model, CacheSpec("h2o", 32), [1, 2])) != slab_key(a)
    assert slab_key(prefilled(model, CacheSpec("h2o-merge", 24), [1, 2])) is None  # a subclass
    tail = PACKED["q4-tail"]  # joins once its tail holds 8 tokens past the 4 sinks
    assert slab_key(prefilled(model, tail, [6] * 11)) is None
    assert slab_key(prefilled(model, tail, [6] * 12)) == slab_key(prefilled(model, tail, [5] * 30))
    assert slab_key(prefilled(model, tail, [6] * 12)) != slab_key(
        prefilled(model, PACKED["q4-rotated"], [6] * 12)
    )
    assert slab_key(make_cache(model, SPEC)) is None  # nothing stored yet
    assert a[0].wall == 256 and not near_wall(a)
    for c in a:
        c.offset = c.wall - c.wall // 4 - 1
    assert near_wall(a)


def test_a_member_near_its_context_is_found_with_the_tokens_its_caches_do_not_count():
    """A step counts its token in the members' caches only when they are read
    (`count_tokens`); `near_wall` adds the ones not counted yet."""
    model = tiny("llama", head_dim=32, max_position_embeddings=256)  # caches may re-index
    install_router(model)
    rows = [prefilled(model, SPEC, [1, 2, 3] * 10), prefilled(model, SPEC, [4] * 30)]
    near = rows[0][0].wall - rows[0][0].wall // 4  # near_wall at offset + 2 >= near
    for c in rows[0]:
        c.offset = near - 5
    slab = H2OSlab(slab_key(rows[0]))
    slab.join(list(enumerate(rows)))
    for steps in (1, 2, 3):
        model(mx.array([[9], [9]]), cache=batch_caches([], slab))
        assert slab.near_wall(0) == (steps == 3) and not slab.near_wall(1)
    assert rows[0][0].offset == near - 5  # not counted yet: near_wall(rows[0]) would miss it
    slab.count_tokens()
    assert near_wall(rows[0]) and [c.offset for c in rows[0]] == [near - 2] * len(rows[0])


def test_a_slab_refuses_a_prompt_chunk():
    model = tiny("llama")
    install_router(model)
    slab = H2OSlab(None)
    slab.join([("a", prefilled(model, SPEC, [1, 2, 3])), ("b", prefilled(model, SPEC, [4]))])
    with pytest.raises(ValueError, match="one token per row"):
        model(mx.array([[1, 2], [3, 4]]), cache=batch_caches([], slab))
