"""KVarN: Hadamard rotation, Sinkhorn tiles, the kvarn and h2o-kvarn caches, rotated h2o-q4.

Synthetic tensors and tiny random-weight models only; quality on the default model
is bench/quantized.py's (docs/quantized.md).
"""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from test_quantized_cache import feed_scores  # scores by position, the same in every cache

import cache  # noqa: F401  (registers the cache classes with mlx-lm)
from cache import ATTENTION, H2OKVarNCache, H2OKVCache, KVarNCache, QuantizedH2OKVCache, make_cache
from cache.attention import ScoredAttention
from cache.budget import ModelShape, cache_bytes, max_kv_within
from cache.factory import dense_layers, outgrows_dense, pack_dense, spec_as_held
from cache.policies.full import FullKVCache, plain
from cache.policies.kvarn_tiles import (
    SINKHORN_ITERS,
    encode_keys,
    encode_tiles,
    encode_values,
    fit_quantize,
    imbalance,
    pack_codes,
    sinkhorn,
)
from cache.router import uninstall_router
from config.cache_spec import H2O_KVARN_VALUE_GROUP, KVARN_PRESETS, CacheSpec
from kernels import reference
from kernels.hadamard import hadamard_block, rotate, rotation_matrix
from kernels.kvarn import TileFormat, dequantize_storage, kvarn_sdpa_with_probs
from kernels.reference import sdpa_with_scores
from kernels.src import EMULATOR_DIALECT, emulator, launch

B, N_Q, N_KV, D = 1, 6, 2, 64


def random_kv(rng: np.random.Generator, n: int, d: int = D) -> tuple[mx.array, mx.array]:
    shape = (B, N_KV, n, d)
    k = rng.standard_normal(shape).astype(np.float32)
    k[..., :3] *= 8  # outlier channels, as real keys have
    return mx.array(k), mx.array(rng.standard_normal(shape).astype(np.float32))


def assert_close(got: mx.array, want: mx.array, atol: float) -> None:
    np.testing.assert_allclose(np.array(got), np.array(want), atol=atol, rtol=0)


# --- rotation ------------------------------------------------------------------------


@pytest.mark.parametrize("d, block", [(64, 64), (128, 128), (96, 32), (80, 16)])
def test_rotation_is_orthonormal_and_its_own_inverse(d, block):
    assert hadamard_block(d) == block
    r = rotation_matrix(d)
    assert_close(r @ r.T, mx.eye(d), 1e-6)
    assert_close(r, r.T, 0.0)
    x = mx.random.normal((2, 3, 7, d), key=mx.random.key(d))
    assert_close(rotate(rotate(x)), x, 1e-5)
    assert_close((rotate(x) ** 2).sum(-1), (x**2).sum(-1), 1e-3)  # norms kept
    # A power of two goes through mx.hadamard_transform on the CPU: the same matrix.
    assert_close(rotate(x), x @ r, 1e-5)


@pytest.mark.parametrize("d", [63, 1])
def test_odd_head_dim_cannot_be_rotated(d):
    with pytest.raises(ValueError, match="cannot be Hadamard-rotated"):
        hadamard_block(d)


def test_attention_on_rotated_dense_storage_equals_the_original():
    """Unquantized tokens (front and tail pools only): rotation changes nothing, to 1e-5."""
    rng = np.random.default_rng(0)
    c = KVarNCache(sink=48, tile=32, head_dim=D)
    k, v = random_kv(rng, 70)  # 48 in front, 22 in the tail: no tile yet
    keys, values = c.update_and_fetch(k, v)
    assert c.n_tiles() == 0 and c.size() == 70
    q = mx.array(rng.standard_normal((B, N_Q, 3, D)).astype(np.float32))
    out, scores = ATTENTION(q, keys, values, c, 0.125, "causal")
    want_out, want_scores = sdpa_with_scores(q, k, v, 0.125, "causal")
    assert_close(scores, want_scores, 1e-5)
    assert_close(out, want_out, 1e-5)


# --- Sinkhorn tiles ---------------------------------------------------------------------


def test_sinkhorn_reduces_tile_imbalance():
    rng = np.random.default_rng(1)
    rows = np.exp(rng.standard_normal((5, 64, 1)) * 1.5)
    cols = np.exp(rng.standard_normal((5, 1, 128)) * 1.5)
    x = mx.array((rng.standard_normal((5, 64, 128)) * rows * cols).astype(np.float32))
    r, c = sinkhorn(x)
    before, after = np.array(imbalance(x)), np.array(imbalance(x / r / c))
    assert np.all(after < before / 10), (before, after)
    # Balancing never makes a tile worse, even an already balanced one.
    y = mx.array(rng.standard_normal((5, 64, 128)).astype(np.float32))
    r, c = sinkhorn(y)
    assert np.all(np.array(imbalance(y / r / c)) <= np.array(imbalance(y)) + 1e-6)


