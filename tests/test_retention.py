"""The `learned` score rule and its retention gates (cache/retention/__init__.py,
cache/scores/learned.py,
cache/retention/training.py), on tiny random models: training is deterministic, gates
save, load and score, a model without gates ranks by `mean` and says so once, and every
evicting policy takes the rule (the ones that can hand their K/V over rank by the gates)."""

from __future__ import annotations

import logging
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cache import make_cache
from cache.retention import (
    G_CLIP,
    Retention,
    RopeLayout,
    features,
    forget,
    gate,
    register,
    rope_layout,
    rope_turns,
    signature,
    unrotated,
)
from cache.retention.training import TrainConfig, _surviving, train_retention
from cache.scores import LearnedScore, MeanAttnScore, make_score_rule
from config.policies import POLICIES
from tests.tiny import tiny

CONFIG = TrainConfig(budgets=(16, 32), rows=8, steps=10, stride=4)
EVICTING = [p.name for p in POLICIES.values() if p.bounded and p.scored]
# Layouts that cannot hand their K/V to a rule: it ranks by `mean` there.
WITHOUT_KV = {"h2o-kvarn"}


def model_of(seed: int = 0):
    """Tiny llama (head dim 64, so packed policies take it) with its own weights."""
    model = tiny("llama", head_dim=64, hidden_size=128)
    if seed:
        mx.random.seed(seed)
        table = model.model.embed_tokens.weight
        model.model.embed_tokens.weight = mx.random.normal(table.shape) * 0.02
    return model


def text(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(0, 64, length)] for _ in range(n)]


@pytest.fixture(scope="module")
def trained():
    model = model_of()
    windows = text(3, 120)
    retention = train_retention(model, windows[:2], windows[2:], "tiny", CONFIG)
    yield model, retention, windows
    forget(model)


