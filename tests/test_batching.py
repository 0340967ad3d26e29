"""Batched rounds (server/engine/batcher.py) compute what each request would alone.

Real default model. Requests that mix policies, prompt lengths and eviction states
run through the Batcher together and one by one: greedy outputs must be
token-identical, except where the two runs' top tokens are within 1e-4 of a tie
(a batched matmul rounds differently from a one-row one, ~1e-5 in the logits),
and H2O caches must evict the same positions. Quantized caches get 5e-2: that
rounding can move a key across an 8-bit quantization step (~1e-3 in the logits),
which can tip a near-tie in the eviction ranking and keep a different token.
Joining and cancelling mid-batch must not change the others' outputs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_h2o_slab import assert_holds_the_same

import server.engine.batcher as batcher_module
from cache import H2OKVCache, KVarNCache, make_cache
from cache.batching.h2o_slab import slab_key
from cache.factory import dense_layers
from config.cache_spec import CacheSpec
from server.engine.batcher import Batcher
from server.engine.generation import Generation
from server.engine.jobs import Delta, SamplingParams
from server.sessions.store import Session

pytestmark = pytest.mark.slow(seconds=125)

STEPS = 12  # decode steps a request: every event below happens while the others decode
SPECS = {
    "full": CacheSpec("full", 4096),
    "rotating": CacheSpec("rotating", 96),
    "h2o": CacheSpec("h2o", 96),
    "h2o-q8": CacheSpec("h2o-q8", 80),
    "h2o-evicting-often": CacheSpec("h2o", 64, evict_batch=1),
    "h2o-merge": CacheSpec("h2o-merge", 80),
}


@pytest.fixture(scope="module")
def requests(default_model, essay_text):
    """(name, spec, prompt): prompts of different lengths; the H2O ones start past max_kv."""
    _, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    lengths = {
        "full": 40, "rotating": 150, "h2o": 230, "h2o-q8": 90, "h2o-evicting-often": 120,
        "h2o-merge": 200,
    }  # fmt: skip
    return [
        (name, SPECS[name], ids[i * 300 : i * 300 + lengths[name]]) for i, name in enumerate(SPECS)
    ]


@pytest.fixture(scope="module")
def requests_alone(default_model, requests) -> dict:
    """{name: (deltas, generation)} of each request decoded alone (one Batcher, one at a time)."""
    model, tokenizer = default_model
    batcher = Batcher(model, prefill_step=64, prefill_budget=100)
    alone = {}
    for name, spec, prompt in requests:
        g = start(model, tokenizer, spec, prompt)
        alone[name] = (drive(batcher, [g])[id(g)], g)
    return alone


def start(model, tokenizer, spec, prompt) -> Generation:
    session = Session(id="s", spec=spec, keyed=True, caches=make_cache(model, spec))
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=2)
    return Generation(tokenizer, session, prompt, 0, params)


def drive(batcher: Batcher, gens: list[Generation], events: dict | None = None) -> dict:
    """Rounds until every generation is done; events: {round: callable(gens)} may add/remove."""
    out = {id(g): [] for g in gens}
    active, rnd = list(gens), 0
    while active:
        if events and rnd in events:
            active = events[rnd](active, out)
        for g, outcome in batcher.run(active).outcomes:
            assert not isinstance(outcome, Exception), outcome
            out[id(g)].append(outcome)
        active = [g for g in active if not g.done]
        rnd += 1
    return out


def runs_alone(model, tokenizer, runs, prefill_step: int, prefill_budget: int) -> list:
    """(deltas, generation) of each (spec, prompt) decoded by a Batcher of its own."""
    alone = []
    for spec, prompt in runs:
        g = start(model, tokenizer, spec, prompt)
        batcher = Batcher(model, prefill_step=prefill_step, prefill_budget=prefill_budget)
        alone.append((drive(batcher, [g])[id(g)], g))
    return alone


def driven_together(model, tokenizer, spec, prompts, prefill_step: int, budget: int, at: int):
    """Generations of `spec`, one per prompt, driven by one Batcher: (batcher, gens, their
    deltas, [(slab class, members) of its H2O slabs in round `at`])."""
    batcher = Batcher(model, prefill_step=prefill_step, prefill_budget=budget)
    gens = [start(model, tokenizer, spec, prompt) for prompt in prompts]
    seen = []

    def slabs(active, out):
        seen.append([(type(s).__name__, set(s.members)) for s in batcher.h2o_slabs.values()])
        return active

    return batcher, gens, drive(batcher, gens, {at: slabs}), seen


def tokens_and_margins(deltas) -> list[tuple[int, float]]:
    """(token, gap between the two best logprobs) per decoded token."""
    result = []
    for d in deltas:
        lp = d.logprobs[0]
        result.append((lp.token, lp.top[0][1] - lp.top[1][1]))
    return result


def assert_same_greedy(batched, alone, spec: CacheSpec) -> None:
    a, b = tokens_and_margins(batched), tokens_and_margins(alone)
    assert len(a) == len(b) == STEPS
    tie = 5e-2 if spec.info.quantized else 1e-4
    for (ta, gap_a), (tb, gap_b) in zip(a, b, strict=True):
        if ta != tb:  # only a near-tie may flip, and then the rest may differ
            assert min(gap_a, gap_b) < tie, (spec.policy, ta, tb, gap_a, gap_b)
            return


def test_batched_equals_alone(default_model, requests, requests_alone):
    model, tokenizer = default_model
    batcher = Batcher(model, prefill_step=64, prefill_budget=100)
    alone = requests_alone
    gens = {name: start(model, tokenizer, spec, prompt) for name, spec, prompt in requests}
    together = drive(batcher, list(gens.values()))
    compared = 0
    for name, g in gens.items():
        ref_deltas, ref = alone[name]
        assert_same_greedy(together[id(g)], ref_deltas, g.session.spec)
        assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
        if g.generated != ref.generated:
            continue  # a near-tie flipped (checked above): the states may differ from there
        assert g.session.tokens == ref.session.tokens
        for mine, theirs in zip(g.session.caches, ref.session.caches, strict=True):
            if isinstance(mine, H2OKVCache):
                assert mine.evicted == theirs.evicted > 0
                # the same positions held per head; slot order is argpartition's, not a contract
                np.testing.assert_array_equal(
                    np.sort(np.array(mine.positions[..., : mine.size()]), axis=-1),
                    np.sort(np.array(theirs.positions[..., : theirs.size()]), axis=-1),
                )
                if hasattr(mine, "counts"):  # h2o-merge: the same tokens merged alike
                    np.testing.assert_array_equal(
                        np.sort(np.array(mine.counts[..., : mine.size()]), axis=-1),
                        np.sort(np.array(theirs.counts[..., : theirs.size()]), axis=-1),
                    )
                compared += 1
    assert compared >= 2 * len(model.layers)  # at least two H2O requests matched whole


def test_join_and_cancel_leave_the_others_unchanged(default_model, requests, requests_alone):
    model, tokenizer = default_model
    batcher = Batcher(model, prefill_step=64, prefill_budget=100)
    (n1, s1, p1), (_, s2, p2), (_, s3, p3) = requests[:3]
    reference = requests_alone[n1][0]  # the first request alone, on a Batcher like this one

    first = start(model, tokenizer, s1, p1)
    doomed = start(model, tokenizer, s2, p2)
    late = start(model, tokenizer, s3, p3)

    def join(active, out):
        out[id(late)] = []
        return [*active, late]

    def cancel(active, out):
        return [g for g in active if g is not doomed]  # as the worker drops a cancelled job

    out = drive(batcher, [first, doomed], {6: join, 9: cancel})
    assert_same_greedy(out[id(first)], reference, s1)
    assert len(out[id(late)]) == STEPS and 0 < len(out[id(doomed)]) < STEPS
    # the cancelled session is consistent: its caches hold exactly its tokens
    assert all(c.offset == len(doomed.session.tokens) for c in doomed.session.caches)


def test_a_failing_row_fails_alone(default_model, requests):
    model, tokenizer = default_model
    batcher = Batcher(model, prefill_step=64, prefill_budget=100)
    (_, s1, p1), (_, s2, p2) = requests[:2]
    good, bad = start(model, tokenizer, s1, p1), start(model, tokenizer, s2, p2)

    def broken_sampler(logprobs):
        raise RuntimeError("this request's sampler broke")

    bad.sampler = broken_sampler
    failed, deltas = [], 0
    active = [good, bad]
    while active:
        for g, outcome in batcher.run(active).outcomes:
            if isinstance(outcome, Exception):
                failed.append(g)
            else:
                deltas += g is good
        active = [g for g in active if not g.done and g not in failed]
    assert failed == [bad] and deltas == STEPS and good.finish_reason == "length"
    assert good.session.tokens == p1 + good.generated  # every draw was fed, then read


class CountingModel:
    """The model, recording the input shape of every forward pass."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __call__(self, inputs, cache=None):
        self.shapes.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache)


