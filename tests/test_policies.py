"""Every policy record (config/policies.py) through what the server does with it.

One test per record, on the default model: build its caches (make_cache), feed a prompt
long enough that bounded caches evict and h2o-recall's archive fills, price them (the
budget's price is what they hold), spill and restore them through the server's spill
folder (the next decode steps' logits equal the uninterrupted caches'), decode two
sessions in one batched pass (and in one slab where the record says so), and render
the cache view. A policy added as a record plus its class is covered here at once.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from cache import install_router, make_cache
from cache.batching.batch import batch_caches, open_h2o_slab
from cache.batching.h2o_slab import slab_key
from cache.budget import session_bytes
from cache.contract import LayerCache, cache_class, layer_contents, tokens_seen
from cache.factory import adopt, dense_layers, pack_dense, spec_as_held
from cache.policies.full import plain
from config.cache_spec import RECALL_ARCHIVE, CacheSpec
from config.policies import POLICIES, VIEW_KINDS
from models.shape import kv_shape
from server.api.cache_view import SessionContents, cache_report
from server.sessions.prefixes import PrefixStore
from server.sessions.spill import SpillFolder

MAX_KV = 32
# Enough that a bounded cache evicts (MAX_KV) and h2o-recall's archive (RECALL_ARCHIVE x
# MAX_KV evicted tokens per head) is full: every cache is at its priced size.
PROMPT = MAX_KV * (RECALL_ARCHIVE + 2)
STEPS = 3  # decode steps compared after a restore: an eviction among them (evict batch 2)


def prompt_ids(tokenizer, essay_text: str, n: int, offset: int = 0) -> list[int]:
    return tokenizer.encode(essay_text)[offset : offset + n]


def prefill(model, caches: list, ids: list[int], chunk: int = 64) -> mx.array:
    """The prompt in chunks, as the server prefills; the last position's logits."""
    for start in range(0, len(ids), chunk):
        logits = model(mx.array([ids[start : start + chunk]]), cache=caches)
    return logits[0, -1]


def step(model, caches, token: int) -> mx.array:
    return model(mx.array([[token]]), cache=caches)[0, -1]