def test_training_twice_from_one_seed_gives_the_same_gates(trained):
    model, first, windows = trained
    again = train_retention(model, windows[:2], windows[2:], "tiny", CONFIG)
    assert mx.array_equal(first.w, again.w) and mx.array_equal(first.b, again.b)
    other = train_retention(model, windows[:2], windows[2:], "tiny", TrainConfig(
        budgets=(16, 32), rows=8, steps=10, stride=4, seed=1))  # fmt: skip
    assert not mx.array_equal(first.w, other.w)  # another seed reads other rows
    afresh = train_retention(model, windows[:2], windows[2:], "tiny", replace(CONFIG, stride=0))
    assert not mx.array_equal(first.w, afresh.w)  # rows choosing afresh: another loss
    layers, heads = len(model.layers), model.args.num_key_value_heads
    assert first.w.shape == (layers, heads, 64 // 2 + 64 + 2)
    assert first.training["held_out_loss"] is not None


def test_gates_save_load_and_score(trained, tmp_path):
    model, retention, windows = trained
    path = retention.save(tmp_path / "tiny.safetensors")
    loaded = Retention.load(path)
    assert loaded.signature == signature(model) and loaded.rope == rope_layout(model)
    assert mx.array_equal(loaded.w, retention.w) and loaded.training == retention.training
    register(loaded)
    caches = make_cache(model, "h2o", max_kv=16, score="learned")
    rule = caches[1].score_rule
    assert isinstance(rule, LearnedScore) and rule.gated and rule.layer == 1
    # its rank: mean's times exp(the gate), from the held keys and values
    ids = mx.array(windows[0][:40])[None]
    model(ids, cache=caches)
    c = caches[1]
    kv = c.ranking_kv(c.used)
    ranked = rule.rank(c.scores[..., : c.used], c.positions[..., : c.used], c.seen, kv)
    mean = MeanAttnScore().rank(c.scores[..., : c.used], c.positions[..., : c.used], c.seen)
    assert not np.allclose(np.array(ranked), np.array(mean))
    w, b = retention.layer(1)
    g = (features(*kv, retention.rope) * w[None, :, None]).sum(-1) + b[None, :, None]
    g = mx.clip(g, -G_CLIP, G_CLIP)
    np.testing.assert_allclose(np.array(ranked), np.array(mean * mx.exp(g)), rtol=1e-4)
    # a restored cache's rule is bound to the same gates (its knobs travel with it)
    again = make_score_rule("learned", **rule.knobs())
    assert again == rule and again.gated
    # every layer accumulates as mean does, so the layers share one compiled decode step
    # (a rule per layer keyed 30 of them and slowed the host's step: docs/retention.md)
    assert len({c.score_rule for c in caches}) == len(caches)
    assert len({c.score_rule.accumulation for c in caches}) == 1
    assert rule.accumulation is rule.accumulation and not rule.accumulation.gated


def test_a_model_without_gates_ranks_by_mean_and_says_so_once(caplog):
    model = model_of(seed=7)  # weights no gate was trained on
    with caplog.at_level(logging.WARNING, logger="h2o_server.cache"):
        caches = make_cache(model, "h2o", max_kv=16, score="learned")
        make_cache(model, "h2o", max_kv=16, score="learned")
    told = [r for r in caplog.records if "no retention weights" in r.getMessage()]
    assert len(told) == 1
    rule = caches[0].score_rule
    assert isinstance(rule, LearnedScore) and not rule.gated
    ids = mx.array(text(1, 60, seed=3)[0])[None]
    mean = make_cache(model, "h2o", max_kv=16, score="mean")
    np.testing.assert_allclose(
        np.array(model(ids, cache=caches)), np.array(model(ids, cache=mean)), atol=1e-5
    )
    assert mx.array_equal(caches[0].positions, mean[0].positions)


def walk(model, retention: Retention, policy: str, ids: list[int]) -> None:
    """Decode under `policy` by `learned` and by `mean`: the gates change who is kept
    where the layout hands its K/V over, and nothing where it cannot."""
    register(retention)
    kept = {}
    for score in ("learned", "mean"):
        caches = make_cache(model, policy, max_kv=16, score=score)
        model(mx.array(ids[:24])[None], cache=caches)
        for t in range(24, 90):  # decode: evictions every evict batch
            model(mx.array([[ids[t]]]), cache=caches)
        mx.eval([c.positions for c in caches if getattr(c, "positions", None) is not None])
        assert all(c.score_rule.name == score for c in caches if hasattr(c, "score_rule"))
        kept[score] = [np.sort(np.array(c.positions[..., : c.size()]), -1) for c in caches]
        assert all(c.size() <= 17 for c in caches)
    rule = caches[0].score_rule
    if policy in WITHOUT_KV:
        assert all(np.array_equal(a, b) for a, b in zip(kept["learned"], kept["mean"], strict=True))
    else:
        assert not all(
            a.shape == b.shape and np.array_equal(a, b)
            for a, b in zip(kept["learned"], kept["mean"], strict=True)
        ), f"{policy}: the gates changed nothing ({rule})"


@pytest.mark.parametrize("policy", EVICTING)
def test_every_evicting_policy_takes_the_learned_rule(policy, trained):
    model, retention, windows = trained
    walk(model, retention, policy, windows[0])


def test_a_shared_pool_gates_each_slot_under_its_own_heads_weights(trained):
    """h2o-ada holds every KV head's slots on one axis: a slot's rank is `mean`'s times
    exp(its own head's gate), and `value` (a mean over a head's values) reads no K/V."""
    model, retention, windows = trained
    register(retention)
    caches = make_cache(model, "h2o-ada", max_kv=16, score="learned")
    model(mx.array(windows[0][:40])[None], cache=caches)
    c = caches[1]
    n = c.used
    scores, pos, heads = c.scores[..., :n], c.positions[..., :n], c.heads[0, 0, :n]
    ranked = np.array(c.rule_rank(scores, pos, c.seen))[0, 0]
    mean = np.array(MeanAttnScore().rank(scores, pos, c.seen))[0, 0]
    w, b = retention.layer(1)
    g = features(c.keys[:, :, :n], c.values[:, :, :n], retention.rope) * w[None, :, None]
    g = np.array(mx.clip(g.sum(-1) + b[None, :, None], -G_CLIP, G_CLIP))[0]  # [H, n]
    own = g[np.array(heads).astype(int), np.arange(n)]
    assert len(set(np.array(heads).tolist())) > 1  # the pool holds several heads
    np.testing.assert_allclose(ranked, mean * np.exp(own), rtol=1e-4)
    valued = make_cache(model, "h2o-ada", max_kv=16, score="value")[1]
    assert valued.ranking_kv(n) is None


AGED = replace(CONFIG, age=True)


def test_training_with_age_terms_gives_per_head_age_weights(trained):
    model, plain, windows = trained
    aged = train_retention(model, windows[:2], windows[2:], "tiny", AGED)
    again = train_retention(model, windows[:2], windows[2:], "tiny", AGED)
    layers, heads = len(model.layers), model.args.num_key_value_heads
    assert aged.age is not None and aged.age.shape == (layers, heads, 2)
    assert mx.array_equal(aged.age, again.age) and mx.array_equal(aged.w, again.w)
    assert aged.training["age"] is True and plain.age is None
    assert all(np.isfinite(aged.training["held_out_loss_per_layer"]))


def test_age_terms_save_load_and_score(trained, tmp_path):
    model, plain, windows = trained
    age = mx.array(np.random.RandomState(0).normal(0, 0.5, plain.b.shape + (2,)), mx.float32)
    aged = replace(plain, age=age)
    loaded = Retention.load(aged.save(tmp_path / "aged.safetensors"))
    assert mx.array_equal(loaded.age, age) and mx.array_equal(loaded.w, plain.w)
    assert Retention.load(plain.save(tmp_path / "plain.safetensors")).age is None
    register(loaded)
    try:
        caches = make_cache(model, "h2o", max_kv=16, score="learned")
        rule = caches[1].score_rule
        assert rule.max_kv == 16  # bound at the layer's cache size: the terms' scale
        model(mx.array(windows[0][:40])[None], cache=caches)
        c = caches[1]
        kv = c.ranking_kv(c.used)
        scores, pos = c.scores[..., : c.used], c.positions[..., : c.used]
        ranked = rule.rank(scores, pos, c.seen, kv)
        w, b = plain.layer(1)
        g = mx.clip((features(*kv, plain.rope) * w[None, :, None]).sum(-1) + b[None, :, None],
                    -G_CLIP, G_CLIP)  # fmt: skip
        since = mx.maximum(c.seen - pos, 1).astype(mx.float32)
        a, k = age[1, :, 0][None, :, None], age[1, :, 1][None, :, None]
        g = mx.clip(g + a * mx.log(since) + k * since / 16, -G_CLIP, G_CLIP)
        mean = MeanAttnScore().rank(scores, pos, c.seen)
        np.testing.assert_allclose(np.array(ranked), np.array(mean * mx.exp(g)), rtol=1e-4)
        without = replace(rule, max_kv=0).rank(scores, pos, c.seen, kv)  # unbound size: no terms
        assert not np.allclose(np.array(ranked), np.array(without))
        assert make_score_rule("learned", **rule.knobs()) == rule  # restored with its size
    finally:
        register(plain)


def test_training_evicts_each_layer_at_its_own_share(trained):
    model, _, windows = trained
    shares = (0.5, 1.5)
    retention = train_retention(
        model, windows[:2], windows[2:], "tiny", CONFIG, layer_shares=shares
    )
    assert retention.training["layer_budgets"] == [[16, 16], [16, 48]]  # floors of 16
    assert retention.w.shape[0] == len(model.layers)


def test_the_training_relaxation_evicts_for_good():
    # two evictions keeping 2 middle keys: key 2 scores highest at the second but left at
    # the first, so it stays out; key 6, new to the middle then, displaces key 1
    score = mx.array([[[[5, 4, 0, 3, -1, -2, 0], [5, -5, 9, 3, 0, 0, 8]]]], mx.float32)
    middle = mx.array([[True] * 6 + [False], [True] * 7])
    hard = _surviving(score, middle, 2, None, (0, 1))
    assert hard[0, 0].tolist() == [[1, 1, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 1]]
    soft = _surviving(score, middle, 2, 0.05, (0, 1))
    np.testing.assert_allclose(np.array(soft), np.array(hard), atol=1e-3)
    # shares sum to heavy among the middle keys: key 6 recent at first (kept), then middle
    np.testing.assert_allclose(np.array(soft[0, 0].sum(-1)), [3, 2], atol=1e-3)

    def kept_of_key_2(s):
        return _surviving(s, middle, 2, 0.5, (0, 1))[0, 0, 1, 2]

    grad = mx.grad(kept_of_key_2)(score)
    assert float(grad[0, 0, 1, 2]) == pytest.approx(0.0, abs=1e-3)  # gone: its late score is moot
    assert float(grad[0, 0, 0, 2]) > 0  # a higher first score would have kept it


def test_loaded_gates_do_not_change_when_their_file_is_rewritten(trained, tmp_path):
    # calibrate may rewrite the user's file while a server holds gates read from it
    _, retention, _ = trained
    path = retention.save(tmp_path / "gates.safetensors")
    loaded = Retention.load(path)
    replace(retention, w=retention.w + 1.0).save(path)
    assert mx.array_equal(loaded.w, retention.w)
    assert [p.name for p in tmp_path.iterdir()] == ["gates.safetensors"]  # no partial left


DIRECTED = replace(CONFIG, direction=True)


@pytest.fixture(scope="module")
def directed(trained):
    model, plain, windows = trained
    yield train_retention(model, windows[:2], windows[2:], "tiny", DIRECTED)
    register(plain)


@pytest.mark.parametrize("policy", EVICTING)
def test_every_evicting_policy_takes_gates_that_read_the_key_direction(policy, trained, directed):
    model, _, windows = trained
    walk(model, directed, policy, windows[0])


@pytest.mark.parametrize("traditional", [False, True])
def test_keys_turn_back_to_where_they_were_before_rope(traditional):
    # rope_turns reads each pair's angle off the module; unrotated undoes it at any position
    model = model_of()
    for layer in model.layers:
        layer.self_attn.rope = nn.RoPE(64, traditional=traditional, base=5000.0)
    rope = RopeLayout(64, traditional)
    turns = rope_turns(model, rope)
    expected = 1.0 / 5000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(np.array(turns[0]), expected, rtol=1e-4)
    raw = mx.random.normal((1, 1, 30, 64), key=mx.random.key(2))
    turned = model.layers[0].self_attn.rope(raw, offset=700)
    a, b = unrotated(turned, mx.arange(700, 730)[None, None], turns[0], rope)
    before = (raw[..., 0::2], raw[..., 1::2]) if traditional else (raw[..., :32], raw[..., 32:])
    np.testing.assert_allclose(np.array(a), np.array(before[0]), atol=1e-4)
    np.testing.assert_allclose(np.array(b), np.array(before[1]), atol=1e-4)


def test_gates_that_read_the_key_direction_train_save_and_score(trained, directed, tmp_path):
    model, plain, windows = trained
    again = train_retention(model, windows[:2], windows[2:], "tiny", DIRECTED)
    assert mx.array_equal(directed.w, again.w)  # deterministic as the plain gates
    heads = model.args.num_key_value_heads
    assert directed.w.shape == (len(model.layers), heads, 64 // 2 + 64 + 2 + 64)
    assert directed.turn.shape == (len(model.layers), 32) and plain.turn is None
    loaded = Retention.load(directed.save(tmp_path / "directed.safetensors"))
    assert mx.array_equal(loaded.turn, directed.turn) and mx.array_equal(loaded.w, directed.w)
    register(loaded)
    try:
        caches = make_cache(model, "h2o", max_kv=16, score="learned")
        model(mx.array(windows[0][:40])[None], cache=caches)
        c, rule = caches[1], caches[1].score_rule
        kv = c.ranking_kv(c.used)
        scores, pos = c.scores[..., : c.used], c.positions[..., : c.used]
        ranked = rule.rank(scores, pos, c.seen, kv)
        g = gate(*kv, *loaded.layer(1), loaded.rope, pos, loaded.layer_turn(1))
        mean = MeanAttnScore().rank(scores, pos, c.seen)
        np.testing.assert_allclose(np.array(ranked), np.array(mean * mx.exp(g)), rtol=1e-4)
        # the same key at another position: the same gate (what it reads is RoPE's input)
        rope = model.layers[1].self_attn.rope
        raw = mx.random.normal((1, heads, 5, 64), key=mx.random.key(3))
        values = mx.random.normal((1, heads, 5, 64), key=mx.random.key(4))
        at = [gate(rope(raw, offset=p), values, *loaded.layer(1), loaded.rope,
                   mx.broadcast_to(mx.arange(p, p + 5), (1, heads, 5)), loaded.layer_turn(1))
              for p in (3, 400)]  # fmt: skip
        np.testing.assert_allclose(np.array(at[0]), np.array(at[1]), atol=1e-3)
        w, b = loaded.layer(1)
        w_blind = mx.concatenate([w[:, :-64], mx.zeros_like(w[:, -64:])], axis=-1)
        at_3 = mx.broadcast_to(mx.arange(3, 8), (1, heads, 5))
        blind = gate(rope(raw, offset=3), values, w_blind, b, loaded.rope, at_3, loaded.turn[1])
        assert not np.allclose(np.array(blind), np.array(at[0]))  # the direction weighs in
    finally:
        register(plain)