def test_a_round_reads_its_tokens_before_any_prefill(default_model, requests):
    """`decode` hands out last round's draws before `prefill` runs, so the worker can
    send a stream's token without waiting for another request's prompt chunk."""
    model, tokenizer = default_model
    batcher = Batcher(model, prefill_step=64, prefill_budget=64)
    (_, s1, p1), (_, s2, p2) = requests[:2]
    first = start(model, tokenizer, s1, p1)
    while first.prefilling or first.sampled is None:  # prefilled, one draw launched
        batcher.run([first])
    late = start(model, tokenizer, s2, p2)
    waiting = len(late.pending)

    decoded = batcher.decode([first, late])
    assert [g for g, _ in decoded.outcomes] == [first]
    delta = decoded.outcomes[0][1]
    assert isinstance(delta, Delta) and len(delta.logprobs) == 1  # one token read
    assert decoded.decoding == [first]
    assert len(late.pending) == waiting and decoded.prefill_tokens == 0

    filled = batcher.prefill([first, late], decoding=True)
    assert filled.prefill_tokens == 64 and len(late.pending) == waiting - 64  # one chunk
    assert filled.outcomes == [] and first.sampled is not None  # its draw is not read twice


def test_sessions_share_prefill_passes_of_bounded_size(default_model, essay_text):
    """Prompts of unequal lengths and any cache but an evicting quantized one share
    prefill passes (right-padded; each cache stores and attends only its own chunk) up
    to one chunk's padded tokens, and decode what each decodes alone; an H2O cache that
    evicts within its chunk evicts as alone; an evicting quantized one prefills alone
    (kvarn, which evicts nothing, shares)."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    # the h2o 40 one's 59-token first chunk overflows it: it evicts within the shared pass
    specs = [CacheSpec("full", 4096), CacheSpec("kvarn", 4096), CacheSpec("h2o", 40)]
    specs += [CacheSpec("h2o", 96), CacheSpec("h2o-q8", 80)]
    prompts = [ids[:50], ids[400:480], ids[900:960], ids[1200:1400], ids[1600:1640]]
    alone = runs_alone(model, tokenizer, list(zip(specs, prompts, strict=True)), 256, 300)
    batcher = Batcher(model, prefill_step=256, prefill_budget=300)
    batcher.model = counting = CountingModel(model)
    gens = [start(model, tokenizer, s, p) for s, p in zip(specs, prompts, strict=True)]
    out = drive(batcher, gens)
    # nobody decodes in round 1: the first three chunks (49, 79 and 59 tokens, padded to
    # 79: 237 <= 256) share a pass; the fourth (199) would make 4 x 199, so it goes alone;
    # the h2o-q8 one (39) alone after them
    assert counting.shapes[:3] == [(3, 79), (1, 199), (1, 39)]
    for g, spec, (ref, twin) in zip(gens, specs, alone, strict=True):
        assert_same_greedy(out[id(g)], ref, spec)
        assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
        assert g.session.tokens[: len(g.prompt)] == g.prompt
        if g.generated == twin.generated and spec.policy == "h2o":
            for mine, theirs in zip(g.session.caches, twin.session.caches, strict=True):
                assert_holds_the_same(mine, theirs, atol=1e-4, rtol=1e-3)


def test_plain_sessions_share_a_slab_and_get_their_caches_back(default_model, essay_text):
    """Full-cache sessions decode in one KVSlab: outputs and the K/V each session holds
    afterwards match a run alone; joiners, a leaver, a reader between rounds and a row
    too long for the slab's padding bound (it decodes beside the slab) change none of that."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    full = CacheSpec("full", 4096)
    prompts = [ids[:120], ids[300:390], ids[600:700], ids[900:1010], ids[1200:1640]]
    alone = runs_alone(model, tokenizer, [(full, p) for p in prompts], 256, 300)
    batcher = Batcher(model, prefill_step=256, prefill_budget=300)
    gens = [start(model, tokenizer, full, p) for p in prompts]
    first, doomed, late, later, long = gens
    seen = {}

    def join(active, out):
        out[id(late)], out[id(later)] = [], []
        return [*active, late, later]

    def cancel_and_read(active, out):
        assert set(batcher.slab.members) == {first, doomed, late, later}
        batcher.lend()  # as the worker does before a cache-view read
        seen["offsets"] = {c.offset for c in first.session.caches}
        seen["tokens"] = len(first.session.tokens)
        return [g for g in active if g is not doomed]

    def join_long(active, out):
        out[id(long)] = []
        return [*active, long]

    def long_beside_the_slab(active, out):
        assert not long.prefilling and out[id(long)]  # decoding, outside the slab
        assert set(batcher.slab.members) == {first, late, later}
        return active

    # first and doomed decode from round 1, the joiners from round 3; long (440 tokens:
    # 4 x 440 > 2 x the K/V held, it stays out of the slab) prefills from round 6 and has
    # decoded by round 11, when first is still 2 steps from done
    events = {2: join, 5: cancel_and_read, 6: join_long, 11: long_beside_the_slab}
    out = drive(batcher, [first, doomed], events)
    # the reader saw the session whole: its caches held exactly its tokens
    assert seen["offsets"] == {seen["tokens"]}
    assert not batcher.slab.members  # everyone left, their caches written back
    for g, (ref_deltas, ref) in zip(gens, alone, strict=True):
        if g is doomed:
            assert 0 < len(out[id(g)]) < STEPS
            assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
            continue
        assert_same_greedy(out[id(g)], ref_deltas, full)
        assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
        if g.generated == ref.generated:
            for mine, theirs in zip(g.session.caches, ref.session.caches, strict=True):
                k, v = mine.keys_and_values()
                rk, rv = theirs.keys_and_values()
                np.testing.assert_allclose(np.array(k), np.array(rk), atol=1e-4)
                np.testing.assert_allclose(np.array(v), np.array(rv), atol=1e-4)


