"""RoPE with one offset per row: a batched decode step and a context shift's key turns.

A batched step hands RoPE an array of offsets, one per session row (cache/batching/batch.py);
re-indexing turns every held key by its own, negative, offset (cache/policies/h2o.py
`turn_keys`). Tiny random-weight llamas, one per RoPE variant mlx-lm builds for them.
On MLX 0.32.4's CUDA backend negative per-row offsets come out wrong (docs/gpu.md):
these tests pass on every backend, and that one is where they matter.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny import tiny

from cache import install_router, make_cache
from cache.batching.batch import batch_caches
from cache.policies.h2o import turn_keys
from config.cache_spec import CacheSpec

ROPES = {
    "default": {},
    "traditional": {"rope_traditional": True},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


@pytest.mark.parametrize("variant", ROPES)
def test_turn_keys_turns_each_key_by_its_own_offset(variant):
    rope = tiny("llama", **ROPES[variant]).layers[0].self_attn.rope
    keys = mx.random.normal((1, 2, 5, 8))
    delta = mx.array([[[0, -3, -300, 7, -4000], [12, -1, 0, -77, 2000]]], dtype=mx.int32)
    got = turn_keys(rope, keys, delta)
    for h in range(2):
        for s in range(5):
            want = rope(keys[:, h : h + 1, s : s + 1], offset=delta[0, h, s].item())
            np.testing.assert_allclose(np.array(got[0, h, s]), np.array(want[0, 0, 0]), atol=1e-4)


@pytest.mark.parametrize("variant", ROPES)
def test_a_batched_decode_step_equals_each_session_alone(variant):
    """Sessions at different positions (a plain cache, an H2O one past its max_kv, a short
    one) decode in one batched pass and get the logits each gets alone."""
    model = tiny("llama", **ROPES[variant])
    install_router(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 40, 17)]

    def sessions() -> list[list]:
        h2o = CacheSpec("h2o", 24)
        caches = [make_prompt_cache(model), make_cache(model, h2o), make_cache(model, h2o)]
        for prompt, c in zip(prompts, caches, strict=True):
            mx.eval(model(mx.array([prompt]), cache=c))
        return caches

    together, alone = sessions(), sessions()
    tokens = [p[-1] for p in prompts]
    for _ in range(4):
        batched = model(mx.array([[t] for t in tokens]), cache=batch_caches(together))[:, -1]
        single = [
            model(mx.array([[t]]), cache=c)[0, -1] for t, c in zip(tokens, alone, strict=True)
        ]
        for row, want in enumerate(single):
            np.testing.assert_allclose(np.array(batched[row]), np.array(want), atol=1e-4)
        tokens = [int(mx.argmax(w).item()) for w in single]
    assert together[1][0].evicted > 0  # the H2O row evicted along the way
