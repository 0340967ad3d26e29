"""Speculative decoding under each cache policy (tests/test_speculation.py has the drafts,
the accept rule and the server): a greedy reply decoded with drafts is the one without,
and what each cache holds after it too, alone (dense, packed, merging, recall, pooled
H2O, kvarn, auto's dense-first session) and in a batch whose rows verify different
counts in one pass."""

from __future__ import annotations

import mlx.core as mx
import pytest
from decoding import (
    FULL,
    decode,
    decode_together,
    document_prompt,
    document_reply,
    feed_every_draft,
)

from cache import make_cache
from config.cache_spec import CacheSpec
from server.engine.batcher import Batcher

pytestmark = pytest.mark.slow(seconds=120)


@pytest.fixture(scope="module")
def plain_reply(default_model, essay_text):
    return document_reply(default_model, essay_text)


def test_dense_first_session_speculates_then_packs(default_model, plain_reply):
    """auto's kvarn holds a conversation dense until its share, then packs it a few layers
    a round: speculation stops short of the share, and the reply is the same."""
    model, tokenizer = default_model
    prompt, _ = plain_reply
    spec = CacheSpec("kvarn", 4096, dense_until=len(prompt) + 30)
    plain = decode(model, tokenizer, prompt, spec)
    drafted = decode(model, tokenizer, prompt, spec, draft_max=12)
    assert drafted[0] == plain[0]
    g = drafted[3]
    assert g.drafter.accepted > 0
    assert not any(type(c).__name__ == "KVCache" for c in g.session.caches)  # packed


def same_reply_in_fewer_passes(
    model, tokenizer, prompt, spec, max_tokens, logprobs_abs, accepts=10, passes=0.8
):
    """(without drafts, with drafts): the Generations of one greedy reply decoded both
    ways under `spec`, checked to be the same reply (logprobs within `logprobs_abs`), the
    drafted one with more than `accepts` drafts taken, in under `passes` times the passes."""
    plain = decode(model, tokenizer, prompt, spec, max_tokens=max_tokens)
    drafted = decode(model, tokenizer, prompt, spec, draft_max=12, max_tokens=max_tokens)
    assert drafted[0] == plain[0]
    assert drafted[1] == pytest.approx(plain[1], abs=logprobs_abs)
    accepted = drafted[3].drafter.accepted
    assert accepted > accepts and drafted[2] < passes * plain[2], (accepted, drafted[2])
    return plain[3], drafted[3]


def held_tokens(cache) -> mx.array:
    """What each slot holds, comparable across slot orders: its position, and where the
    heads share one pool (h2o-ada), its head too."""
    held = cache.positions[..., : cache.used]
    if getattr(cache, "heads", None) is None:
        return held
    return held * cache.n_heads + cache.heads[..., : cache.used].astype(mx.int32)


@pytest.mark.parametrize("policy", ["h2o", "h2o-merge", "h2o-recall", "h2o-ada"])
def test_an_evicting_h2o_cache_speculates_and_ends_as_without_drafts(
    default_model, plain_reply, policy
):
    """Dense H2O under eviction (and H2O that merges what it evicts, archives it for a
    later prompt to recall, or whose heads share one pool): drafts stop short of the next
    eviction, refused tokens leave no K/V, score, merge or eviction behind; the reply, and
    the tokens each head holds with their scores, are the ones decoding without drafts
    gives."""
    model, tokenizer = default_model
    prompt, _ = plain_reply
    spec = CacheSpec(policy, 128)  # the prompt alone passes it: every reply token evicts
    # Recall brings prompt tokens back and the reply copies less: 5 of 18 drafts taken.
    fewer = dict(accepts=3, passes=0.95) if policy == "h2o-recall" else {}
    plain, g = same_reply_in_fewer_passes(model, tokenizer, prompt, spec, 64, 1e-3, **fewer)
    for mine, theirs in zip(g.session.caches, plain.session.caches, strict=True):
        assert mine.seen == theirs.seen == len(g.session.tokens)
        assert mine.evicted == theirs.evicted > len(prompt) - 128
        held = [mx.sort(held_tokens(c), axis=-1) for c in (mine, theirs)]
        assert mx.array_equal(*held).item()
        order = [mx.argsort(held_tokens(c), axis=-1) for c in (mine, theirs)]
        scores = [
            mx.take_along_axis(c.scores[..., : c.used], o, axis=-1)
            for c, o in zip((mine, theirs), order, strict=True)
        ]
        assert mx.allclose(*scores, rtol=1e-3, atol=1e-4).item()
        if policy == "h2o-merge":  # each slot stands for as many tokens
            counts = [
                mx.take_along_axis(c.counts[..., : c.used], o, axis=-1)
                for c, o in zip((mine, theirs), order, strict=True)
            ]
            assert mx.array_equal(*counts).item()
        if policy == "h2o-recall":  # what it evicted waits in the archive
            archived = [mx.sort(c.archived_positions, axis=-1) for c in (mine, theirs)]
            assert mx.array_equal(*archived).item()