def test_a_dense_first_session_packs_a_few_layers_a_round_before_its_share(
    default_model, essay_text, monkeypatch
):
    """`auto`'s kvarn starts dense (`dense_until`): nearing that share, the batcher packs
    PACK_LAYERS layers a round, from as many rounds before it as that takes, so no round
    waits for the whole cache's encoding; the session holds only packed layers before it
    passes its share and decodes to the end, and a plain session beside it (the two in
    one KVSlab before) decodes as it does alone."""
    model, tokenizer = default_model
    monkeypatch.setattr(batcher_module, "PACK_LAYERS", 8)
    ids = tokenizer.encode(essay_text)
    full, share = CacheSpec("full", 4096), 108
    dense_first = CacheSpec("kvarn", 4096, dense_until=share)
    [(plain_alone, _)] = runs_alone(model, tokenizer, [(full, ids[300:390])], 256, 300)
    batcher = Batcher(model, prefill_step=256, prefill_budget=300)
    packing = start(model, tokenizer, dense_first, ids[:100])
    plain = start(model, tokenizer, full, ids[300:390])
    seen, slab_rows = [], []

    def watch(active, out):
        seen.append((len(packing.session.tokens), dense_layers(packing.session.caches)))
        slab_rows.append(len(batcher.slab.members))
        return active

    out = drive(batcher, [packing, plain], dict.fromkeys(range(STEPS + 2), watch))
    layers = len(model.layers)
    assert [d for i, (_, d) in enumerate(seen) if i == 0 or d != seen[i - 1][1]] == [
        layers,
        *range(layers - 8, 0, -8),
        0,
    ]  # 30, 22, 14, 6, 0: one round each
    assert all(d == 0 for n, d in seen if n > share)  # packed before it holds more
    assert min(n for n, d in seen if d < layers) > share - 8  # and not long before
    assert max(slab_rows) == 2  # both decoded in the KVSlab while dense
    assert all(type(c) is KVarNCache for c in packing.session.caches)
    assert len(out[id(packing)]) == len(out[id(plain)]) and packing.generated
    assert len(packing.session.tokens) > share
    assert_same_greedy(out[id(plain)], plain_alone, full)