@pytest.mark.parametrize("iters", [0, SINKHORN_ITERS])
def test_compiled_tile_encoding_equals_the_encoding_op_by_op(iters):
    """encode_tiles compiled (a GPU's way) packs exactly what encode_keys/encode_values do
    op by op (the CPU's)."""
    rng = np.random.default_rng(16)
    k, v = (x.reshape(B, N_KV, 2, 32, D) for x in random_kv(rng, 64))
    fmt = TileFormat(32, 4, 2, 32)
    got = encode_tiles(k, v, fmt, iters, compiled=True)
    want = [encode_keys(k, fmt, iters), encode_values(v, fmt, iters)]
    for a, b in zip(sum(got, []), sum(want, []), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fitted_grid_packs_like_mx_quantize_with_less_error(bits):
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((512, 64)).astype(np.float32))
    words, scales, biases = fit_quantize(x, 64, bits)
    ref = mx.quantize(x, group_size=64, bits=bits)
    assert [a.shape for a in (words, scales, biases)] == [a.shape for a in ref]
    assert words.dtype == ref[0].dtype == mx.uint32
    # mx.dequantize reads the words: codes land in mx.quantize's bit layout.
    codes = mx.array(rng.integers(0, 2**bits, (3, 64)).astype(np.float32))
    ones = mx.ones((3, 1))
    unpacked = mx.dequantize(pack_codes(codes, bits), ones, 0 * ones, group_size=64, bits=bits)
    assert np.array_equal(np.array(unpacked), np.array(codes))

    def error(packed):
        back = mx.dequantize(*packed, group_size=64, bits=bits)
        return float(((back - x) ** 2).mean())

    assert error((words, scales, biases)) < 0.95 * error(ref)


def test_unit_gain_values_are_not_shrunk():
    """A value grid at unit gain reads back with no shrink along each group, where the
    least-squares grid reads it ~8% short at 2 bits (the bias attention sums up)."""
    rng = np.random.default_rng(5)
    x = mx.array((rng.standard_normal((512, 64)) * 3 + 1).astype(np.float32))

    def gain(unit_gain: bool) -> np.ndarray:
        back = mx.dequantize(*fit_quantize(x, 64, 2, unit_gain=unit_gain), group_size=64, bits=2)
        centred = x - x.mean(-1, keepdims=True)
        g = ((back - x.mean(-1, keepdims=True)) * centred).sum(-1) / (centred**2).sum(-1)
        return np.array(g)

    assert np.allclose(gain(True), 1.0, atol=1e-3)
    assert gain(False).mean() < 0.95
    # The group mean is kept.
    back = mx.dequantize(*fit_quantize(x, 64, 2, unit_gain=True), group_size=64, bits=2)
    assert_close(back.mean(-1), x.mean(-1), 1e-4)


@pytest.mark.parametrize("key_bits, value_bits", [(4, 2), (4, 4), (2, 2), (8, 8)])
def test_packed_attention_equals_attention_on_dequantized_tiles(key_bits, value_bits):
    rng = np.random.default_rng(2)
    c = KVarNCache(key_bits, value_bits, sink=8, tile=32, head_dim=D)
    for n in (40, 70, 1, 1):
        keys, values = c.update_and_fetch(*random_kv(rng, n))
    assert c.n_tiles() == 3 and c.size() == 8 + 3 * 32 + 8
    q = mx.array(rng.standard_normal((B, N_Q, 2, D)).astype(np.float32))
    fmt = c.fmt
    packed = kvarn_sdpa_with_probs(q, keys, values, 0.125, "causal", fmt)
    oracle = kvarn_sdpa_with_probs(q, keys, values, 0.125, "causal", fmt, dequantize=True)
    for got, want in zip(packed, oracle, strict=True):  # output, logits, probabilities
        assert_close(got, want, 1e-4)


def test_quantization_error_shrinks_with_the_widths():
    """The packed cache's attention approaches dense attention as widths grow."""
    rng = np.random.default_rng(3)
    k, v = random_kv(rng, 200)
    q = mx.array(rng.standard_normal((B, N_Q, 1, D)).astype(np.float32))
    want, _ = sdpa_with_scores(q, k, v, 0.125)
    errors = []
    for bits in ((2, 2), (4, 2), (4, 4), (8, 8)):
        c = KVarNCache(*bits, sink=4, tile=64, head_dim=D)
        out, _ = ATTENTION(q, *c.update_and_fetch(k, v), c, 0.125)
        errors.append(float(mx.abs(out - want).mean()))
    k2v2, k4v2, k4v4, k8v8 = errors
    assert k2v2 > k4v2 > k4v4 > k8v8 and k8v8 < 0.01, errors


# --- bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(KVARN_PRESETS))
@pytest.mark.parametrize("tokens", [2, 100, 128, 129, 300, 1000])
def test_kvarn_bytes_match_the_budget_formula(tokens, preset):
    rng = np.random.default_rng(4)
    c = KVarNCache(*KVARN_PRESETS[preset], head_dim=D)
    done = 0
    while done < tokens:
        n = min(tokens - done, 97)
        c.update_and_fetch(*random_kv(rng, n))
        done += n
    shape = ModelShape(layers=1, kv_heads=N_KV, head_dim=D, element_bytes=4, context=8192)
    assert c.nbytes == cache_bytes(shape, "kvarn", tokens, kvarn=preset)


