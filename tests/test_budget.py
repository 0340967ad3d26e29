"""Budget math: bytes per token and each session's max_kv from --kv-budget."""

from __future__ import annotations

import pytest

from cache.budget import ModelShape, bytes_per_token, max_kv_within, parse_bytes, plan_cache

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
    assert bytes_per_token(SMOLLM2_CPU, "h2o") == dense + 30 * 3 * 8  # score + position
    assert bytes_per_token(SMOLLM2_CPU, "h2o-q8") < 0.30 * dense
    assert bytes_per_token(SMOLLM2_CPU, "h2o-q4") < bytes_per_token(SMOLLM2_CPU, "h2o-q8")


def test_allocated_cache_fits_its_share():
    share = 4 * 2**20
    bpt = bytes_per_token(SMOLLM2_CPU, "h2o")
    max_kv = max_kv_within(share, SMOLLM2_CPU, "h2o")
    assert (max_kv + 1) * bpt <= share < (max_kv + 2) * bpt  # one spare slot
    full = max_kv_within(64 * 2**20, SMOLLM2_CPU, "full")
    assert full % 256 == 0 and full * bytes_per_token(SMOLLM2_CPU, "full") <= 64 * 2**20


def test_auto_policy():
    big = plan_cache(SMOLLM2_CPU, "auto", 64 * 2**30, 8)
    assert big.policy == "full" and big.max_kv == 8192
    mid = plan_cache(SMOLLM2_CPU, "auto", 512 * 2**20, 8)
    assert mid.policy == "h2o" and 256 <= mid.max_kv < 8192
    assert mid.session_bytes == 64 * 2**20
    small = plan_cache(SMOLLM2_CPU, "auto", 8 * 2**20, 2)  # dense would hold < 256 tokens
    assert small.policy == "h2o-q8" and small.max_kv >= 256


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="kv-budget"):
        plan_cache(SMOLLM2_CPU, "h2o", 2**20, 8)
