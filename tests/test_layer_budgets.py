"""Per-layer max_kv from a layer profile: the split, the caches, calibration, lookup."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest
from tiny import tiny

from bench.ppl import nll_chunked
from cache import make_cache
from cache.budget import Budget, fit_spec, session_bytes
from cache.layer_profiles import (
    SHARE_MAX,
    SHARE_MIN,
    LayerProfile,
    calibrate,
    find_profile,
    shares_from_sensitivity,
)
from config.cache_spec import MIN_LAYER_KV, POLICIES, CacheSpec, apportion
from models.shape import kv_shape
from server.engine.layer_budgets import load_layer_profile


def test_apportion_is_exact_proportional_and_floored():
    sizes = apportion(1920, [0.5] * 10 + [2] * 10 + [1] * 10, 16)
    assert sum(sizes) == 1920
    assert sizes[:10] == [27] * 10 and sizes[10:20] == [110] * 10 and sizes[20:] == [55] * 10
    assert apportion(90, [0.1, 1, 5], 16) == [16, 16, 58]  # floored layers give up the rest
    with pytest.raises(ValueError):
        apportion(20, [1, 1], 16)


def test_shares_have_mean_one_within_the_clip_and_follow_sensitivity():
    sensitivity = [0.0, -0.01, 0.002, 0.01, 0.08, None, 0.5]
    shares = shares_from_sensitivity(sensitivity)
    assert shares[5] is None
    given = [s for s in shares if s is not None]
    assert math.isclose(sum(given) / len(given), 1.0, abs_tol=1e-3)
    assert all(SHARE_MIN - 1e-4 <= s <= SHARE_MAX + 1e-4 for s in given)
    assert shares[0] == shares[1] == min(given)  # nothing, or noise below it: the floor
    assert shares[2] <= shares[3] <= shares[4] <= shares[6]


def test_spec_splits_layers_x_max_kv():
    spec = CacheSpec("h2o-merge", 64, layer_shares=[0.8, 1.2, None, 1.0])
    assert spec.layer_shares == (0.8, 1.2, None, 1.0)  # a list (a spill file's JSON) is kept
    assert spec.layer_sizes() == [51, 77, 64, 64]
    assert CacheSpec(**json.loads(json.dumps(spec.as_dict()))) == spec
    assert spec.for_layer(77).segments().max_size == 77
    assert CacheSpec("h2o", 64).layer_sizes() == []
    small = CacheSpec("h2o", 16, layer_shares=[0.1, 1.9])
    assert min(small.layer_sizes()) == min(MIN_LAYER_KV, 16)


@pytest.mark.parametrize("policy", ["full", "rotating", "kvarn", "h2o-kvarn"])
def test_only_h2o_caches_take_layer_shares(policy):
    assert not POLICIES[policy].layer_budgeted
    with pytest.raises(ValueError, match="own max_kv"):
        CacheSpec(policy, 64, layer_shares=[1.0, 1.0])


def test_layer_shares_exclude_explicit_segments_and_bad_values():
    with pytest.raises(ValueError, match="exclude"):
        CacheSpec("h2o", 64, heavy=32, layer_shares=[1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        CacheSpec("h2o", 64, layer_shares=[0.0, 2.0])


@pytest.mark.parametrize("policy", ["h2o", "h2o-merge", "h2o-q8", "h2o-ada"])
def test_layers_get_their_sizes_and_the_same_bytes_as_uniform(policy):
    model = tiny("llama", num_hidden_layers=3, head_dim=64)  # a whole quantization group
    shares = (0.5, 1.0, 1.5)
    caches = make_cache(model, policy, max_kv=32, layer_shares=shares)
    uniform = make_cache(model, policy, max_kv=32)
    assert [c.max_size for c in caches] == [16, 32, 48]
    tokens = mx.array([list(range(1, 61))])
    for c in (caches, uniform):
        for start in range(0, 60, 4):  # past every layer's max_kv: all of them evict
            model(tokens[:, start : start + 4], cache=c)
        mx.eval([x.state for x in c])
    assert [c.size() <= c.max_size for c in caches] == [True] * 3
    assert all(c.evicted > 0 for c in caches)
    assert sum(c.nbytes for c in caches) == sum(c.nbytes for c in uniform)


def test_make_cache_checks_the_profile_against_the_model():
    model = tiny("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="3 layers"):
        make_cache(model, "h2o", max_kv=32, layer_shares=(1.0, 1.0, 1.0))
    gemma = tiny("gemma3_text", num_hidden_layers=2, sliding_window=8, sliding_window_pattern=2)
    with pytest.raises(ValueError, match="sliding"):
        make_cache(gemma, "h2o", max_kv=32, layer_shares=(1.0, 1.0))
    caches = make_cache(gemma, "h2o", max_kv=32, layer_shares=(None, 1.0))
    assert caches[1].max_size == 32


def test_fit_spec_takes_shares_unless_segments_are_given(default_model):
    model, _ = default_model
    shape = kv_shape(model)
    shares = tuple([0.5, 1.5] * (shape.layers // 2))
    spec = fit_spec(shape, Budget(2**26, 4), "h2o", shares_for=lambda p: shares)
    assert spec.layer_shares == shares and sum(spec.layer_sizes()) == shape.layers * spec.max_kv
    # the same bytes as uniform: layers x (max_kv + 1) slots either way
    assert session_bytes(shape, "h2o", spec.max_kv) <= Budget(2**26, 4).per_session
    explicit = fit_spec(shape, None, "h2o", max_kv=64, heavy=30, shares_for=lambda p: shares)
    assert explicit.layer_shares is None


def test_calibration_measures_each_layer_alone(default_model):
    """One batched pass holds every one-layer-bounded run; each row equals that run alone."""
    model, tokenizer = default_model
    window = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)[:48]
    roomy = calibrate(model, [window], "h2o", max_kv=128, chunk=16)
    # Nothing evicted: every row is the reference, up to the order of float sums in a
    # batched pass (BLAS threading moved one layer by 1e-6 on a busy machine).
    assert max(abs(s) for s in roomy) < 1e-5
    tight = calibrate(model, [window], "h2o", max_kv=16, chunk=16)
    assert any(abs(s) > 1e-3 for s in tight)
    tokens = mx.array([window])
    full = nll_chunked(model, tokens, {"policy": "full"}, 16).mean().item()
    for layer in (0, 20):
        caches = make_cache(model, "full")
        caches[layer] = make_cache(model, "h2o", max_kv=16)[layer]
        alone = nll_chunked(model, tokens, {}, 16, caches=caches).mean().item()
        assert abs((alone - full) - tight[layer]) < 1e-4


def test_the_default_model_finds_its_shipped_profile(default_model, tmp_path):
    model, _ = default_model
    profile, why = load_layer_profile("auto", model, "SmolLM2-135M-Instruct")
    assert profile is not None and "profiled" in why
    for policy in ("h2o", "h2o-merge", "h2o-q8"):
        shares = profile.shares(policy)
        assert len(shares) == len(model.layers) and max(shares) > min(shares)
    assert profile.shares("rotating") is None and profile.shares("full") is None
    assert load_layer_profile("uniform", model, "x") == (None, "uniform (--layer-budgets uniform)")
    # found by name too: the same model in another dtype has another fingerprint
    assert find_profile("not-these-weights", "SmolLM2-135M-Instruct") is not None
    assert find_profile("not-these-weights", "some-other-model") is None

    short = LayerProfile("m", "i", {"h2o": [0.1, 0.2]}, {})
    short.save(tmp_path / "short.json")
    with pytest.raises(ValueError, match="2 layers"):
        load_layer_profile(str(tmp_path / "short.json"), model, "m")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a layer profile"):
        load_layer_profile(str(tmp_path / "bad.json"), model, "m")