@pytest.mark.parametrize("max_kv, tile", [(128, 32), (256, 64)])
def test_h2o_kvarn_bytes_peak_at_the_budget_formula(max_kv, tile):
    """Below max_kv 256 the tile is 32 tokens (a 64-token tile is half the heavy hitters
    there); the budget prices whichever tile the cache takes."""
    rng = np.random.default_rng(5)
    c = H2OKVarNCache(max_kv, head_dim=D)
    assert c.tile == tile
    peak = 0
    for _ in range(700):
        c.update_and_fetch(*random_kv(rng, 1))
        peak = max(peak, c.nbytes)
        c.update_scores(mx.array(rng.random((B, N_Q, 1, c.size())).astype(np.float32)))
        assert c.size() <= max_kv
    shape = ModelShape(layers=1, kv_heads=N_KV, head_dim=D, element_bytes=4, context=8192)
    assert peak == cache_bytes(shape, "h2o-kvarn", max_kv)
    assert max_kv_within(peak, shape, "h2o-kvarn") == max_kv
    assert max_kv_within(peak - 1, shape, "h2o-kvarn") < max_kv


# --- eviction ------------------------------------------------------------------------

SEGMENTS = {"sink": 4, "heavy": 72, "recent": 20}  # max_size 96


@pytest.mark.parametrize(
    "evict_batch, segments",
    [(1, SEGMENTS), (8, SEGMENTS), (8, {"sink": 0, "heavy": 76, "recent": 20})],
    ids=["batch 1", "batch 8", "no sinks"],
)
def test_h2o_kvarn_keeps_dense_h2o_positions(evict_batch, segments):
    rng = np.random.default_rng(6)
    dense = H2OKVCache(96, **segments, evict_batch=evict_batch)
    kvarn = H2OKVarNCache(96, **segments, tile=32, evict_batch=evict_batch, head_dim=D)
    for n_new in [60, *[1] * 70, 40, *[1] * 30]:  # prefill, decode, a chunk
        k, v = random_kv(rng, n_new)
        table = rng.standard_normal((N_Q, n_new, dense.offset + n_new)).astype(np.float32) * 3
        for c in (dense, kvarn):
            c.update_and_fetch(k, v)
            feed_scores(c, table, n_new)
        assert (kvarn.offset, kvarn.size(), kvarn.evicted) == (
            dense.offset,
            dense.size(),
            dense.evicted,
        )
        got = np.sort(np.array(kvarn.positions[0]), axis=-1)
        want = np.sort(np.array(dense.positions[0, :, : dense.size()]), axis=-1)
        np.testing.assert_array_equal(got, want)
    assert kvarn.evicted > 0 and kvarn.n_tiles() >= 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVarNCache(sink=16, tile=32, head_dim=D),
        lambda: H2OKVarNCache(96, **SEGMENTS, tile=32, head_dim=D),
    ],
)
def test_a_prompt_attends_to_the_tiles_unpacked(make, monkeypatch):
    """A prompt chunk (many queries, in blocks) reads the tiles dequantized once through the
    dense kernel: outputs and scores equal the packed tile kernel's over the same storage.
    kvarn, which keeps no scores, attends through mx.fast where prefill is fused (a GPU;
    forced here): no block of logits."""
    rng = np.random.default_rng(9)
    blocked, packed = make(), make()
    prompt = ScoredAttention(block=16, fused_prefill=True)
    with_logits = []
    real = reference.sdpa_with_probs
    monkeypatch.setattr(reference, "sdpa_with_probs", lambda *a: with_logits.append(1) or real(*a))
    for n_new in [60, 1, 40, 1, 50]:  # tiles fill; h2o-kvarn evicts
        k, v = random_kv(rng, n_new)
        q = mx.array(rng.standard_normal((B, N_Q, n_new, D)).astype(np.float32))
        mask = blocked.make_mask(n_new)
        with_logits.clear()
        out = prompt.attend_scored(q, *blocked.update_and_fetch(k, v), blocked, 0.125, mask)
        if n_new > 1:
            assert bool(with_logits) == blocked.keeps_scores
        want, scores = ATTENTION(q, *packed.update_and_fetch(k, v), packed, 0.125, mask)
        packed.update_scores(scores)
        assert_close(out, want, 1e-4)
        assert blocked.size() == packed.size() and packed.n_tiles() >= 1
        if packed.scores is not None:
            np.testing.assert_array_equal(np.array(blocked.positions), np.array(packed.positions))
            np.testing.assert_allclose(
                np.array(blocked.scores), np.array(packed.scores), rtol=1e-4, atol=1e-6
            )