def test_a_prompt_fed_several_chunks_a_round_packs_before_each(
    default_model, essay_text, monkeypatch
):
    """A round's prefill budget may feed one prompt several chunks: the dense-first
    session is packed (PACK_LAYERS a chunk as it nears its share, every layer left
    before the chunk that passes it) before each of them, so it never holds more than
    its share in dense layers."""
    model, tokenizer = default_model
    monkeypatch.setattr(batcher_module, "PACK_LAYERS", 8)
    share = 100
    spec = CacheSpec("kvarn", 4096, dense_until=share)
    held = []
    prefilled = Generation.prefilled

    def watched(self, n: int) -> int:
        out = prefilled(self, n)
        held.append((len(self.session.tokens), dense_layers(self.session.caches)))
        return out

    monkeypatch.setattr(Generation, "prefilled", watched)
    ids = tokenizer.encode(essay_text)
    batcher = Batcher(model, prefill_step=32, prefill_budget=128)  # 4 chunks a round
    plain = start(model, tokenizer, CacheSpec("full", 4096), ids[300:340])  # decoding
    g = start(model, tokenizer, spec, ids[:200])
    rounds = []

    def join(active, out):
        out[id(g)] = []
        return [*active, g]

    def mark(active, out):
        rounds.append(len(held))
        return active

    drive(batcher, [plain], {1: join, **dict.fromkeys(range(2, STEPS), mark)})
    assert [n for n, _ in held[2:]] == [32, 64, 96, 128, 160, 192, 199]  # g's chunks
    assert max(b - a for a, b in itertools.pairwise(rounds)) >= 3  # several in a round
    assert all(d == 0 for n, d in held if n > share), held
    assert any(0 < d < len(model.layers) for _, d in held), held  # a few layers at a time
    assert all(type(c) is KVarNCache for c in g.session.caches)