@pytest.fixture(scope="module")
def walk(default_model, essay_text):
    model, tokenizer = default_model
    install_router(model)  # batched passes attend part by part through it, as the server's
    return model, tokenizer, prompt_ids(tokenizer, essay_text, PROMPT)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_policy_record_walks_through_the_server(policy, walk, tmp_path):
    model, tokenizer, ids = walk
    spec = CacheSpec(policy, MAX_KV)
    info = spec.info

    # built by the record's class (h2o-mixed's builds its default layout, k8v4, as a
    # packed cache), every layer speaking the contract
    caches = make_cache(model, spec)
    built = type(cache_class(info).from_spec(spec))
    assert all(type(c) is built for c in caches)
    assert all(isinstance(c, LayerCache) for c in caches)
    logits = prefill(model, caches, ids)
    token = int(mx.argmax(logits))
    assert {tokens_seen(c) for c in caches} == {len(ids)}

    # priced: what the budget charges is what the caches hold (KVarN tiles: at most, since
    # an eviction frees whole tiles until the next ones fill)
    held = sum(c.nbytes for c in caches)
    shape = kv_shape(model)
    priced = session_bytes(shape, spec if info.bounded else spec.replace(max_kv=len(ids)))
    tiled = info.bounded and "kvarn" in info.knobs
    assert held <= priced if tiled else held == priced, (held, priced)

    # spilled and restored: the next steps (an eviction among them) as if never spilled
    folder = SpillFolder(tmp_path, "identity", budget=2**30, max_files=8)
    path = tmp_path / f"{policy}.safetensors"
    folder.write(path, caches, {"spec": spec.as_dict()})
    restored = folder.read(path, len(ids))
    adopt(restored, make_cache(model, spec))
    assert [type(c) for c in restored] == [type(c) for c in caches]
    for _ in range(STEPS):
        want, got = step(model, caches, token), step(model, restored, token)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=0)
        token = int(mx.argmax(want))

    # forked from the prefix store (server/sessions/prefixes.py): the next steps as the
    # caches it copied, and the stored copy untouched by either side's steps
    store = PrefixStore(2**40)
    assert store.keep("", spec, list(range(tokens_seen(caches[0]))), caches)
    forked = store.fork(store.entries[0])
    adopt(forked, make_cache(model, spec))
    first_token, wants = token, []
    for _ in range(STEPS):
        want, got = step(model, caches, token), step(model, forked, token)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=0)
        token = int(mx.argmax(want))
        wants.append(want)
    late = store.fork(store.entries[0])  # after both moved on
    adopt(late, make_cache(model, spec))
    np.testing.assert_allclose(
        np.array(step(model, late, first_token)), np.array(wants[0]), atol=1e-4, rtol=0
    )

    # batched: two sessions in one forward pass, each as it would decode alone
    other = make_cache(model, spec)
    other_token = int(mx.argmax(prefill(model, other, ids[: PROMPT // 2])))
    pair = copy.deepcopy(caches), copy.deepcopy(other)
    alone = [step(model, caches, token), step(model, other, other_token)]
    inputs = mx.array([[token], [other_token]])
    batched = model(inputs, cache=batch_caches(list(pair)))[:, -1]
    # A two-row matmul may round apart from a one-row one (OpenBLAS's kernels for AMD EPYC
    # do), and a packed key that lands one code over moves the logits by up to a few 1e-2
    # (0.04 seen, h2o-mixed); a row mixed up with another moves them by whole units.
    tol = 5e-2 if info.quantized else 1e-4
    for row, want in enumerate(alone):
        np.testing.assert_allclose(np.array(batched[row]), np.array(want), atol=tol, rtol=0)
    # in one H2O slab where the record says the policy batches there
    key = slab_key(caches)
    assert (key is not None) == info.slab
    if info.slab:
        # h2o-kvarn rows share a slab only holding equally many tokens: a twin then
        rows = (pair[0], pair[1] if slab_key(pair[1]) == key else pair[0])
        slab_rows, apart = ([copy.deepcopy(c) for c in rows] for _ in range(2))
        slab = open_h2o_slab(key)
        slab.join([("a", slab_rows[0]), ("b", slab_rows[1])])
        nxt = [int(mx.argmax(x)) for x in batched]
        in_slab = model(mx.array([[nxt[0]], [nxt[1]]]), cache=batch_caches([], slab))[:, -1]
        want = model(mx.array([[nxt[0]], [nxt[1]]]), cache=batch_caches(apart))[:, -1]
        np.testing.assert_allclose(np.array(in_slab), np.array(want), atol=1e-4, rtol=0)

    # the cache view: what each layer holds, rendered as the endpoint does
    layers = [x for x in map(layer_contents, caches) if x is not None]
    assert len(layers) == len(caches) and {x.kind for x in layers} <= set(VIEW_KINDS)
    stats = {"id": "walk", "policy": policy, "max_kv": MAX_KV, "preset": spec.preset,
             "score": spec.score, "logical_tokens": tokens_seen(caches[0]),
             "stored_tokens": caches[0].size(), "bytes": held, "evictions": 0,
             "spilled": False, "busy": False, "last_used": 0}  # fmt: skip
    seen = tokens_seen(caches[0])
    report = cache_report(SessionContents(stats, list(range(seen)), layers, []), tokenizer)
    assert report.layers == len(caches) and len(report.heads) == len(caches) * shape.kv_heads
    per_head = [h for x in layers for h in x.positions]
    assert [h.held for h in report.heads] == [len(h) for h in per_head]
    for layer in layers:  # heads of a pooled layer (h2o-ada) share its slots
        limit = (MAX_KV + 1 if info.bounded else seen) * shape.kv_heads
        assert sum(len(h) for h in layer.positions) <= limit


PRODUCT = ("config", "cache", "models", "server")  # the floors that know policies
RECORDS = Path("config/policies.py")


def test_policy_names_live_in_their_records():
    """A policy name as a string in product code: its record, and at most one more file
    (where its class needs it). Spec field names that are spelt like a policy (`kvarn`,
    CacheSpec's KVarN preset) are fields, not policies."""
    root = Path(__file__).resolve().parents[1]
    fields = set(CacheSpec.__dataclass_fields__)
    where: dict[str, set[Path]] = {name: set() for name in POLICIES if name not in fields}
    for folder in PRODUCT:
        for path in (root / folder).rglob("*.py"):
            rel = path.relative_to(root)
            if rel == RECORDS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in where:
                    where[node.value].add(rel)
    assert all(len(files) <= 1 for files in where.values()), where


def test_no_cache_is_asked_what_it_has():
    """Callers use the cache contract (cache/contract.py), never hasattr on a cache."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for folder in ("cache", "server"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "hasattr":
                    arg = node.args[0]
                    name = getattr(arg, "id", getattr(arg, "attr", ""))
                    if "cache" in name or name in ("c", "part", "s"):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_a_half_packed_session_spills_restores_and_forks_as_it_is(walk, tmp_path):
    """A dense-first kvarn session (`auto`'s) that the batcher has packed part of, a few
    layers a round (pack_dense(layers=)), spills and restores, and forks from the prefix
    store, each layer in its own class and adopting from spec_as_held's caches: the next
    steps as the caches it held, and the rest packs after as before."""
    model, _, ids = walk
    spec = CacheSpec("kvarn", 4096, dense_until=len(ids) + 8)
    caches = make_cache(model, spec)
    token = int(mx.argmax(prefill(model, caches, ids)))
    caches = pack_dense(caches, make_cache(model, spec.replace(dense_until=0)), layers=4)
    kinds = [type(c) for c in caches]
    assert len(set(kinds)) == 2 and dense_layers(caches) == len(caches) - 4

    folder = SpillFolder(tmp_path, "identity", budget=2**30, max_files=8)
    path = tmp_path / "half.safetensors"
    folder.write(path, caches, {"spec": spec.as_dict()})
    restored = folder.read(path, len(ids))
    # as the server's store does: fresh caches of a step owner's (scores_with_step)
    adopt(restored, make_cache(model, spec_as_held(spec, restored), scores_with_step=True))
    store = PrefixStore(2**40)
    assert store.keep("", spec, list(range(len(ids))), caches)
    forked = store.fork(store.entries[0])
    adopt(forked, make_cache(model, spec_as_held(spec, forked), scores_with_step=True))
    assert [type(c) for c in restored] == [type(c) for c in forked] == kinds
    packed = [c for c in (*restored, *forked) if not plain(c)]
    assert packed and all(c.scores_with_step for c in packed)  # adopted from their own kind
    for _ in range(STEPS):
        want = step(model, caches, token)
        for other in (restored, forked):
            got = step(model, other, token)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=0)
        token = int(mx.argmax(want))
    for held in (caches, restored, forked):
        rest = pack_dense(held, make_cache(model, spec.replace(dense_until=0)))
        assert dense_layers(rest) == 0