def test_h2o_kvarn_tile_rule_drops_whole_tiles_with_the_lowest_scores():
    rng = np.random.default_rng(7)
    c = H2OKVarNCache(96, **SEGMENTS, tile=32, strategy="tile", head_dim=D)
    c.update_and_fetch(*random_kv(rng, 96))
    c.update_scores(mx.zeros((B, N_Q, 96, 96)))
    k, v = random_kv(rng, 1)
    c.update_and_fetch(k, v)
    # Per-token scores set by hand: in head 0 tile 1 (positions 36..67) scores lowest.
    pos = np.array(c.positions[0])
    score = np.ones(pos.shape, np.float32)
    score[0] = np.where((pos[0] >= 36) & (pos[0] < 68), 0.0, 1.0)
    score[1] = np.where(pos[1] < 36, 0.0, 1.0)  # head 1: tile 0 (positions 4..35)
    c.scores = mx.array(score[None])
    c.update_scores(mx.zeros((B, N_Q, 1, 97)))  # uniform: the same increment for every slot
    kept = np.array(c.positions[0])
    assert c.size() == 97 - 32 and c.evicted == 32
    assert not np.any((kept[0] >= 36) & (kept[0] < 68)) and np.all(
        np.isin(np.arange(4, 36), kept[0])
    )
    assert not np.any((kept[1] >= 4) & (kept[1] < 36)) and np.all(
        np.isin(np.arange(36, 68), kept[1])
    )


# --- protocol ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVarNCache(sink=16, tile=32, head_dim=D),
        lambda: H2OKVarNCache(96, **SEGMENTS, tile=32, head_dim=D),
    ],
)
def test_save_load_round_trip(tmp_path, make):
    rng = np.random.default_rng(8)
    c, empty = make(), make()
    for n in (50, *[1] * 80):
        keys, values = c.update_and_fetch(*random_kv(rng, n))
        if hasattr(c, "scores"):
            c.update_scores(mx.array(rng.random((B, N_Q, n, c.size())).astype(np.float32)))
    path = str(tmp_path / "kvarn.safetensors")
    save_prompt_cache(path, [c, empty])
    loaded, loaded_empty = load_prompt_cache(path)
    assert type(loaded) is type(c) and loaded_empty.empty()
    assert (loaded.offset, loaded.size(), loaded.nbytes) == (c.offset, c.size(), c.nbytes)
    q = mx.array(rng.standard_normal((B, N_Q, 1, D)).astype(np.float32))
    k, v = random_kv(rng, 1)
    want = ATTENTION(q, *c.update_and_fetch(k, v), c, 0.125)
    got = ATTENTION(q, *loaded.update_and_fetch(k, v), loaded, 0.125)
    assert_close(got[0], want[0], 1e-6)
    assert_close(got[1], want[1], 1e-6)


@pytest.mark.parametrize("iters", [None, 0])
def test_h2o_kvarn_balances_tiles_unless_asked_not_to(tmp_path, iters):
    """h2o-kvarn's tiles are Sinkhorn-balanced by default; with no rounds they carry unit
    factors (bench.kvarn_ablation's no-sinkhorn case), and the knob survives save/load."""
    rng = np.random.default_rng(11)
    knob = {} if iters is None else {"sinkhorn_iters": iters}
    c = H2OKVarNCache(96, **SEGMENTS, tile=32, head_dim=D, **knob)
    c.update_and_fetch(*random_kv(rng, 80))
    factors = [c.tiles[0][3], c.tiles[1][3]]  # keys' token factor, values' channel factor
    unit = all(bool(mx.all(f == 1).item()) for f in factors)
    assert unit == (iters == 0)
    path = str(tmp_path / "h2o_kvarn.safetensors")
    save_prompt_cache(path, [c])
    (loaded,) = load_prompt_cache(path)
    assert loaded.sinkhorn_iters == c.sinkhorn_iters == (SINKHORN_ITERS if iters is None else 0)


@pytest.mark.parametrize("repack_iters", [None, 4])
def test_h2o_kvarn_repacks_without_sinkhorn_unless_asked(repack_iters):
    """An eviction re-packs damaged tiles unbalanced by default (unit factors), while
    intact tiles keep the Sinkhorn factors they were packed with."""
    rng = np.random.default_rng(13)
    knob = {} if repack_iters is None else {"repack_sinkhorn_iters": repack_iters}
    c = H2OKVarNCache(96, **SEGMENTS, tile=32, evict_batch=8, head_dim=D, **knob)
    c.update_and_fetch(*random_kv(rng, 96))
    c.update_scores(mx.zeros((B, N_Q, 96, 96)))
    c.update_and_fetch(*random_kv(rng, 1))
    # Every head: the 8 lowest scores sit in tile 1 (positions 36..43): tile 0 stays
    # intact, tile 1's 24 survivors and 8 tail tokens are packed again.
    pos = np.array(c.positions[0])
    c.scores = mx.array(np.where((pos >= 36) & (pos < 44), 0.0, 1.0).astype(np.float32)[None])
    c.update_scores(mx.zeros((B, N_Q, 1, 97)))
    assert c.evicted == 8 and c.n_tiles() == 2
    unit = [bool(mx.all(c.tiles[side][3][:, :, i] == 1).item()) for side in (0, 1) for i in (0, 1)]
    repacked_unit = repack_iters is None
    assert unit == [False, repacked_unit, False, repacked_unit]  # keys tiles 0, 1; values