def test_a_slab_step_builds_its_padding_mask_once_and_matches_mlx_lm(default_model, monkeypatch):
    """One decode step over a left-padded slab: the same logits as mlx-lm's own
    BatchKVCache path, with one padding mask for all layers (not one per layer)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    import cache.batching.batch as batch
    from cache.router import install_router

    model, _ = default_model
    install_router(model)  # as make_cache does: a BatchedCache is attended part by part
    slab = batch.KVSlab()
    slab.layers = [BatchKVCache(left_padding=[0, 3]) for _ in model.layers]
    slab.members = ["a", "b"]
    prompt = mx.array([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])
    model(prompt, cache=slab.layers)
    y = mx.array([[21], [22]])
    direct = model(y, cache=slab.layers)
    for layer in slab.layers:
        layer.trim(1)
    built = []
    create = batch.create_causal_mask
    monkeypatch.setattr(
        batch, "create_causal_mask", lambda *a, **k: built.append(1) or create(*a, **k)
    )
    ours = model(y, cache=batch.batch_caches([], slab))
    assert len(built) == 1
    np.testing.assert_allclose(np.array(ours), np.array(direct), atol=1e-4)


H2O_96, Q8_80 = CacheSpec("h2o", 96), CacheSpec("h2o-q8", 80)


def test_h2o_sessions_share_a_slab_and_match_alone(default_model, essay_text):
    """H2O sessions of one configuration decode as rows of an H2OSlab, packed h2o-q8
    ones in a slab of their own: outputs, and afterwards the positions, K/V and
    scores each session holds, match a run alone; a reader between rounds, a cancelled
    row and a joiner change none of that."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    # two past max_kv (evicting from the first step), one short (88 + STEPS > 96: evicts
    # mid-run), and two packed ones: a slab of their own
    runs = [(H2O_96, ids[:230]), (H2O_96, ids[300:388]), (H2O_96, ids[600:780]),
            (Q8_80, ids[900:1020]), (Q8_80, ids[1200:1300]), (H2O_96, ids[1500:1700])]  # fmt: skip
    alone = runs_alone(model, tokenizer, runs, 64, 100)
    batcher = Batcher(model, prefill_step=64, prefill_budget=300)
    gens = [start(model, tokenizer, spec, prompt) for spec, prompt in runs]
    first, short, doomed, packed, packed2, late = gens
    seen = {}

    def join(active, out):
        out[id(late)] = []
        return [*active, late]

    def cancel_and_read(active, out):
        slabs = list(batcher.h2o_slabs.values())
        assert sorted(s.rows for s in slabs) == [2, 3]
        key = slab_key(alone[0][1].session.caches)  # H2O_96's, from a session alone
        assert set(batcher.h2o_slabs[key].members) == {first, short, doomed}
        batcher.lend()  # as the worker does before a cache-view read
        seen["offsets"] = {c.offset for c in first.session.caches}
        seen["sizes"] = {c.size() for c in first.session.caches}
        seen["tokens"] = len(first.session.tokens)
        return [g for g in active if g is not doomed]

    # slabs form in round 3; the joiner decodes in the slab from round 9, the others to ~14
    out = drive(batcher, [first, short, doomed, packed, packed2], {6: cancel_and_read, 8: join})
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
            # Packed: a key a code over (see the module doc) changes the next tokens' K/V
            # by more than rounding, and its scores with them: the same positions held,
            # but for a near-tie an eviction may decide apart (one token per head; seen
            # with single-threaded OpenBLAS, whose batched products round apart).
            if g.session.spec.info.quantized:
                assert_holds_the_same(mine, theirs, contents=False, swaps=1)
            else:
                assert_holds_the_same(mine, theirs, atol=1e-4)
            compared += 1
    assert compared >= 3 * len(model.layers)
    assert all(c.evicted > 0 for g in gens if g is not doomed for c in g.session.caches)


