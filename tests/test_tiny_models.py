"""End-to-end checks of make_cache("h2o") on random-weight tiny mlx-lm models.

Architectures: llama, qwen2, qwen3 and gemma3 (text), the last with sliding-window
layers. Each model is a few thousand parameters in float32, so the whole file
runs in seconds on a CPU.
"""

import importlib

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from cache.factory import make_cache
from cache.h2o import H2OKVCache
from cache.router import uninstall_router

VOCAB = 256
WINDOW = 16  # gemma3 sliding window

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
}

CONFIGS = {
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
    },
    # qwen2 derives head_dim from hidden_size // num_attention_heads (= 16).
    "qwen2": {**_COMMON, "model_type": "qwen2", "num_hidden_layers": 2},
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
    # Layers 0 and 2 slide over WINDOW tokens, layers 1 and 3 are global.
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
    },
}
ARCHS = list(CONFIGS)

_MODELS = {}


def tiny_model(arch: str):
    """A random-weight float32 model of `arch`, built once per session."""
    if arch not in _MODELS:
        module = importlib.import_module(f"mlx_lm.models.{arch}")
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict(CONFIGS[arch]))
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        _MODELS[arch] = model
    return _MODELS[arch]


@pytest.fixture(params=ARCHS)
def model(request):
    m = tiny_model(request.param)
    yield m
    # make_cache installs the router module-wide: leave mlx-lm as we found it.
    uninstall_router(m)


def prompt_tokens(n: int, seed: int = 1) -> mx.array:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed)).astype(mx.int32)


def h2o_layers(caches) -> list[H2OKVCache]:
    return [c for c in caches if isinstance(c, H2OKVCache)]


def is_sliding(model, i: int) -> bool:
    layer = model.layers[i]
    return bool(
        getattr(layer, "use_sliding", False) or getattr(layer.self_attn, "is_sliding", False)
    )


# --------------------------------------------------------------------------- layout


def test_cache_types_per_layer(model):
    caches = make_cache(model, "h2o", max_kv=16)
    assert len(caches) == len(model.layers)
    sliding = [is_sliding(model, i) for i in range(len(model.layers))]
    if model.args.model_type == "gemma3_text":
        assert sliding == [True, False, True, False]
    else:
        assert not any(sliding)
    for i, c in enumerate(caches):
        if sliding[i]:
            # Model-provided bounded cache kept, window as the model asks.
            assert type(c) is RotatingKVCache and not isinstance(c, H2OKVCache)
            assert c.max_size == WINDOW
        else:
            assert isinstance(c, H2OKVCache)
            assert c.max_size == 16
    # The default cache layout is what h2o replaces layer for layer.
    base = make_prompt_cache(model)
    for i, (b, c) in enumerate(zip(base, caches, strict=True)):
        assert (type(b) is KVCache) == isinstance(c, H2OKVCache), i


# --------------------------------------------------------------------------- exactness


def test_exact_without_eviction(model):
    """max_kv above the sequence: h2o logits equal mlx-lm's default cache."""
    n_prompt, n_decode = 40, 20
    ref_cache = make_prompt_cache(model)
    h2o_cache = make_cache(model, "h2o", max_kv=256)

    prompt = prompt_tokens(n_prompt)[None]
    ref = model(prompt, cache=ref_cache)
    got = model(prompt, cache=h2o_cache)
    mx.eval(ref, got)
    assert mx.abs(ref - got).max().item() <= 1e-4

    for step in range(n_decode):
        token = mx.argmax(ref[:, -1, :], axis=-1)[:, None]  # same token into both
        ref = model(token, cache=ref_cache)
        got = model(token, cache=h2o_cache)
        mx.eval(ref, got)
        diff = mx.abs(ref - got).max().item()
        assert diff <= 1e-4, f"step {step}: max abs diff {diff}"

    total = n_prompt + n_decode
    for c in h2o_layers(h2o_cache):
        assert c.evicted == 0
        assert c.offset == total and c.size() == total
        # The router fed every attention call: each query row of each query head
        # adds probabilities summing to 1, and a KV head holds its group's sum.
        group = _COMMON["num_attention_heads"] // _COMMON["num_key_value_heads"]
        mass = c.scores[..., : c.size()].sum(axis=-1)
        assert mx.allclose(mass, mx.full(mass.shape, float(total * group)), atol=1e-3)