def test_value_groups_per_policy_and_in_older_saved_caches():
    """h2o-kvarn packs values in groups of H2O_KVARN_VALUE_GROUP channels, kvarn in the
    widest that fits; an h2o-kvarn cache saved before the group was stored (when it
    packed the widest) still reads as the widest."""
    rng = np.random.default_rng(12)
    dense, evicting = KVarNCache(sink=8, tile=32), H2OKVarNCache(96, **SEGMENTS, tile=32)
    for c in (dense, evicting):
        c.update_and_fetch(*random_kv(rng, 80))
    assert dense.fmt.group_size == D and evicting.fmt.group_size == H2O_KVARN_VALUE_GROUP
    assert evicting.tiles[1][1].shape[-1] == D // H2O_KVARN_VALUE_GROUP  # scales per token
    # An h2o-kvarn cache saved before the group was stored (packed in groups of 64).
    before = H2OKVarNCache(96, **SEGMENTS, tile=32, value_group_size=D)
    before.update_and_fetch(*random_kv(rng, 80))
    *arrays, meta = before.state
    meta = json.loads(meta)
    del meta["value_group_size"]
    loaded = H2OKVarNCache.from_state((*arrays, json.dumps(meta)))
    assert loaded.fmt.group_size == D
    q = mx.array(rng.standard_normal((B, N_Q, 1, D)).astype(np.float32))
    k, v = random_kv(rng, 1)
    want = ATTENTION(q, *before.update_and_fetch(k, v), before, 0.125)
    got = ATTENTION(q, *loaded.update_and_fetch(k, v), loaded, 0.125)
    assert_close(got[0], want[0], 1e-6)
    with pytest.raises(ValueError, match="value group"):
        KVarNCache(head_dim=96, value_group_size=64)
    with pytest.raises(ValueError, match="value groups"):
        KVarNCache(value_group_size=16)


def test_bad_head_dims_fail_at_creation():
    with pytest.raises(ValueError, match="Hadamard"):
        KVarNCache(head_dim=63)
    with pytest.raises(ValueError, match="multiple of 32"):
        KVarNCache(head_dim=48)  # rotatable (blocks of 16), but no value group fits
    with pytest.raises(ValueError, match="multiple of the quantization group"):
        QuantizedH2OKVCache(64, bits=4, group_size=64, rotate=True, head_dim=48)
    with pytest.raises(ValueError, match="tile"):
        KVarNCache(tile=100)


def test_rotated_q4_attention_equals_dequantized_rotated_attention():
    """Rotated packed storage: the router's path equals dense attention on the rotated,
    dequantized K/V with the output rotated back. (No sinks or tail: all of it packed.)"""
    rng = np.random.default_rng(9)
    c = QuantizedH2OKVCache(64, sink=0, bits=4, rotate=True, head_dim=D, dense_recent=0)
    k, v = random_kv(rng, 40)
    keys, values = c.update_and_fetch(k, v)
    q = mx.array(rng.standard_normal((B, N_Q, 1, D)).astype(np.float32))
    out, scores = ATTENTION(q, keys, values, c, 0.125)
    deq = [mx.dequantize(*x, group_size=64, bits=4) for x in (keys, values)]
    want_out, want_scores = sdpa_with_scores(rotate(q), *deq, 0.125)
    assert_close(scores, want_scores, 1e-4)
    assert_close(out, rotate(want_out), 1e-4)
    # and it is closer to the exact attention than unrotated 4-bit storage here
    exact, _ = sdpa_with_scores(q, k, v, 0.125)
    plain = QuantizedH2OKVCache(64, sink=0, bits=4, head_dim=D, dense_recent=0)
    plain_out, _ = ATTENTION(q, *plain.update_and_fetch(k, v), plain, 0.125)
    assert float(mx.abs(out - exact).max()) < float(mx.abs(plain_out - exact).max())


def test_h2o_kvarn_eviction_keeps_intact_tiles_bit_for_bit():
    """Tiles that lost no token keep their packed bytes: only damaged tiles are re-packed."""
    rng = np.random.default_rng(10)
    c = H2OKVarNCache(96, **SEGMENTS, tile=32, head_dim=D)
    c.update_and_fetch(*random_kv(rng, 96))
    c.update_scores(mx.zeros((B, N_Q, 96, 96)))
    c.update_and_fetch(*random_kv(rng, 1))
    # Every head: the lowest scores sit in tile 1 (positions 36..67); tile 0 stays intact.
    pos = np.array(c.positions[0])
    c.scores = mx.array(np.where((pos >= 36) & (pos < 68), 0.0, 1.0).astype(np.float32)[None])
    before = [np.array(a) for a in c.tiles[0] + c.tiles[1]]
    c.update_scores(mx.zeros((B, N_Q, 1, 97)))
    assert c.evicted == 32 and c.size() == 97 - 32
    after = [np.array(a) for a in c.tiles[0] + c.tiles[1]]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new[:, :, 0], old[:, :, 0])  # tile 0 untouched


