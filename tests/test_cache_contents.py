"""What a layer cache holds (cache/contents.py) and the cache view's report
(server/api/cache_view.py).

Keys carry their own token position in channel 0, so the positions a cache
claims to hold can be checked against the keys it really stores.
"""

import base64
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from cache import H2OKVarNCache, H2OKVCache, KVarNCache, QuantizedH2OKVCache
from cache.contents import LayerContents
from cache.contract import is_scored, layer_contents
from cache.policies.mixed import MIXED_LAYOUTS
from server.api.cache_view import SessionContents, cache_report, token_texts

N_KV, D = 2, 64
# Prefill chunks, single decode steps, then chunks again (mlx-lm's chunked prefill).
FEED = [10, 20, *[1] * 9, 7, *[1] * 5, 33, 1, 1]


def tagged_kv(start: int, n: int) -> tuple[mx.array, mx.array]:
    """Keys whose channel 0 is the token's position (same in every head)."""
    k = np.zeros((1, N_KV, n, D), np.float32)
    k[..., 0] = np.arange(start, start + n)
    return mx.array(k), mx.array(k)


def feed(cache, steps=FEED, seed: int = 0):
    rng = np.random.default_rng(seed)
    for n in steps:
        k, v = tagged_kv(cache.offset, n)
        cache.update_and_fetch(k, v)
        if is_scored(cache):
            size = cache.size()
            logits = rng.standard_normal((1, N_KV, n, size)).astype(np.float32) * 3
            cache.update_scores(mx.array(logits))
        yield cache


def assert_sorted_unique(contents: LayerContents) -> None:
    for row in contents.positions:
        assert np.all(np.diff(row) > 0) and row[0] >= 0 and row[-1] < contents.offset


def test_full_cache_holds_every_token():
    cache = KVCache()
    for c in feed(cache):
        contents = layer_contents(c)
        assert contents.kind == "full" and contents.scores is None
        assert np.shape(contents.positions) == (N_KV, c.offset)
        assert np.array_equal(contents.positions[1], np.arange(c.offset))
    cache.trim(5)
    assert np.shape(layer_contents(cache).positions) == (N_KV, cache.offset)


@pytest.mark.parametrize("keep", [0, 4])
def test_rotating_cache_positions_match_its_keys(keep):
    """Sinks plus the newest tokens, whatever the mix of chunks and single steps."""
    cache = RotatingKVCache(max_size=24, keep=keep)
    for c in feed(cache):
        contents = layer_contents(c)
        assert_sorted_unique(contents)
        held = min(c.offset, c.keys.shape[2])
        stored = np.array(c.keys[0, :, :held, 0]).astype(int)
        for h in range(N_KV):
            assert set(contents.positions[h]) == set(stored[h])
        if c.offset > c.max_size:
            assert set(range(keep)) <= set(contents.positions[0])
        assert (contents.sink, contents.recent) == (keep, 24 - keep)


@pytest.mark.parametrize("evict_batch", [1, 4])
def test_h2o_positions_match_its_keys_and_scores(evict_batch):
    cache = H2OKVCache(28, sink=2, heavy=12, recent=14, evict_batch=evict_batch)
    for c in feed(cache):
        contents = layer_contents(c)
        assert_sorted_unique(contents)
        n = c.size()
        assert np.shape(contents.positions) == (N_KV, n)
        keys = np.array(c.keys[0, :, :n, 0]).astype(int)
        slots = np.array(c.positions[0, :, :n])
        scores = np.array(c.scores[0, :, :n])
        for h in range(N_KV):
            assert set(contents.positions[h]) == set(keys[h])
            by_position = dict(zip(slots[h], scores[h], strict=True))
            assert np.allclose(contents.scores[h], [by_position[p] for p in contents.positions[h]])
        if c.evicted:  # sinks and the recent window are always held
            protected = {*range(2), *range(c.offset - 14, c.offset)}
            assert all(protected <= set(row) for row in contents.positions)
    assert cache.evicted > 0 and (contents.sink, contents.recent) == (2, 14)


@pytest.mark.parametrize(
    "make",
    [
        lambda: QuantizedH2OKVCache(28, sink=2, heavy=12, recent=14, bits=8),
        *[
            lambda cls=cls, widths=widths: cls(28, sink=2, heavy=12, recent=14, **widths)
            for cls, widths in MIXED_LAYOUTS.values()
        ],
    ],
    ids=["q8", *MIXED_LAYOUTS],
)
def test_quantized_h2o_reports_its_slots(make):
    cache = make()
    for c in feed(cache):
        contents = layer_contents(c)
        assert contents.kind == "h2o"
        assert np.shape(contents.positions) == (N_KV, c.size())
        slots = np.array(c.positions[0, :, : c.size()])
        assert all(set(contents.positions[h]) == set(slots[h]) for h in range(N_KV))
    assert cache.evicted > 0


def test_kvarn_holds_every_token():
    """Packed tiles, dense front and tail: nothing is evicted, whatever the chunking."""
    cache = KVarNCache(4, 2, tile=32, sink=8)
    for c in feed(cache):
        contents = layer_contents(c)
        assert contents.kind == "kvarn" and contents.scores is None
        assert np.shape(contents.positions) == (N_KV, c.offset) == (N_KV, c.size())
        assert np.array_equal(contents.positions[0], np.arange(c.offset))
    assert cache.n_tiles() > 0


