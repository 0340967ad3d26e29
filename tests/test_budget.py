"""Budget math: bytes per token and each session's max_kv from --kv-budget."""

from __future__ import annotations

import pytest

from cache.budget import (
    Budget,
    ModelShape,
    bytes_per_token,
    cache_bytes,
    fit_spec,
    max_kv_within,
    parse_bytes,
    session_bytes,
)
from config.policies import POLICIES

SMOLLM2_CPU = ModelShape(layers=30, kv_heads=3, head_dim=64, element_bytes=4, context=8192)


@pytest.mark.parametrize(
    "text, value",
    [("1GiB", 2**30), ("512MB", 512 * 10**6), ("64kib", 65536), ("1.5GiB", 3 * 2**29), (7, 7)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "1QB", "-5MB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_bytes_per_token_follows_the_model_shape():
    dense = 30 * 3 * 2 * 64 * 4  # layers x kv heads x (K and V) x head dim x float32
    assert bytes_per_token(SMOLLM2_CPU, "full") == dense
    # score + position, over max_kv + 1 slots (the spare one), amortized over max_kv tokens
    h2o = (dense + 30 * 3 * 8) * 8193 / 8192
    assert bytes_per_token(SMOLLM2_CPU, "h2o") == pytest.approx(h2o, rel=1e-12)
    assert bytes_per_token(SMOLLM2_CPU, "h2o-q8") < 0.30 * dense
    assert bytes_per_token(SMOLLM2_CPU, "h2o-q4") < bytes_per_token(SMOLLM2_CPU, "h2o-q8")


def test_allocated_cache_fits_its_share():
    share = 4 * 2**20
    slot = 30 * 3 * (2 * 64 * 4 + 8)  # K, V, score and position of one slot, every layer
    max_kv = max_kv_within(share, SMOLLM2_CPU, "h2o")
    assert (max_kv + 1) * slot <= share < (max_kv + 2) * slot  # one spare slot
    assert session_bytes(SMOLLM2_CPU, "h2o", max_kv) == (max_kv + 1) * slot
    full = max_kv_within(64 * 2**20, SMOLLM2_CPU, "full")
    assert full % 256 == 0 and full * bytes_per_token(SMOLLM2_CPU, "full") <= 64 * 2**20


def test_auto_policy():
    big = fit_spec(SMOLLM2_CPU, Budget(64 * 2**30, 8))
    assert big.policy == "full" and big.max_kv == 8192
    packed = fit_spec(SMOLLM2_CPU, Budget(512 * 2**20, 8))  # all 8192 tokens fit packed
    assert packed.policy == "kvarn" and packed.max_kv == 8192
    # ... and start dense: packed only once a conversation outgrows what its share holds
    # dense (cache/factory.py pack_dense), so both phases are priced within the share
    share = 64 * 2**20
    assert packed.dense_until == max_kv_within(share, SMOLLM2_CPU, "full") > 1024
    assert session_bytes(SMOLLM2_CPU, packed) <= share
    assert session_bytes(SMOLLM2_CPU, "full", packed.dense_until) <= share
    assert session_bytes(SMOLLM2_CPU, packed) > session_bytes(SMOLLM2_CPU, "kvarn", 8192)
    assert fit_spec(SMOLLM2_CPU, Budget(512 * 2**20, 8), "kvarn").dense_until == 0  # as asked
    mid = fit_spec(SMOLLM2_CPU, Budget(256 * 2**20, 8))  # bounded: 8-bit H2O, sized to fit
    assert mid.policy == "h2o-q8" and 1024 <= mid.max_kv < 8192
    assert session_bytes(SMOLLM2_CPU, "h2o-q8", mid.max_kv) <= 32 * 2**20
    assert session_bytes(SMOLLM2_CPU, "h2o-q8", mid.max_kv + 1) > 32 * 2**20
    small = fit_spec(SMOLLM2_CPU, Budget(8 * 2**20, 2))  # dense H2O would hold < 100 tokens
    assert small.policy == "h2o-q8" and small.max_kv >= 256


def test_kvarn_policies_are_sized_by_their_exact_bytes():
    share = 16 * 2**20
    for policy in ("kvarn", "h2o-kvarn"):
        max_kv = max_kv_within(share, SMOLLM2_CPU, policy)
        assert cache_bytes(SMOLLM2_CPU, policy, max_kv) <= share
        assert cache_bytes(SMOLLM2_CPU, policy, max_kv + 1) > share
        assert max_kv > 3 * max_kv_within(share, SMOLLM2_CPU, "h2o")
    # wider presets are priced as such: k4v4 holds fewer tokens in the same share
    k4v4 = fit_spec(SMOLLM2_CPU, Budget(share, 1), "kvarn", kvarn="k4v4")
    assert k4v4.max_kv < max_kv_within(share, SMOLLM2_CPU, "kvarn")
    assert cache_bytes(SMOLLM2_CPU, "kvarn", k4v4.max_kv, kvarn="k4v4") <= share
    # amortized over the whole context, a packed token costs ~0.14x of a float32 one
    kvarn = bytes_per_token(SMOLLM2_CPU, "kvarn", max_kv=8192)
    assert 0.11 < kvarn / bytes_per_token(SMOLLM2_CPU, "full") < 0.15


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="kv-budget"):
        fit_spec(SMOLLM2_CPU, Budget(2**20, 8), "h2o")


def test_one_function_serves_startup_requests_and_the_cli():
    budget = Budget(512 * 2**20, 8)
    default = fit_spec(SMOLLM2_CPU, budget, "h2o", preset="heavy", score="attn")
    # a request that names only a smaller max_kv keeps the rest
    smaller = fit_spec(SMOLLM2_CPU, budget, "h2o", max_kv=128)
    assert smaller.max_kv == 128 and smaller.segments().heavy == 64
    with pytest.raises(ValueError, match="exceeds the per-session budget"):
        fit_spec(SMOLLM2_CPU, budget, "h2o", max_kv=default.max_kv + 1)
    # a request for a cheaper policy may hold more tokens in the same share
    assert fit_spec(SMOLLM2_CPU, budget, "h2o-q8").max_kv > default.max_kv
    # no budget (one-off generation): max_kv as given, validated like any spec
    assert fit_spec(SMOLLM2_CPU, None, "rotating", max_kv=64).max_kv == 64
    with pytest.raises(ValueError, match="must equal max_kv"):
        fit_spec(SMOLLM2_CPU, None, "h2o", max_kv=8, sink=4, heavy=4, recent=4)
    with pytest.raises(ValueError, match="unknown policy"):
        fit_spec(SMOLLM2_CPU, budget, "h2o-q3")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_has_a_byte_cost(policy):
    """Every policy's class prices itself: packed ones cost less than dense K/V, dense ones
    at least that (plus what they keep beside K/V)."""
    dense = bytes_per_token(SMOLLM2_CPU, "full")
    cost = bytes_per_token(SMOLLM2_CPU, policy)
    assert 0 < cost
    assert (cost < dense) == POLICIES[policy].quantized


# Gemma 3 270M on CPU: 18 layers, 15 of them sliding over 512 tokens, 1 KV head of 256.
GEMMA3_CPU = ModelShape(
    layers=18, kv_heads=1, head_dim=256, element_bytes=4, context=32768, windows=(512,) * 15
)


def test_session_bytes_count_each_layer_kind():
    dense, scored = 2 * 256 * 4, 2 * 256 * 4 + 8  # one token of one layer
    # max_kv below the window: every layer holds max_kv (+ H2O's spare slot)
    assert session_bytes(GEMMA3_CPU, "h2o", 64) == 18 * 65 * scored
    assert session_bytes(GEMMA3_CPU, "rotating", 64) == 18 * 64 * dense
    # above it: the sliding layers keep their 512-token window, dense
    assert session_bytes(GEMMA3_CPU, "h2o", 1024) == 3 * 1025 * scored + 15 * 512 * dense
    assert session_bytes(GEMMA3_CPU, "full", 1000) == 3 * 1024 * dense + 15 * 512 * dense
    # the old formula (every layer x max_kv) overstates the cost past the window
    assert session_bytes(GEMMA3_CPU, "h2o", 4096) < 0.3 * 4097 * bytes_per_token(GEMMA3_CPU, "h2o")


def test_the_dense_tail_of_4bit_keys_is_priced():
    """h2o-q4 keeps its newest 16 tokens dense too (cache/policies/quantized.py): K and V of 16
    tokens
    per global layer and KV head, float32; 8-bit keys keep none unless asked."""
    tail = 2 * 16 * SMOLLM2_CPU.head_dim * 4 * SMOLLM2_CPU.kv_heads * SMOLLM2_CPU.layers
    q4 = session_bytes(SMOLLM2_CPU, "h2o-q4", 256)
    assert q4 - session_bytes(SMOLLM2_CPU, "h2o-q4", 256, dense_recent=0) == tail
    assert session_bytes(SMOLLM2_CPU, "h2o-q8", 256, dense_recent=16) - tail == session_bytes(
        SMOLLM2_CPU, "h2o-q8", 256
    )
    assert session_bytes(SMOLLM2_CPU, "h2o-q4", 8, dense_recent=0) < session_bytes(
        SMOLLM2_CPU, "h2o-q4", 8
    )  # at most the recent window


@pytest.mark.parametrize("policy", ["h2o", "h2o-q8", "rotating", "full"])
@pytest.mark.parametrize("max_kv", [64, 511, 512, 513, 2048])
def test_max_kv_within_inverts_session_bytes(policy, max_kv):
    if policy == "full":
        max_kv = -(-max_kv // 256) * 256
    step = 256 if policy == "full" else 1
    nbytes = session_bytes(GEMMA3_CPU, policy, max_kv)
    got = max_kv_within(nbytes, GEMMA3_CPU, policy)
    assert session_bytes(GEMMA3_CPU, policy, got) <= nbytes
    assert session_bytes(GEMMA3_CPU, policy, got + step) > nbytes
    if policy == "h2o" and max_kv == 511:
        # At the window a sliding layer trades H2O (spare slot, bookkeeping) for its own
        # dense window: max_kv 512 and a few more cost less than 511.
        assert got > 512
    else:
        assert got == max_kv


@pytest.mark.parametrize("share_mib", [8, 64])
def test_fit_spec_uses_the_per_layer_sum(share_mib):
    share = share_mib * 2**20
    spec = fit_spec(GEMMA3_CPU, Budget(8 * share, 8), "h2o")
    assert session_bytes(GEMMA3_CPU, "h2o", spec.max_kv) <= share
    assert session_bytes(GEMMA3_CPU, "h2o", spec.max_kv + 1) > share
    old = share // (18 * (2 * 256 * 4 + 8)) - 1  # every layer x max_kv (+ the spare slot)
    # below the window both agree; past it the sliding layers stop growing
    assert spec.max_kv == old if old < 512 else spec.max_kv > 4 * old
