"""Speculative decoding in every model family the server serves (tests/families.py: tiny
random-weight mlx-lm models, float32).

A reply that repeats its prompt's pattern is decoded greedily through the batcher with
every draft the lookup finds fed (the gate forced open): it must be token for token the
reply without drafts, under the default policy (`auto`) and under evicting H2O. Attention
layers give a refused draft back (mlx-lm's KVCache, the server's sliding windows and H2O
caches); a recurrent state cannot take a token back, so where a family has one and a
draft was refused, every layer goes back to before the pass and the kept tokens are fed
again (one pass more).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from decoding import decode, feed_every_draft
from families import FAMILIES, VOCAB, build
from word_tokenizer import word_level

from cache.budget import Budget, fit_spec
from cache.contract import draft_room
from cache.factory import make_cache
from cache.router import uninstall_router
from config.cache_spec import CacheSpec
from config.policies import AUTO
from models.shape import kv_shape
from server.engine.generation import Generation

pytestmark = pytest.mark.slow(seconds=60)

PROMPT = list(range(3, 15)) * 3  # 36 tokens: past every tiny window (8) and max_kv 24
TOKENS = 24
# Families with recurrent layers (linear attention, SSM, short convolutions).
RECURRENT = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h",
             "granitemoehybrid", "lfm2"}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return word_level(VOCAB)


@pytest.mark.parametrize("policy", ["auto", "h2o"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_reply_is_the_same_with_drafts(family, policy, tokenizer, monkeypatch):
    model = build(family)
    if policy == AUTO:  # what the server picks with room for the whole conversation
        spec = fit_spec(kv_shape(model), Budget(2**30, 1), AUTO, group_size=32)
    else:
        # Evicting 6 at a time: after each eviction, drafts of up to 6 fit before the next.
        spec = CacheSpec(policy, 24, group_size=32, evict_batch=6)
    try:
        caches = make_cache(model, spec)
    except ValueError as e:  # a policy the family refuses up front (tests/test_families.py)
        pytest.skip(f"{family} refuses {policy}: {e}")
    model(mx.array([PROMPT]), cache=caches)
    uninstall_router(model)
    assert draft_room(caches) > 0, [type(c).__name__ for c in caches]
    plain = decode(model, tokenizer, PROMPT, spec, max_tokens=TOKENS)
    feed_every_draft(monkeypatch)
    replays = []
    replay = Generation._replay
    monkeypatch.setattr(
        Generation,
        "_replay",
        lambda g, m, again, n: replays.append(again) or replay(g, m, again, n),
    )
    drafted = decode(model, tokenizer, PROMPT, spec, draft_max=6, max_tokens=TOKENS)
    assert drafted[0] == plain[0]
    # Decoding alone, an evicting H2O layer at its final size attends in one compiled call;
    # a verify pass attends op by op: ulp-level differences, which these random weights
    # amplify up to 0.03 in a logprob (gemma4_text under h2o; 0 without eviction).
    assert drafted[1] == pytest.approx(plain[1], abs=1e-3 if policy == AUTO else 0.05)
    drafter = drafted[3].drafter
    assert drafter.proposed > 0
    # where a recurrent layer refused a draft, the kept tokens were fed again
    assert any(replays) == (family in RECURRENT and drafter.proposed > drafter.accepted)


@pytest.mark.parametrize("policy", ["h2o", "h2o-q8"])
def test_h2o_inside_a_window_wider_than_max_kv_speculates(policy, tokenizer, monkeypatch):
    """A sliding window wider than max_kv keeps the policy's H2O inside it (cache/policies/
    windowed.py): its mask follows each query of a verify pass, and the reply is the same
    (gpt-oss: a sliding and a full layer, learned attention sinks)."""
    model = build("gpt_oss", sliding_window=32)
    prompt = list(range(20, 26)) * 6  # a pattern this model's reply repeats
    spec = CacheSpec(policy, 24, group_size=32, evict_batch=6)
    kinds = {type(c).__name__ for c in make_cache(model, spec)}
    uninstall_router(model)
    assert any(kind.startswith("Windowed") for kind in kinds), kinds
    plain = decode(model, tokenizer, prompt, spec, max_tokens=TOKENS)
    feed_every_draft(monkeypatch)
    drafted = decode(model, tokenizer, prompt, spec, draft_max=6, max_tokens=TOKENS)
    assert drafted[0] == plain[0]
    assert drafted[1] == pytest.approx(plain[1], abs=0.05)
    assert drafted[3].drafter.accepted > 0