@pytest.mark.parametrize("strategy", ["requantize", "tile"])
def test_h2o_kvarn_reports_its_slots_and_scores(strategy):
    """Slots move when damaged tiles are re-packed or whole tiles leave; positions follow."""
    cache = H2OKVarNCache(96, tile=32, sink=4, heavy=40, recent=52, strategy=strategy)
    for c in feed(cache, FEED * 3):
        contents = layer_contents(c)
        assert contents.kind == "h2o"
        assert_sorted_unique(contents)
        n = c.size()
        assert np.shape(contents.positions) == (N_KV, n)
        slots, scores = np.array(c.positions[0]), np.array(c.scores[0])
        for h in range(N_KV):
            by_position = dict(zip(slots[h], scores[h], strict=True))
            assert set(contents.positions[h]) == set(by_position)
            assert np.allclose(contents.scores[h], [by_position[p] for p in contents.positions[h]])
        if c.evicted:
            protected = {*range(4), *range(c.offset - 52, c.offset)}
            assert all(protected <= set(row) for row in contents.positions)
    assert cache.evicted > 0 and (contents.sink, contents.recent) == (4, 52)


def test_state_caches_hold_no_positions():
    assert layer_contents(ArraysCache(2)) is None


# ---------------------------------------------------------------------- the report


class CharTokenizer:
    """Token i is the character chr(97 + i % 26): enough for reports without a model."""

    class Detokenizer:
        def __init__(self):
            self.text = ""

        def add_token(self, token: int) -> None:
            self.text += chr(97 + token % 26)

        def finalize(self) -> None:
            pass

    @property
    def detokenizer(self):
        return self.Detokenizer()


def bits(bitmap: str, n: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(bitmap), np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def figures(**given) -> dict:
    """A session's figures as Session.refresh_stats publishes them."""
    names = ("logical_tokens", "stored_tokens", "bytes", "evictions", "last_used")
    base = {"id": "s", "policy": "h2o", "max_kv": 28, "preset": "heavy", "score": "attn"}
    return {**base, **dict.fromkeys(names, 0), "spilled": False, "busy": False, **given}


def contents_of(caches: list, stats: dict) -> SessionContents:
    n = max(c.offset for c in caches)
    layers = [layer_contents(c) for c in caches]
    return SessionContents(stats, list(range(n)), layers, [])


def test_report_counts_holders_per_token():
    h2o = H2OKVCache(28, sink=2, heavy=12, recent=14, evict_batch=1)
    rotating = RotatingKVCache(max_size=24, keep=2)
    for _ in zip(feed(h2o), feed(rotating), strict=True):
        pass
    stats = figures(logical_tokens=h2o.offset)
    report = cache_report(contents_of([h2o, rotating], stats), CharTokenizer()).model_dump()
    n = h2o.offset
    assert report["id"] == "s" and report["layers"] == 2 and report["kv_heads"] == N_KV
    assert report["segments"] == {"kind": "h2o", "sink": 2, "recent": 14}
    assert len(report["heads"]) == 2 * N_KV
    maps = [bits(h["bitmap"], n) for h in report["heads"]]
    assert [int(m.sum()) for m in maps] == [h["held"] for h in report["heads"]]
    assert report["tokens"]["held"] == np.sum(maps, axis=0).tolist()
    assert report["heads"][0]["held"] == h2o.size()
    # Scores are H2O's: a mean over the H2O heads holding the token, None where none does.
    scores, h2o_maps = report["tokens"]["score"], maps[:N_KV]
    for p in range(n):
        assert (scores[p] is None) == (not any(m[p] for m in h2o_maps))
    slots, values = np.array(h2o.positions[0, :, : h2o.size()]), np.array(h2o.scores[0])
    p = int(slots[0, 5])
    holders = [values[h][list(slots[h]).index(p)] for h in range(N_KV) if p in slots[h]]
    assert scores[p] == pytest.approx(np.mean(holders), rel=1e-3)
    assert "".join(report["tokens"]["text"]) == "".join(chr(97 + i % 26) for i in range(n))


def test_report_of_a_spilled_session_has_tokens_only():
    stats = figures(spilled=True)
    report = cache_report(SessionContents(stats, [1, 2, 3], [], []), CharTokenizer()).model_dump()
    assert report["tokens"]["held"] is None and report["tokens"]["score"] is None
    assert report["heads"] == [] and report["tokens"]["text"] == ["b", "c", "d"]


def test_report_of_a_long_session_stays_small():
    """8k tokens over 30 layers x 3 KV heads, max_kv 1433: about 330 KB, 130 KB of bitmaps."""
    n, held, rng = 8192, 1433, np.random.default_rng(0)
    layers = []
    for _ in range(30):
        rows = np.sort([rng.choice(n, held, replace=False) for _ in range(3)], axis=1)
        scores = rng.random(rows.shape).astype(np.float32)
        layers.append(LayerContents("h2o", n, rows.astype(np.int32), scores, 4, 700))
    contents = SessionContents(figures(), list(range(n)), layers, [])
    report = cache_report(contents, CharTokenizer()).model_dump()
    size = len(json.dumps(report))
    assert size < 400_000, size
    assert sum(report["tokens"]["held"]) == 30 * 3 * held


def test_token_texts_join_to_the_decoded_text(default_model):
    """Characters split over several byte-level tokens go to the token that completes them."""
    _, tokenizer = default_model
    text = "Café — 日本語 🙂\nnew line"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = token_texts(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)
