"""A prompt's scored-attention paths agree: the matmul path (one softmax feeds the output
and the scores) and the GPU default, one fused mx.fast SDPA call for the output plus a
logits-only score pass in query blocks, or under the `attn` rule on a GPU backend the
two-pass prompt-weights kernel (cache/attention.py)."""

import mlx.core as mx
import pytest

from cache import make_cache
from cache.attention import ATTENTION
from tests.tiny import tiny


@pytest.fixture
def restore_attention():
    saved = ATTENTION.fused_prefill, ATTENTION.block
    yield
    ATTENTION.fused_prefill, ATTENTION.block = saved


def prefill(model, tokens: mx.array, fused: bool, **cache_kwargs):
    """Logits of every chunk, then each layer's (scores, positions)."""
    ATTENTION.fused_prefill = fused
    caches = make_cache(model, **cache_kwargs)
    logits = [model(tokens[:, s : s + 40], cache=caches) for s in range(0, tokens.shape[1], 40)]
    mx.eval(logits)
    return mx.concatenate(logits, axis=1), [(c.scores, c.positions) for c in caches]


@pytest.mark.parametrize("score", ["attn", "tova", "snap"])
@pytest.mark.parametrize("policy", ["h2o", "h2o-q8"])
def test_fused_prompt_output_and_scores_match_the_matmul_path(score, policy, restore_attention):
    ATTENTION.block = 16  # several query blocks per 40-token chunk
    model = tiny("llama", head_dim=64, hidden_size=128)
    tokens = mx.random.randint(0, 64, (1, 160), key=mx.random.key(1))
    kwargs = {"policy": policy, "max_kv": 64, "score": score}
    want_logits, want = prefill(model, tokens, False, **kwargs)
    got_logits, got = prefill(model, tokens, True, **kwargs)
    assert mx.allclose(got_logits, want_logits, atol=1e-4).item()
    for (got_scores, got_pos), (want_scores, want_pos) in zip(got, want, strict=True):
        assert mx.array_equal(got_pos, want_pos).item()  # evicted the same tokens
        assert mx.allclose(got_scores, want_scores, atol=1e-5).item()


@pytest.mark.parametrize("score", ["attn", "tova"])
@pytest.mark.parametrize("policy", ["h2o", "h2o-q8"])
def test_a_gpu_scores_a_prompt_with_the_weights_kernel(
    score, policy, emulated_gpu, restore_attention
):
    """With a GPU backend present ("metal" played by the CPU emulation of its kernel
    bodies), a fused prompt under `attn` takes its scores from the prompt-weights kernel,
    one call per layer and chunk, and keeps and evicts what the matmul path does; other
    rules keep the logits pass."""
    model = tiny("llama", head_dim=64, hidden_size=128)
    tokens = mx.random.randint(0, 64, (1, 160), key=mx.random.key(2))
    kwargs = {"policy": policy, "max_kv": 64, "score": score}
    want_logits, want = prefill(model, tokens, False, **kwargs)
    got_logits, got = prefill(model, tokens, True, **kwargs)
    # (make_cache's one-token routing probe takes the decode kernel: not counted)
    calls = [name for name, shape, _ in emulated_gpu if shape[2] > 1]
    per_chunk = ["prompt_weights"] * 2 * 4  # 2 layers, 4 chunks of 40
    assert calls == (per_chunk if score == "attn" else [])
    assert mx.allclose(got_logits, want_logits, atol=1e-4).item()
    for (got_scores, got_pos), (want_scores, want_pos) in zip(got, want, strict=True):
        assert mx.array_equal(got_pos, want_pos).item()  # evicted the same tokens
        assert mx.allclose(got_scores, want_scores, atol=1e-5).item()


def test_the_fused_path_is_the_gpu_default_only(restore_attention):
    ATTENTION.fused_prefill = None
    assert ATTENTION._fuses_prefill() == (mx.default_device() == mx.gpu)
