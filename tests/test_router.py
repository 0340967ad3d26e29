"""The attention router: installed, transparent for unscored layers, loud where it cannot score.

Tiny random-weight models, no default model: every case runs in well under a second.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, make_prompt_cache
from tiny import tiny

from cache import H2OKVCache, ScoresMissing, UnroutedAttention, make_cache, uninstall_router
from cache.policies.recall import RecallH2OKVCache
from cache.router import install_router


@pytest.fixture
def llama_model():
    model = tiny("llama")
    yield model
    uninstall_router(model)


class DirectAttention(llama.Attention):
    """A layer that calls mx.fast's attention itself, as some mlx-lm models do."""

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_unscored_layers_keep_mlx_lms_attention(llama_model):
    """With the router installed, a full cache gives exactly mlx-lm's logits."""
    tokens = mx.array([[1, 2, 3, 4, 5]])
    want = llama_model(tokens, cache=make_prompt_cache(llama_model))
    routed = install_router(llama_model)
    assert routed == ["mlx_lm.models.llama"]
    got = llama_model(tokens, cache=make_cache(llama_model, "full"))
    assert mx.array_equal(want, got).item()
    uninstall_router(llama_model)
    assert not hasattr(
        sys.modules["mlx_lm.models.llama"].scaled_dot_product_attention, "h2o_original"
    )


def test_scored_layers_go_through_the_router(llama_model):
    caches = make_cache(llama_model, "h2o", max_kv=8)
    llama_model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]), cache=caches)
    assert all(c.size() <= 8 and c.evicted > 0 for c in caches)  # scores arrived: evicted


def test_a_layer_bypassing_the_router_is_refused_at_make_cache(llama_model):
    """Attention that calls mx.fast directly would leave an H2O cache unbounded: refuse it."""
    llama_model.layers[1].self_attn = DirectAttention(llama_model.args)
    with pytest.raises(UnroutedAttention, match=r"model type 'llama'.*layer\(s\) \[1\]"):
        make_cache(llama_model, "h2o", max_kv=8)
    make_cache(llama_model, "rotating", max_kv=8)  # unscored policies need no router


def test_attention_with_sinks_reaches_caches_that_take_them():
    """gpt-oss passes attention sinks: scored caches take them (tests/test_families.py
    checks the output); h2o-recall, which merges its archive after them, is refused up
    front by make_cache, naming h2o, and by the router if it got there anyway."""
    model = tiny(
        "gpt_oss", num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match="sink logits.*use h2o"):
            make_cache(model, "h2o-recall", max_kv=8)
        make_cache(model, "h2o", max_kv=8)
        make_cache(model, "full")  # without scores, mlx-lm's own path takes the sinks
        sdpa, _, q, k, v = _routed_call(model, "gpt_oss")
        recall = RecallH2OKVCache(8, archive=8)
        recall.update_and_fetch(k, v)
        with pytest.raises(UnroutedAttention, match="sinks"):
            sdpa(q, k, v, cache=recall, scale=1.0, mask=None, sinks=mx.zeros((2,)))
    finally:
        uninstall_router(model)


def _routed_call(model, arch: str):
    """The routed attention function of `arch`'s module, an H2O cache holding one token,
    and q, k, v of one decode step."""
    install_router(model)
    sdpa = sys.modules[f"mlx_lm.models.{arch}"].scaled_dot_product_attention
    c = H2OKVCache(8)
    q = k = v = mx.zeros((1, 2, 1, 8))
    c.update_and_fetch(k, v)
    return sdpa, c, q, k, v


def test_unknown_keyword_on_a_scored_layer_raises(llama_model):
    sdpa, c, q, k, v = _routed_call(llama_model, "llama")
    with pytest.raises(UnroutedAttention, match="window"):
        sdpa(q, k, v, cache=c, scale=1.0, mask=None, window=4)
    out = sdpa(q, k, v, cache=KVCache(), scale=1.0, mask=None)  # unscored: passes through
    assert out.shape == q.shape


def test_a_cache_that_never_gets_scores_refuses_to_grow():
    """The last line of defence: an H2O cache past max_size without scores raises."""
    c = H2OKVCache(8)
    kv = mx.zeros((1, 2, 6, 4))
    c.update_and_fetch(kv, kv)  # 6 <= 8: fine without scores
    c.update_and_fetch(kv, kv)  # 12: a chunk may overflow until its scores arrive
    with pytest.raises(ScoresMissing, match="did not pass scores"):
        c.update_and_fetch(kv[:, :, :1], kv[:, :, :1])


