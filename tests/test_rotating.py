"""The `rotating` policy: sink tokens stay visible to every query of a multi-token chunk.

mlx-lm's RotatingKVCache(keep > 0) hides the sinks from later queries of a
chunk once its ring has wrapped (the first tests show that on mlx-lm's class,
so they fail loudly if mlx-lm changes). SinkRotatingKVCache must make chunked
processing equal to one token at a time, which is what generation sees.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, save_prompt_cache

from bench.ppl import nll_autoregressive, nll_chunked
from cache import SinkRotatingKVCache, make_cache

MAX, KEEP = 8, 2


def _fill(cache, n: int, start: int = 0) -> None:
    """n single-token updates whose key values are their positions."""
    for t in range(start, start + n):
        kv = mx.full((1, 1, 1, 4), float(t))
        cache.update_and_fetch(kv, kv)


def _chunk_mask(cache, n: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """The mask for a chunk of n tokens (made before the update, as models do) and the
    positions of the keys that chunk attends over."""
    mask = cache.make_mask(n, return_array=True)
    kv = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 1, 1, 4))
    keys, _ = cache.update_and_fetch(kv, kv)
    return np.array(mask), np.array(keys[0, 0, :, 0]).astype(int)


def _visible(mask: np.ndarray, positions: np.ndarray) -> list[list[int]]:
    return [sorted(positions[row].tolist()) for row in mask]


def test_mlx_lm_rotating_cache_hides_sinks_after_the_wrap():
    """The bug this module fixes, on mlx-lm's own class."""
    cache = RotatingKVCache(max_size=MAX, keep=KEEP)
    _fill(cache, 20)
    mask, positions = _chunk_mask(cache, 4, 20)
    seen = _visible(mask, positions)
    assert 0 in seen[0] and 0 not in seen[3]  # query 3 of the chunk lost sink 0


def test_chunk_after_the_wrap_attends_to_the_sinks():
    cache = SinkRotatingKVCache(max_size=MAX, keep=KEEP)
    _fill(cache, 20)
    mask, positions = _chunk_mask(cache, 4, 20)
    for i, seen in enumerate(_visible(mask, positions)):
        query = 20 + i
        # the sinks, then the last MAX - KEEP tokens up to and including the query
        assert seen == [0, 1, *range(query - (MAX - KEEP) + 1, query + 1)]


def test_first_chunk_longer_than_the_cache():
    """A prompt longer than max_size in one chunk: sinks are its own first tokens."""
    cache = SinkRotatingKVCache(max_size=MAX, keep=KEEP)
    mask, positions = _chunk_mask(cache, 12, 0)
    seen = _visible(mask, positions)
    assert seen[1] == [0, 1] and seen[11] == [0, 1, *range(6, 12)]


@pytest.fixture
def tiny_llama():
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs.from_dict(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "vocab_size": 256, "tie_word_embeddings": False}
    )  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("chunk", [3, 8, 13])
def test_chunked_equals_token_by_token(tiny_llama, chunk):
    """Per-token NLL through the rotating cache: chunks of any size == one token at a time."""
    tokens = mx.random.randint(0, 256, (2, 60), key=mx.random.key(1)).astype(mx.int32)
    kwargs = {"policy": "rotating", "max_kv": 16}
    stepped = nll_autoregressive(tiny_llama, tokens, kwargs, prefill=1)
    chunked = nll_chunked(tiny_llama, tokens, kwargs, chunk)
    np.testing.assert_allclose(np.array(chunked), np.array(stepped), atol=1e-4)
    assert make_cache(tiny_llama, **kwargs)[0].keep == 4  # the preset's sinks are in play


def test_chunked_eval_mode_on_the_default_model(default_model, essay_text):
    """`eval ppl --mode chunked` for rotating now measures what generation sees."""
    from bench.ppl import sample_windows

    model, tokenizer = default_model
    tokens = sample_windows(tokenizer, 1, 128)  # two 32-token chunks past the 64-token window
    kwargs = {"policy": "rotating", "max_kv": 64}
    stepped = nll_autoregressive(model, tokens, kwargs, prefill=32)
    chunked = nll_chunked(model, tokens, kwargs, 32)
    np.testing.assert_allclose(np.array(chunked), np.array(stepped), atol=1e-3)


def test_save_and_load_round_trip(tmp_path):
    cache = SinkRotatingKVCache(max_size=MAX, keep=KEEP)
    _fill(cache, 11)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is SinkRotatingKVCache
    assert (loaded.offset, loaded.keep, loaded.max_size) == (11, KEEP, MAX)
    np.testing.assert_array_equal(np.array(loaded.keys), np.array(cache.keys))
