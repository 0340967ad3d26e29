"""On a GPU a decode step's `attn` scores come from the decode-weights kernel: one launch
that adds each key's softmax weight (from the logits the decode kernel exported) to the
held scores, instead of the rule's softmax, sums and accumulation (cache/attention.py
`_decode_weights`). "metal" is played here by the CPU emulation of the kernel bodies;
the same model decodes on the reference backend, and both must keep, score and evict
alike."""

import mlx.core as mx
import pytest

from cache import make_cache
from cache.attention import ATTENTION
from cache.batching.batch import batch_caches
from cache.batching.h2o_slab import H2OSlab, slab_key
from tests.tiny import tiny

STEPS = 24


@pytest.fixture
def model():
    return tiny("llama", head_dim=64, hidden_size=128)


@pytest.fixture
def on_backend():
    """Set the router's preferred backend for a run; restored after the test."""
    saved = ATTENTION.backend
    yield lambda name: ATTENTION.configure(backend=name)
    ATTENTION.configure(backend=saved)


def decode(model, caches, token: mx.array, steps: int = STEPS):
    """Each step's logits; `caches()` gives the cache argument of a step."""
    out = []
    for _ in range(steps):
        logits = model(token, cache=caches())
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(token, logits)
        out.append(logits)
    return out


def lone_run(model, backend: str, on_backend, **spec):
    on_backend(backend)
    caches = make_cache(model, max_kv=32, **spec)
    prompt = mx.random.randint(0, 64, (1, 40), key=mx.random.key(3))
    token = mx.argmax(model(prompt, cache=caches)[:, -1], axis=-1)[:, None]
    return decode(model, lambda: caches, token), caches


@pytest.mark.parametrize("score", ["attn", "tova"])
@pytest.mark.parametrize("policy", ["h2o", "h2o-q8"])
def test_a_lone_cache_takes_its_decode_scores_from_the_kernel(
    policy, score, model, emulated_gpu, on_backend
):
    """Under `attn` a dense cache's every decode step is one decode-weights call per layer;
    a packed one at its final size reads its packed buffers whole, and the logits of its
    sink pool move into their slots in the compiled update instead; other rules never call
    it. Logits, scores and the evicted positions equal the reference backend's."""
    want_logits, want = lone_run(model, "reference", on_backend, policy=policy, score=score)
    emulated_gpu.clear()
    got_logits, got = lone_run(model, "metal", on_backend, policy=policy, score=score)
    calls = [name for name, *_ in emulated_gpu if name == "decode_weights"]
    assert len(calls) == (2 * STEPS if (policy, score) == ("h2o", "attn") else 0)  # 2 layers
    # Packed keys: the kernel's and the reference's float32 sums round apart, and a new key
    # can land one code over when packed; its probability then moves by ~1e-4 (docs/gpu.md),
    # the logits by a few 1e-4 (seen with OpenBLAS on AMD EPYC).
    atol = 1e-5 if policy == "h2o" else 1e-3
    for g, w in zip(got_logits, want_logits, strict=True):
        assert mx.allclose(g, w, atol=max(atol, 1e-4)).item()
    for g, w in zip(got, want, strict=True):
        assert g.evicted == w.evicted > 0
        assert mx.array_equal(g.positions, w.positions).item()
        assert mx.allclose(g.scores, w.scores, atol=atol).item()


def slab_run(model, backend: str, on_backend):
    on_backend(backend)
    rows = []
    for r in range(3):  # staggered prompts: rows evict on different steps
        caches = make_cache(model, max_kv=32)
        prompt = mx.random.randint(0, 64, (1, 36 + r), key=mx.random.key(r))
        rows.append((caches, mx.argmax(model(prompt, cache=caches)[:, -1], axis=-1)))
    slab = H2OSlab(slab_key(rows[0][0]))
    slab.join([(r, caches) for r, (caches, _) in enumerate(rows)])
    token = mx.stack([t for _, t in rows])
    logits = decode(model, lambda: batch_caches([], slab), token)
    return logits, slab.layers


def test_a_slab_takes_its_decode_scores_from_the_kernel(model, emulated_gpu, on_backend):
    """Dense slab rows: one decode-weights call per layer and step for every row at once;
    the same logits, held slots and scores as the reference backend's step."""
    want_logits, want = slab_run(model, "reference", on_backend)
    emulated_gpu.clear()
    got_logits, got = slab_run(model, "metal", on_backend)
    calls = [name for name, *_ in emulated_gpu if name == "decode_weights"]
    assert len(calls) == 2 * STEPS
    for g, w in zip(got_logits, want_logits, strict=True):
        assert mx.allclose(g, w, atol=1e-4).item()
    for g, w in zip(got, want, strict=True):
        assert mx.array_equal(g.held, w.held).item()
        assert mx.array_equal(g.positions, w.positions).item()
        assert mx.allclose(g.scores, w.scores, atol=1e-5).item()
