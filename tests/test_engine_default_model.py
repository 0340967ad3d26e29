"""The H2O engine on the embedded default model (SmolLM2-135M-Instruct, float32)."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

import cache.attention
from cache import H2OKVCache, make_cache
from kernels.reference import expand_mask

pytestmark = pytest.mark.slow(seconds=55)


def essay_ids(tokenizer, text: str, n: int) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def test_default_model_answers_paris(default_model):
    from mlx_lm import generate

    model, tokenizer = default_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    caches = make_cache(model, "h2o", max_kv=256)
    text = generate(model, tokenizer, prompt, max_tokens=20, prompt_cache=caches)
    assert "Paris" in text


def test_h2o_logits_equal_kvcache_until_eviction(default_model, essay_text):
    """300-token prompt + 16 greedy decode steps: H2O (max_kv 512) == mlx-lm KVCache."""
    model, tokenizer = default_model
    prompt = mx.array(essay_ids(tokenizer, essay_text, 300))[None]
    full = [KVCache() for _ in model.layers]
    h2o = make_cache(model, "h2o", max_kv=512)
    a, b = model(prompt, cache=full)[:, -1], model(prompt, cache=h2o)[:, -1]
    worst = mx.abs(a - b).max().item()
    for _ in range(16):
        token = mx.argmax(a, axis=-1).reshape(1, 1)  # both follow the full cache's choice
        a, b = model(token, cache=full)[:, -1], model(token, cache=h2o)[:, -1]
        worst = max(worst, mx.abs(a - b).max().item())
    assert worst <= 1e-4
    assert all(c.evicted == 0 and c.offset == 316 for c in h2o)


class OffsetResetBug(H2OKVCache):
    """The known RoPE bug: after evicting, offset is reset to the physical length."""

    def _evict(self):
        super()._evict()
        self.offset = self.size()


def decode_perplexity(model, ids: list[int], caches, prefill: int = 64) -> float:
    """Teacher-forced perplexity, one token per step through `caches` after a short prefill."""
    seq = mx.array(ids)[None]
    logits = model(seq[:, :prefill], cache=caches)[:, -1]
    nll = []
    for i in range(prefill, len(ids)):
        nll.append(nn.losses.cross_entropy(logits, seq[:, i]))
        logits = model(seq[:, i : i + 1], cache=caches)[:, -1]
    return math.exp(mx.concatenate(nll).mean().item())


def test_rope_positions_survive_eviction(default_model, essay_text, monkeypatch):
    """Decoding 96 tokens at max_kv=64 (every step past the prompt evicts) stays as good
    as a full cache.

    Measure: perplexity of real prose, fed one token per step through the
    cache exactly as generation does (teacher forcing, so a degenerate greedy
    loop cannot flatter it). Wrong RoPE positions shift every query against
    every stored key and wreck it; H2O's own cost at 64 slots is a few percent
    (measured on the essays' first 160 tokens: full 36.5, H2O 38.6 (1.06x), the
    offset-reset bug 225 (6.2x); at max_kv 128 over 300 tokens 24.4 / 24.9 / 88).
    Bound: 1.15x full.
    """
    model, tokenizer = default_model
    ids = essay_ids(tokenizer, essay_text, 160)
    seq = mx.array(ids)[None]
    full_logits = model(seq[:, :-1])
    full_ppl = math.exp(nn.losses.cross_entropy(full_logits[:, 63:], seq[:, 64:]).mean().item())

    caches = make_cache(model, "h2o", max_kv=64)
    h2o_ppl = decode_perplexity(model, ids, caches)
    assert all(c.evicted >= 64 and c.offset == 160 and c.size() <= 64 for c in caches)
    assert h2o_ppl <= 1.15 * full_ppl

    # The bug fails it, already over the first 48 decoded tokens, against the full cache's
    # perplexity over the same tokens (measured: 90.8 against 18.5, 4.9x).
    monkeypatch.setattr("cache.policies.h2o.H2OKVCache", OffsetResetBug)  # the h2o record's class
    buggy_ppl = decode_perplexity(model, ids[:112], make_cache(model, "h2o", max_kv=64))
    full_48 = nn.losses.cross_entropy(full_logits[:, 63:111], seq[:, 64:112]).mean().item()
    assert buggy_ppl > 1.15 * math.exp(full_48)


def test_chunked_prefill_mask_and_output(default_model, essay_text, monkeypatch):
    """1200-token prompt in 512-token chunks at max_kv=256: every query block's mask and
    output match an explicit float64 computation over what the cache holds."""
    model, tokenizer = default_model
    # a full chunk into the empty cache, one into a full cache, then a shorter one
    ids = essay_ids(tokenizer, essay_text, 1200)
    layer, step = 7, 512
    block = cache.attention.ATTENTION.block
    calls = []
    real = cache.attention.reference.sdpa_with_probs

    def recording(q, k, v, scale, mask=None, bias=None):
        assert bias is None  # plain h2o has no per-key bias (h2o-merge's log(count))
        result = real(q, k, v, scale, mask, bias)
        calls.append((q, k, v, scale, mask, result[0]))
        return result

    monkeypatch.setattr(cache.attention.reference, "sdpa_with_probs", recording)
    caches = make_cache(model, "h2o", max_kv=256)
    n_layers = len(model.layers)
    sizes = []
    for start in range(0, len(ids), step):
        calls.clear()
        chunk = mx.array(ids[start : start + step])[None]
        stored_before = caches[layer].size()
        mx.eval(model(chunk, cache=caches))
        N, C = chunk.shape[1], stored_before
        blocks = math.ceil(N / block)
        assert len(calls) == n_layers * blocks  # one call per query block and layer
        outs = []
        for b, (q, k, v, scale, mask, out) in enumerate(
            calls[layer * blocks : (layer + 1) * blocks]
        ):
            stop = b * block + q.shape[2]
            rows = np.arange(b * block, stop)[:, None]
            # a block attends over the keys up to its last query: stored ones, then causal
            assert k.shape[2] == C + stop <= 256 + step
            expected_mask = np.arange(C + stop)[None] <= C + rows
            got_mask = np.array(expand_mask(mask, len(rows), C + stop))
            np.testing.assert_array_equal(got_mask, expected_mask)
            outs.append((q, k, v, scale, expected_mask, out))
        for q, k, v, scale, expected_mask, out in outs:
            qn = np.array(q, np.float64)[0]
            kn, vn = np.array(k, np.float64)[0], np.array(v, np.float64)[0]
            rep = qn.shape[0] // kn.shape[0]
            logits = np.einsum("hqd,hkd->hqk", qn, np.repeat(kn, rep, axis=0)) * scale
            logits = np.where(expected_mask, logits, -np.inf)
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            explicit = np.einsum("hqk,hkd->hqd", probs, np.repeat(vn, rep, axis=0))
            np.testing.assert_allclose(np.array(out)[0], explicit, atol=1e-4)
        sizes.append(caches[layer].size())
    # Each overflowing chunk is cut back to max_kv + 1 - evict_batch (room to decode).
    assert sizes == [257 - caches[layer].evict_batch] * len(sizes)
    assert caches[layer].offset == len(ids)


def test_save_load_mid_conversation(default_model, essay_text, tmp_path):
    """After evictions (with free slots pending), save/load through mlx-lm and continue."""
    model, tokenizer = default_model
    ids = essay_ids(tokenizer, essay_text, 200)
    caches = make_cache(model, "h2o", max_kv=128, score="ema", preset="balanced")
    logits = model(mx.array(ids)[None], cache=caches)[:, -1]
    for _ in range(12):
        logits = model(mx.argmax(logits, -1).reshape(1, 1), cache=caches)[:, -1]
    assert caches[0].evicted > 0 and caches[0].size() < 128

    path = str(tmp_path / "conversation.safetensors")
    save_prompt_cache(path, caches, {"conversation": "c1"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta["conversation"] == "c1"
    assert all(type(c) is H2OKVCache for c in loaded)
    assert [c.offset for c in loaded] == [c.offset for c in caches]
    assert [c.evicted for c in loaded] == [c.evicted for c in caches]
    assert loaded[0].score_rule == caches[0].score_rule and loaded[0].heavy == 32
    assert loaded[0].score_rule.name == "ema"

    token = mx.argmax(logits, -1).reshape(1, 1)
    for _ in range(8):  # continue both: identical logits, evictions included
        a, b = model(token, cache=caches)[:, -1], model(token, cache=loaded)[:, -1]
        assert mx.abs(a - b).max().item() == pytest.approx(0.0, abs=1e-6)
        token = mx.argmax(a, -1).reshape(1, 1)