@pytest.mark.parametrize("score", ["mean", "tova"])
def test_a_decode_eviction_is_one_compiled_call_with_the_same_result(score, monkeypatch):
    """A decode's eviction (the cache one token over max_size) runs `_evict_tokens` as one
    compiled call: the same tiles, tail, scores, positions and counters as op by op, at
    every eviction of a long decode (the tail at another length each time it packs)."""
    rng = np.random.default_rng(15)
    make = lambda: H2OKVarNCache(96, **SEGMENTS, tile=32, score=score, head_dim=D)  # noqa: E731
    compiled, by_ops = make(), make()
    by_ops._evict_tokens_compiled = by_ops._evict_tokens
    calls = []
    run = H2OKVarNCache._evict_tokens_compiled
    monkeypatch.setattr(
        H2OKVarNCache, "_evict_tokens_compiled", lambda c: calls.append(1) or run(c)
    )
    for n_new in [80, *[1] * 100]:
        k, v = random_kv(rng, n_new)
        table = rng.standard_normal((N_Q, n_new, compiled.offset + n_new)).astype(np.float32)
        for c in (compiled, by_ops):
            c.update_and_fetch(k, v)
            feed_scores(c, table, n_new)
        assert (compiled.n_tail, compiled.evicted, compiled.size()) == (
            by_ops.n_tail, by_ops.evicted, by_ops.size(),
        )  # fmt: skip
        for got, want in zip(
            [compiled.scores, compiled.positions, *compiled.tail, *sum(compiled.tiles, [])],
            [by_ops.scores, by_ops.positions, *by_ops.tail, *sum(by_ops.tiles, [])],
            strict=True,
        ):
            np.testing.assert_array_equal(np.array(got), np.array(want))
    assert len(calls) >= 3 and compiled.evicted > 90


def test_h2o_kvarn_heads_keep_their_own_intact_tiles():
    """Heads that lose tokens from different tiles: a head whose tile lost nothing keeps
    its bytes, a head whose tiles all lost tokens re-packs its survivors, in position order."""
    rng = np.random.default_rng(14)
    c = H2OKVarNCache(96, **SEGMENTS, tile=32, head_dim=D)
    k, v = random_kv(rng, 96)
    c.update_and_fetch(k, v)
    c.update_scores(mx.zeros((B, N_Q, 96, 96)))
    c.update_and_fetch(*random_kv(rng, 1))
    # Head 0 loses positions 36..67 (tile 1); head 1 loses 20..51, half of each tile.
    pos = np.array(c.positions[0])
    low = [(pos[0] >= 36) & (pos[0] < 68), (pos[1] >= 20) & (pos[1] < 52)]
    c.scores = mx.array(np.where(np.stack(low), 0.0, 1.0).astype(np.float32)[None])
    before = [np.array(a) for a in c.tiles[0] + c.tiles[1]]
    c.update_scores(mx.zeros((B, N_Q, 1, 97)))
    assert c.evicted == 32 and c.n_tiles() == 1
    after = [np.array(a) for a in c.tiles[0] + c.tiles[1]]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new[0, 0, 0], old[0, 0, 0])  # head 0: tile 0 kept
    assert not np.array_equal(after[0][0, 1, 0], before[0][0, 1, 0])  # head 1: re-packed
    kept = [np.sort(pos[h][~low[h]]) for h in range(N_KV)]
    np.testing.assert_array_equal(np.array(c.positions[0]), np.stack(kept))
    # Head 1's tile holds its first 32 survivors after the sinks (4-bit: near, not exact).
    keys, _ = dequantize_storage(*c._fetch(), c.fmt)
    got, want = keys[0, 1, 4:36], rotate(k)[0, 1][mx.array(kept[1][4:36])]
    rel = float(mx.sqrt(mx.mean((got - want) ** 2) / mx.mean(want**2)))
    assert rel < 0.2, rel


def test_emulated_gpu_kernel_serves_rotated_packed_storage():
    """The Metal/CUDA quantized kernel body (CPU emulation) on rotated packed K/V, with the
    query rotated before and the output rotated once after, equals the reference."""
    if emulator.compiler() is None:
        pytest.skip("the CPU emulation of the kernel bodies needs a C++ compiler")
    kernels = launch.DecodeKernels(EMULATOR_DIALECT, emulator.make_kernel)
    rng = np.random.default_rng(11)
    c = QuantizedH2OKVCache(64, sink=0, bits=4, rotate=True, head_dim=D, dense_recent=0)
    keys, values = c.update_and_fetch(*random_kv(rng, 40))
    q = mx.array(rng.standard_normal((B, N_Q, 1, D)).astype(np.float32))
    assert launch.supports(rotate(q), keys[0], None, group_size=64, bits=4)
    out, scores = kernels.quantized(rotate(q), keys, values, 0.125, None, 64, 4)
    want_out, want_scores = ATTENTION(q, keys, values, c, 0.125)
    assert_close(scores, want_scores, 1e-4)
    assert_close(rotate(out), want_out, 1e-4)


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVarNCache(sink=16, tile=32, head_dim=D),
        lambda: H2OKVarNCache(96, **SEGMENTS, tile=32, head_dim=D),
    ],
)
def test_decode_reads_kvarn_tiles_through_the_gpu_kernel(emulated_gpu, make):
    """With a GPU backend present (here "metal" played by the CPU emulation of its kernel
    bodies), a decode query over KVarN storage goes to the KVarN decode kernel, prompt
    chunks to the reference; outputs, and the positions H2O keeps from the kernel's
    scores, equal the reference backend's."""
    on_gpu, on_reference = ScoredAttention(backend="metal"), ScoredAttention(backend="reference")
    rng = np.random.default_rng(12)
    caches = make(), make()
    for n_new in [60, *[1] * 6, 40, *[1] * 6]:  # tiles fill; h2o-kvarn evicts
        k, v = random_kv(rng, n_new)
        q = mx.array(rng.standard_normal((B, N_Q, n_new, D)).astype(np.float32))
        got, want = (
            attention(q, *c.update_and_fetch(k, v), c, 0.125, c.make_mask(n_new))
            for attention, c in zip((on_gpu, on_reference), caches, strict=True)
        )
        assert_close(got[0], want[0], 1e-4)
        assert_close(got[1], want[1], 1e-4)
        for c, (_, logits) in zip(caches, (got, want), strict=True):
            c.update_scores(logits)
        if caches[0].scores is not None:
            np.testing.assert_array_equal(*(np.array(c.positions) for c in caches))
    # every decode step, no prompt chunk
    assert [(name, shape[2]) for name, shape, _ in emulated_gpu] == [("kvarn", 1)] * 12
    assert caches[0].n_tiles() >= 1
    assert isinstance(caches[0], KVarNCache) and (caches[0].scores is None or caches[0].evicted)