@pytest.mark.parametrize("policy, logprobs_abs", [("h2o-q8", 0.1), ("h2o-mixed", 0.4)])
def test_a_packed_h2o_cache_speculates_under_eviction(
    default_model, plain_reply, policy, logprobs_abs
):
    """H2O over 8-bit K/V (and keys 8, values 4): a draft's tokens are packed into the
    newest slots and given back as dense H2O's are. A verify pass computes its tokens' K/V
    in one matmul, not one by one: ulp-level differences that packing can round a code
    apart (a 4-bit value's step is a 15th of its group's range), so logprobs moved by up
    to 0.06 (q8) and 0.29 (k8v4) when measured, and a near-tie eviction may pick another
    token (2 of 10,980 held slots); the reply is the same."""
    model, tokenizer = default_model
    prompt, _ = plain_reply
    spec = CacheSpec(policy, 128)
    plain, g = same_reply_in_fewer_passes(model, tokenizer, prompt, spec, 64, logprobs_abs)
    held = differ = 0
    for mine, theirs in zip(g.session.caches, plain.session.caches, strict=True):
        assert type(mine).__name__ == "QuantizedH2OKVCache"
        assert mine.seen == theirs.seen == len(g.session.tokens)
        assert mine.evicted == theirs.evicted > len(prompt) - 128
        pos = [c.positions[0, :, : c.used].tolist() for c in (mine, theirs)]
        for a, b in zip(*pos, strict=True):
            held, differ = held + len(a), differ + len(set(a) - set(b))
    assert differ <= held // 1000, (differ, held)


def test_packed_h2o_with_a_dense_tail_decodes_a_token_a_pass(default_model):
    """h2o-q4 keeps its newest tokens dense too: a verify pass's early queries would read
    packed what one-by-one decoding reads dense, so it takes no draft; without the tail
    it does."""
    model, _ = default_model
    for dense_recent, takes in [(None, False), (0, True)]:
        spec = CacheSpec("h2o-q4", 128, dense_recent=dense_recent)
        caches = make_cache(model, spec)
        caches[0].update_and_fetch(*[mx.zeros((1, 3, 8, 64))] * 2)
        assert all(c.verifies_drafts is takes for c in caches)
        assert (caches[0].draft_room() > 0) is takes


def test_a_packed_kvarn_cache_speculates_between_its_tiles(default_model, plain_reply):
    """kvarn from the first token (auto's cache past its dense share): drafts stay in the
    dense tail and are trimmed from it; the token that fills a tile packs it in a pass of
    its own, so the tiles, the tail and the reply are the ones without drafts."""
    model, tokenizer = default_model
    prompt, _ = plain_reply
    spec = CacheSpec("kvarn", 4096)
    # A verify pass computes its tokens' K/V in one matmul, not one by one: ulp-level
    # differences, which packing a tile at 4/2 bits can round a code apart (1e-2 to 7e-2
    # here, by which tokens came in a verify pass).
    plain, g = same_reply_in_fewer_passes(model, tokenizer, prompt, spec, 96, 0.1)
    for mine, theirs in zip(g.session.caches, plain.session.caches, strict=True):
        assert type(mine).__name__ == "KVarNCache"
        assert (mine.n_tiles(), mine.n_tail) == (theirs.n_tiles(), theirs.n_tail)
        assert mine.offset == len(g.session.tokens)
    # The reply crossed a tile: one was packed while it decoded.
    assert plain.session.caches[0].n_tiles() * 128 + 128 > len(prompt)