@pytest.mark.parametrize("policy", ["h2o", "h2o-q4", "h2o-kvarn"])
def test_decoding_holds_no_growing_chain_of_scores(policy):
    """Decode steps that evaluate only their logits (as generate_step and the server do)
    keep memory flat between evictions: each step's scores are computed with it, not
    left lazy holding that step's probabilities until the next eviction."""
    model = tiny("llama", head_dim=64)  # a head dim every packed policy stores
    caches = make_cache(model, policy=policy, max_kv=2048)
    prompt = mx.random.randint(0, 64, (1, 1300), key=mx.random.key(3))
    for start in range(0, 1300, 500):
        mx.eval(model(prompt[:, start : start + 500], cache=caches))
    token = mx.array([[1]])
    used = []
    for _ in range(40):  # no eviction, no buffer growth (256 slots at a time) in these
        mx.eval(model(token, cache=caches))
        used.append(mx.get_active_memory())
    uninstall_router(model)
    # A lazy chain holds 4 heads x ~1.3k keys x 4 bytes per layer and step: ~1.7 MB here.
    assert used[-1] - used[4] < 128 * 1024, (used[4], used[-1])


@pytest.mark.parametrize("policy", ["h2o", "h2o-q4"])
def test_a_compiled_decode_ties_its_scores_to_the_output(policy, monkeypatch):
    """A lone cache at its final size decodes in one compiled call per layer whose output
    depends on the new scores: steps that evaluate only their logits start nothing layer
    by layer (each start blocks the host) and still hold no growing chain of scores."""
    import cache.attention

    model = tiny("llama", head_dim=64)
    # No step owner (direct calls); one eviction leaves room for the 40 steps below.
    caches = make_cache(model, policy=policy, max_kv=512, evict_batch=64)
    prompt = mx.random.randint(0, 64, (1, 1300), key=mx.random.key(3))
    for start in range(0, 1300, 500):  # evicts: the buffers reach their final 513 slots
        mx.eval(model(prompt[:, start : start + 500], cache=caches))
    started = []
    monkeypatch.setattr(cache.attention.mx, "async_eval", lambda *a: started.append(a))
    token, used = mx.array([[1]]), []
    for _ in range(40):
        mx.eval(model(token, cache=caches))
        used.append(mx.get_active_memory())
    monkeypatch.undo()
    uninstall_router(model)
    assert started == [] and all(c.evicted > 0 for c in caches)
    # A lazy chain holds 4 heads x 513 slots x 4 bytes per layer and step: ~0.3 MB here.
    assert used[-1] - used[4] < 128 * 1024, (used[4], used[-1])


@pytest.mark.parametrize("policy", ["h2o", "h2o-q4"])
def test_a_step_that_evaluates_its_scores_builds_without_waiting(policy, monkeypatch):
    """Caches whose scores the step's owner evaluates (scores_with_step, the server's
    batcher) are not started layer by layer (each start blocks the host); evaluated with
    the step, memory stays as flat as when attention starts them."""
    import cache.attention
    from cache.contract import step_scores

    model = tiny("llama", head_dim=64)
    caches = make_cache(model, policy=policy, max_kv=2048, scores_with_step=True)
    prompt = mx.random.randint(0, 64, (1, 1300), key=mx.random.key(3))
    for start in range(0, 1300, 500):
        mx.eval(model(prompt[:, start : start + 500], cache=caches))
    started = []
    monkeypatch.setattr(cache.attention.mx, "async_eval", lambda *a: started.append(a))
    token, used = mx.array([[1]]), []
    for _ in range(40):
        logits = model(token, cache=caches)
        mx.eval(logits, step_scores(caches))  # as the batcher does, with its tokens
        used.append(mx.get_active_memory())
    monkeypatch.undo()
    uninstall_router(model)
    assert started == []  # nothing started inside the forward pass
    assert used[-1] - used[4] < 128 * 1024, (used[4], used[-1])
    # and without evaluating them, the chain grows: what the step's owner prevents
    lazy = make_cache(model, policy=policy, max_kv=2048, scores_with_step=True)
    for start in range(0, 1300, 500):
        mx.eval(model(prompt[:, start : start + 500], cache=lazy))
    grown = []
    for _ in range(40):
        mx.eval(model(token, cache=lazy))
        grown.append(mx.get_active_memory())
    uninstall_router(model)
    assert grown[-1] - grown[4] > 512 * 1024, (grown[4], grown[-1])