# --- end to end on a tiny random-weight model ----------------------------------------


def tiny_llama(head_dim: int):
    args = {
        "model_type": "llama",
        "hidden_size": 2 * head_dim,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128,
        "tie_word_embeddings": False,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(args))
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("policy", ["kvarn", "h2o-kvarn"])
def test_tiny_model_decodes_through_kvarn_caches(policy):
    model = tiny_llama(64)
    try:
        prompt = mx.random.randint(0, 128, (1, 400), key=mx.random.key(1))
        logits = {}
        for name in ("full", policy):
            caches = make_cache(model, policy=name, max_kv=256)
            for start in range(0, 400, 128):  # chunked prefill: tiles form mid-chunk
                out = model(prompt[:, start : start + 128], cache=caches)
            steps = [out[:, -1]]
            for t in range(20):
                steps.append(model(prompt[:, t : t + 1], cache=caches)[:, -1])
            logits[name] = mx.stack(steps)
        held = caches[0]
        assert held.n_tiles() >= 1 and held.offset == 420
        if policy == "h2o-kvarn":
            assert held.evicted > 0 and held.size() <= 256
        else:  # nothing evicted: close to the full cache
            p, q = (mx.softmax(logits[n], axis=-1) for n in ("full", policy))
            assert float((p * (mx.log(p) - mx.log(q))).sum(-1).max()) < 0.01
    finally:
        uninstall_router(model)