def test_h2o_q4_sessions_keep_their_dense_tail_in_a_slab(default_model, essay_text):
    """h2o-q4 sessions (rotated, their newest tokens dense) share a slab once their tails
    are full, and decode there what they decode alone; their tails come back whole."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    spec = CacheSpec("h2o-q4", 80)
    runs = [ids[:150], ids[400:520], ids[800:1000]]
    alone = runs_alone(model, tokenizer, [(spec, p) for p in runs], 64, 100)
    batcher = Batcher(model, prefill_step=64, prefill_budget=300)
    gens = [start(model, tokenizer, spec, prompt) for prompt in runs]
    rows = []
    out = drive(batcher, gens, {8: lambda active, out: rows.append(
        [s.rows for s in batcher.h2o_slabs.values()]) or active})  # fmt: skip
    assert rows == [[3]]  # one slab, every session a row
    assert not any(s.members for s in batcher.h2o_slabs.values())  # left, written back
    compared = 0
    for g, (ref_deltas, ref) in zip(gens, alone, strict=True):
        assert_same_greedy(out[id(g)], ref_deltas, spec)
        for mine, theirs in zip(g.session.caches, ref.session.caches, strict=True):
            assert mine.tail == 16 and mine.tail_len == theirs.tail_len == 16
            if g.generated == ref.generated:  # (a near-tie may flip a packed session)
                assert_holds_the_same(mine, theirs, atol=1e-4, contents=False)
                np.testing.assert_allclose(
                    np.array(mine.tail_values), np.array(theirs.tail_values), atol=1e-3
                )
                compared += 1
    assert compared >= 2 * len(model.layers)


def test_a_slab_member_near_its_context_leaves_and_re_indexes_alone(default_model, essay_text):
    """Re-indexing runs alone: a member whose RoPE positions near the model's context
    leaves the slab (its caches written back whole) and goes on decoding outside it."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    batcher = Batcher(model, prefill_step=64, prefill_budget=300)
    near, other = (start(model, tokenizer, H2O_96, ids[n : n + 120]) for n in (0, 500))
    seen = {}

    def shrink_the_context(active, out):
        assert near in next(iter(batcher.h2o_slabs.values()))
        wall = near.session.caches[0].offset + 6  # it is due to re-index at once
        for c in near.session.caches:
            c.wall = wall
        return active

    def check(active, out):
        seen["slabs"] = dict(batcher.h2o_slabs)
        return active

    out = drive(batcher, [near, other], {6: shrink_the_context, 8: check})
    assert seen["slabs"] == {}  # it left; a slab of one is dissolved too
    assert len(out[id(near)]) == len(out[id(other)]) == STEPS
    assert all(c.lags is not None for c in near.session.caches)  # re-indexed, alone
    assert all(c.seen == len(near.session.tokens) for c in near.session.caches)