def test_a_batch_of_four_verifies_each_rows_drafts(default_model, essay_text, monkeypatch):
    """Four sessions decoding together, two of which copy a document (one under an
    evicting H2O cache) and two chat (an H2O slab of their own): the copying rows verify
    drafts in the batch's pass, each taking its own count, while the others feed a token
    each from their slab; every reply is the one it gets alone without drafts."""
    model, tokenizer = default_model
    h2o = CacheSpec("h2o", 128)

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    rows = [
        (document_prompt(tokenizer, essay_text), FULL, 48),
        (document_prompt(tokenizer, essay_text), h2o, 64),
        (chat("Write one paragraph about cities."), h2o, 32),
        (chat("Name three colours and say why you like them."), h2o, 36),
    ]
    alone = [decode(model, tokenizer, prompt, spec, max_tokens=n) for prompt, spec, n in rows]
    plain, plain_passes = decode_together(model, tokenizer, rows, draft_max=0)
    slab_rows = []  # per verify pass: the rows that fed one token from an H2O slab
    verify = Batcher._verify_drafts

    def spied(self, *args):
        verify(self, *args)
        slab_rows.append(sum(slab.rows for slab in self.h2o_slabs.values()))

    monkeypatch.setattr(Batcher, "_verify_drafts", spied)
    drafted, passes = decode_together(model, tokenizer, rows, draft_max=12)
    assert max(slab_rows) >= 2, slab_rows  # the chatting rows, beside a drafting one
    for g, p, (tokens, logprobs, *_) in zip(drafted, plain, alone, strict=True):
        assert g.generated == p.generated == tokens
        assert g.logprobs == pytest.approx(logprobs, abs=1e-3)
    accepted = [g.drafter.accepted for g in drafted]
    assert accepted[0] > 10 and accepted[1] > 0 and accepted[0] != accepted[1], accepted
    assert passes < 0.85 * plain_passes, (passes, plain_passes)
    # the H2O rows hold what they hold alone: nothing refused stayed behind
    for g, (*_, own) in zip(drafted[1:], alone[1:], strict=True):
        for mine, theirs in zip(g.session.caches, own.session.caches, strict=True):
            assert (mine.seen, mine.evicted) == (theirs.seen, theirs.evicted)


def test_rows_of_other_policies_verify_their_drafts_in_one_pass(
    default_model, essay_text, monkeypatch
):
    """Three rows copying a document under H2O whose heads share a pool, H2O that
    archives what it evicts, and H2O over 8-bit K/V, decoding together, every draft found
    fed (the gate would let few through in a pass of three at 40 tokens): each row
    verifies its own in the batch's pass and ends with the reply it decodes alone
    without drafts."""
    model, tokenizer = default_model
    prompt = document_prompt(tokenizer, essay_text)
    policies = {"h2o-ada": 1e-3, "h2o-recall": 1e-3, "h2o-q8": 0.1}  # logprobs within
    rows = [(prompt, CacheSpec(policy, 128), 40) for policy in policies]
    alone = [decode(model, tokenizer, prompt, spec, max_tokens=n) for prompt, spec, n in rows]
    feed_every_draft(monkeypatch)
    drafted, passes = decode_together(model, tokenizer, rows, draft_max=12)
    for g, (tokens, logprobs, *_), tolerance in zip(drafted, alone, policies.values(), strict=True):
        assert g.generated == tokens
        assert g.logprobs == pytest.approx(logprobs, abs=tolerance)
        assert g.drafter.accepted > 0, g.session.spec.policy
    assert passes < 41, passes  # 41 without drafts: the prompt's last token, then 40
