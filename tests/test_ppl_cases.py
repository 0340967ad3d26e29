"""bench/ppl.py's batched cases: several caches as sessions of one batched pass give
each cache's own autoregressive NLL (what `rules_grid --cases-per-pass` relies on)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from bench.ppl import nll_autoregressive, nll_cases_stepped
from tests.tiny import tiny


def test_cases_in_one_pass_match_each_alone():
    model = tiny("llama", head_dim=64, hidden_size=128)
    tokens = mx.random.randint(0, 64, (2, 70), key=mx.random.key(3)).astype(mx.int32)
    cases = [
        {"policy": "rotating", "max_kv": 16},
        {"policy": "h2o", "max_kv": 16, "score": "mean"},
        {"policy": "h2o-merge", "max_kv": 16, "score": "mean"},
        {"policy": "h2o-q8", "max_kv": 32, "score": "learned"},
    ]
    together = nll_cases_stepped(model, tokens, cases, prefill=8)
    assert together.shape == (len(cases), 2, 69)
    for n, kwargs in enumerate(cases):
        alone = nll_autoregressive(model, tokens, kwargs, prefill=8)
        # 1e-3: float32 reduction order of a batched pass over 30 layers (mlx 0.32.4: 3e-4)
        np.testing.assert_allclose(np.array(together[n]), np.array(alone), atol=1e-3)