def test_h2o_kvarn_sessions_of_one_size_share_a_slab_and_match_alone(default_model, essay_text):
    """h2o-kvarn sessions holding equally many tokens decode as the rows of one KVarNSlab
    (cache/batching/kvarn_slab.py), across a tile packed and an eviction re-packed, and match a run
    alone; a session holding another count decodes beside it."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    spec = CacheSpec("h2o-kvarn", 96)  # 32-token tiles, a tile's worth evicted at a time
    # 217 tokens in 64-token chunks leave 90 held (evicting mid-run); 100 leave 65
    runs = [ids[:217], ids[400:617], ids[800:900]]
    alone = runs_alone(model, tokenizer, [(spec, p) for p in runs], 64, 100)
    batcher, gens, out, seen = driven_together(model, tokenizer, spec, runs, 64, 300, 6)
    assert seen == [[("KVarNSlab", set(gens[:2]))]]
    assert not any(s.members for s in batcher.h2o_slabs.values())  # left, written back
    compared = 0
    for g, (ref_deltas, ref) in zip(gens, alone, strict=True):
        assert_same_greedy(out[id(g)], ref_deltas, spec)
        assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
        for mine, theirs in zip(g.session.caches, ref.session.caches, strict=True):
            assert (mine.evicted, mine.size(), mine.n_tail) == (
                theirs.evicted, theirs.size(), theirs.n_tail,
            )  # fmt: skip
            if g.generated == ref.generated:  # (a near-tie may flip a packed session)
                # one token a head may differ: an eviction's near-tie decided apart by
                # scores that a batched matmul rounded apart (as packed H2O slabs)
                a, b = (np.sort(np.array(c.positions), axis=-1) for c in (mine, theirs))
                assert (a != b).sum(-1).max() <= 1
                compared += 1
    assert compared >= 2 * len(model.layers)
    assert all(c.evicted > 0 for g in gens[:2] for c in g.session.caches)


def test_kvarn_sessions_of_any_length_share_a_padded_slab_and_match_alone(
    default_model, essay_text
):
    """kvarn sessions holding different counts (under the sink, a tail about to pack, two
    tiles) decode as the rows of one KVarNPaddedSlab (cache/batching/kvarn_padded.py) and match a
    run alone; each gets its caches back as alone."""
    model, tokenizer = default_model
    ids = tokenizer.encode(essay_text)
    spec = CacheSpec("kvarn", 4096)
    runs = [ids[:90], ids[400:650], ids[900:1290]]  # 0, 0 (tail packs mid-run), 2 tiles
    alone = runs_alone(model, tokenizer, [(spec, p) for p in runs], 128, 400)
    batcher, gens, out, seen = driven_together(model, tokenizer, spec, runs, 128, 400, 8)
    assert seen == [[("KVarNPaddedSlab", set(gens))]]
    assert not any(s.members for s in batcher.h2o_slabs.values())  # left, written back
    for g, (ref_deltas, ref) in zip(gens, alone, strict=True):
        assert_same_greedy(out[id(g)], ref_deltas, spec)
        for mine, theirs in zip(g.session.caches, ref.session.caches, strict=True):
            assert mine.offset == len(g.session.tokens)
            assert (mine.n_front, mine.n_tiles(), mine.n_tail, mine.nbytes) == (
                theirs.n_front, theirs.n_tiles(), theirs.n_tail, theirs.nbytes,
            )  # fmt: skip
    assert gens[1].session.caches[0].n_tiles() == 1  # its tail packed in the slab