# --------------------------------------------------------------------------- eviction


@pytest.mark.parametrize("score", ["attn", "ema"])
def test_eviction_bounded(model, score):
    max_kv, n_prompt, n_decode = 16, 24, 36
    caches = make_cache(model, "h2o", max_kv=max_kv, score=score)
    layers = h2o_layers(caches)
    assert layers

    logits = model(prompt_tokens(n_prompt, seed=2)[None], cache=caches)
    mx.eval(logits)
    assert bool(mx.isfinite(logits).all())
    for c in layers:
        assert c.offset == n_prompt
        assert c.size() <= max_kv
        assert c.evicted == n_prompt - max_kv

    for step in range(1, n_decode + 1):
        token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        logits = model(token, cache=caches)
        mx.eval(logits)
        assert bool(mx.isfinite(logits).all()), f"step {step}"
        for c in layers:
            assert c.size() <= max_kv, f"step {step}: size {c.size()}"
            assert c.offset == n_prompt + step
            assert c.evicted > 0
            # Sinks and the newest token are always kept.
            pos = c.positions[..., : c._len]
            assert bool((pos == c.offset - 1).any(axis=-1).all())
            assert bool(mx.all((pos < c.sink).sum(axis=-1) == c.sink))

    total = n_prompt + n_decode
    for c in layers:
        assert c.evicted == total - max_kv
        assert c.size() == max_kv
    for i, c in enumerate(caches):
        if is_sliding(model, i):
            assert type(c) is RotatingKVCache and c.offset == total


# --------------------------------------------------------------------------- mlx-lm generation


def test_generate_step_matches_default_cache(model):
    """Greedy generate_step with a roomy h2o cache yields mlx-lm's default tokens."""
    prompt = prompt_tokens(30, seed=3)
    n = 12
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=n)]
    caches = make_cache(model, "h2o", max_kv=256)
    got = [t for t, _ in generate_step(prompt, model, prompt_cache=caches, max_tokens=n)]
    assert got == ref


@pytest.mark.parametrize("prefill_step_size", [2048, 8])
def test_generate_step_evicting(model, prefill_step_size):
    max_kv, n_prompt, n = 12, 30, 20
    caches = make_cache(model, "h2o", max_kv=max_kv)
    prompt = prompt_tokens(n_prompt, seed=4)
    out = list(
        generate_step(
            prompt,
            model,
            prompt_cache=caches,
            max_tokens=n,
            prefill_step_size=prefill_step_size,
        )
    )
    assert len(out) == n
    for token, logprobs in out:
        assert 0 <= token < VOCAB
        assert bool(mx.isfinite(logprobs).all())
    for c in h2o_layers(caches):
        assert c.size() <= max_kv
        assert c.evicted > 0
        assert n_prompt + n - 1 <= c.offset <= n_prompt + n


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer over VOCAB tokens `t0` ... `t255`, no EOS."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    return TokenizerWrapper(hf)


def test_stream_generate(model, tokenizer):
    max_kv, n = 12, 16
    prompt = " ".join(f"t{i}" for i in range(7, 7 + 30))
    caches = make_cache(model, "h2o", max_kv=max_kv)
    responses = list(stream_generate(model, tokenizer, prompt, prompt_cache=caches, max_tokens=n))
    assert len(responses) == n
    assert responses[-1].generation_tokens == n
    assert responses[-1].finish_reason == "length"
    assert responses[0].prompt_tokens == 30
    assert all(0 <= r.token < VOCAB for r in responses)
    text = "".join(r.text for r in responses)
    assert text.split() == [f"t{r.token}" for r in responses]
    for c in h2o_layers(caches):
        assert c.size() <= max_kv and c.evicted > 0