@pytest.mark.parametrize("score", ["mean", "attn"])
def test_a_compiled_decode_attends_and_scores_as_op_by_op(monkeypatch, score):
    """h2o-kvarn's decode attends its front, tiles and tail and scores them in one compiled
    call (`attend_decode`, a trace per tail length): the same logits, scores, positions
    and evictions as op by op, across tiles packed and evictions re-packed."""
    model = tiny_llama(64)
    calls = []
    real = H2OKVarNCache.attend_decode
    monkeypatch.setattr(
        H2OKVarNCache, "attend_decode", lambda self, *a: calls.append(1) or real(self, *a)
    )
    try:
        prompt = mx.random.randint(0, 128, (1, 150), key=mx.random.key(2))
        runs = {}
        for compiled in (True, False):
            monkeypatch.setattr(ATTENTION, "compiled_decode", compiled)
            caches = make_cache(model, policy="h2o-kvarn", max_kv=128, score=score)
            steps = [model(prompt[:, :100], cache=caches)[:, -1]]
            steps += [model(prompt[:, t : t + 1], cache=caches)[:, -1] for t in range(100, 150)]
            runs[compiled] = np.array(mx.stack(steps)), caches
            assert (len(calls) == 2 * 50) == compiled  # every layer's every decode step
            calls.clear()
        np.testing.assert_allclose(runs[True][0], runs[False][0], atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(runs[True][1], runs[False][1], strict=True):
            assert mine.evicted == theirs.evicted > 0 and mine.n_tiles() >= 2
            np.testing.assert_array_equal(np.array(mine.positions), np.array(theirs.positions))
            np.testing.assert_allclose(
                np.array(mine.scores), np.array(theirs.scores), atol=1e-5, rtol=1e-5
            )
    finally:
        uninstall_router(model)


def test_make_cache_rejects_a_head_dim_kvarn_cannot_pack():
    model = tiny_llama(16)  # no value group of 32+ fits
    try:
        with pytest.raises(ValueError, match="head dim 16"):
            make_cache(model, policy="kvarn")
    finally:
        uninstall_router(model)


def test_4bit_keys_are_rotated_unless_asked_not_to():
    """h2o-q4 rotates by default (the same bytes, half the perplexity cost); rotate=False
    keeps plain packing; 8-bit keys stay unrotated unless asked."""
    model = tiny_llama(64)
    try:
        rotated = {
            (policy, rotate): make_cache(model, policy=policy, rotate=rotate)[0].rotate
            for policy in ("h2o-q4", "h2o-q8", "h2o-mixed")
            for rotate in (None, False, True)
        }
    finally:
        uninstall_router(model)
    assert rotated == {
        ("h2o-q4", None): True, ("h2o-q4", False): False, ("h2o-q4", True): True,
        ("h2o-q8", None): False, ("h2o-q8", False): False, ("h2o-q8", True): True,
        ("h2o-mixed", None): False, ("h2o-mixed", False): False, ("h2o-mixed", True): True,
    }  # fmt: skip


def test_a_dense_first_kvarn_conversation_packs_when_it_outgrows_its_dense_share():
    """`dense_until` (what `auto` sets): the layers start as plain dense caches and are
    packed once the conversation would hold more (pack_dense): the packed tiles are the
    ones a kvarn cache fed the same keys chunk by chunk holds, the dense buffers go, and
    decoding goes on close to the dense caches'."""
    model = tiny_llama(64)
    try:
        spec = CacheSpec("kvarn", 1024, dense_until=300)
        caches = make_cache(model, spec)
        assert all(plain(c) for c in caches) and spec_as_held(spec, caches) == spec
        prompt = mx.random.randint(0, 128, (1, 300), key=mx.random.key(2))
        for start in range(0, 280, 140):
            model(prompt[:, start : start + 140], cache=caches)
        assert not outgrows_dense(spec, caches, 300) and outgrows_dense(spec, caches, 301)
        held = [(c.keys[..., :280, :], c.values[..., :280, :]) for c in caches]
        dense = copy.deepcopy(caches)

        caches = pack_dense(caches, make_cache(model, spec.replace(dense_until=0)))
        assert all(type(c) is KVarNCache for c in caches)
        assert spec_as_held(spec, caches) == spec.replace(dense_until=0)
        assert not outgrows_dense(spec, caches, 10_000)  # packed once
        for c, (k, v) in zip(caches, held, strict=True):
            assert c.offset == 280 and c.n_tiles() == 1 and c.n_tail == 280 - 128 - 128
            fed = KVarNCache()
            for start in range(0, 280, 100):  # other chunks: tiles pack as they fill
                fed.update_and_fetch(k[..., start : start + 100, :], v[..., start : start + 100, :])
            for a, b in zip(tree_flatten(c.tiles), tree_flatten(fed.tiles), strict=True):
                assert_close(a[1], b[1], 1e-6)

        steps = {"dense": [], "packed": []}
        for t in range(280, 300):
            for name, held_caches in (("dense", dense), ("packed", caches)):
                steps[name].append(model(prompt[:, t : t + 1], cache=held_caches)[:, -1])
        p, q = (mx.softmax(mx.stack(steps[n]), axis=-1) for n in ("dense", "packed"))
        assert float((p * (mx.log(p) - mx.log(q))).sum(-1).max()) < 0.01
    finally:
        uninstall_router(model)


def test_a_conversation_packed_a_layer_at_a_time_decodes_between_and_ends_as_packed_at_once():
    """pack_dense(layers=n) packs the first n plain layers and leaves the rest (what the
    batcher does over the rounds before a session's dense share): a half-packed session
    still outgrows its share, decodes through both kinds of layer, adopts from the
    packed spec (spec_as_held), and the layers packed a round later hold the tiles of
    packing them all at once, for the same tokens."""
    model = tiny_llama(64)
    try:
        spec = CacheSpec("kvarn", 1024, dense_until=300)
        prompt = mx.random.randint(0, 128, (1, 300), key=mx.random.key(4))
        once, stepwise = make_cache(model, spec), make_cache(model, spec)
        for caches in (once, stepwise):
            model(prompt[:, :280], cache=caches)
        packed = spec.replace(dense_until=0)
        once = pack_dense(once, make_cache(model, packed))
        stepwise = pack_dense(stepwise, make_cache(model, packed), layers=1)
        assert [type(c) for c in stepwise] == [KVarNCache, FullKVCache]
        assert dense_layers(stepwise) == 1 and outgrows_dense(spec, stepwise, 301)
        assert spec_as_held(spec, stepwise) == packed  # its KVarN layer adopts a KVarN's
        # a decode step through a packed and a plain layer: the packed-at-once logits
        mine = model(prompt[:, 280:281], cache=stepwise)[:, -1]
        theirs = model(prompt[:, 280:281], cache=once)[:, -1]
        p, q = mx.softmax(theirs, axis=-1), mx.softmax(mine, axis=-1)
        assert float((p * (mx.log(p) - mx.log(q))).sum()) < 0.01
        stepwise = pack_dense(stepwise, make_cache(model, packed), layers=1)
        assert dense_layers(stepwise) == 0 and not outgrows_dense(spec, stepwise, 10_000)
        last_once, last_stepwise = once[1], stepwise[1]
        assert last_stepwise.offset == last_once.offset == 281
        assert last_stepwise.meta_state == last_once.meta_state
        mine, theirs = (tree_flatten(c.state) for c in (last_stepwise, last_once))
        assert len(mine) == len(theirs) > 2
        for a, b in zip(mine, theirs, strict=True):
            if isinstance(a[1], mx.array):
                assert_close(a[1], b[1], 1e-6)
    finally:
        uninstall_router(model)
