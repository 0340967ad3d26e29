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
from cache.policies.h2o import H2OKVCache
from cache.policies.windowed import WindowedH2OKVCache
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
            # The window fits in max_kv: the layer keeps it, exactly (no sinks).
            assert isinstance(c, RotatingKVCache) and not isinstance(c, H2OKVCache)
            assert (c.max_size, c.keep) == (WINDOW, 0)
        else:
            assert isinstance(c, H2OKVCache)
            assert c.max_size == 16
    # The default cache layout is what h2o replaces layer for layer.
    base = make_prompt_cache(model)
    for i, (b, c) in enumerate(zip(base, caches, strict=True)):
        assert (type(b) is KVCache) == isinstance(c, H2OKVCache), i
    # A window larger than max_kv: H2O inside the window, never a wider cache.
    small = make_cache(model, "h2o", max_kv=WINDOW // 2)
    for i, c in enumerate(small):
        if sliding[i]:
            assert isinstance(c, WindowedH2OKVCache) and (c.max_size, c.window) == (8, WINDOW)
    rotating = make_cache(model, "rotating", max_kv=WINDOW // 2)
    for i, c in enumerate(rotating):
        assert c.max_size == WINDOW // 2 and c.keep == (0 if sliding[i] else 2)


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
            pos = c.positions[..., : c.used]
            assert bool((pos == c.offset - 1).any(axis=-1).all())
            assert bool(mx.all((pos < c.sink).sum(axis=-1) == c.sink))

    total = n_prompt + n_decode
    for c in layers:
        assert c.evicted == total - max_kv
        assert c.size() == max_kv
    for i, c in enumerate(caches):
        if is_sliding(model, i):
            assert isinstance(c, RotatingKVCache) and c.offset == total


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
    from word_tokenizer import word_level

    return word_level(VOCAB)


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


# --------------------------------------------------------------------------- sliding windows


def _gemma(head_dim: int = 16):
    """The tiny gemma3_text; head_dim 32 for the packed policies (mx.quantize groups >= 32)."""
    if head_dim == CONFIGS["gemma3_text"]["head_dim"]:
        return tiny_model("gemma3_text")
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    cfg = {**CONFIGS["gemma3_text"], "head_dim": head_dim, "query_pre_attn_scalar": head_dim}
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _run(model, caches, tokens, chunk: int, n_decode: int) -> list[mx.array]:
    """Logits of a chunked prefill and greedy-free decode of the same tokens."""
    out = []
    for start in range(0, tokens.shape[0] - n_decode, chunk):
        stop = min(start + chunk, tokens.shape[0] - n_decode)
        out.append(model(tokens[None, start:stop], cache=caches))
    for t in range(tokens.shape[0] - n_decode, tokens.shape[0]):
        out.append(model(tokens[None, t : t + 1], cache=caches))
    mx.eval(out)
    return out


@pytest.mark.parametrize("chunk", [1, 5, 24])
def test_windowed_h2o_masks_exactly_the_window(chunk):
    """Nothing evicted (max_kv 256): H2O inside the window == mlx-lm's own sliding cache,
    for chunks smaller and larger than the window (the window mask is per position)."""
    model = _gemma()
    try:
        tokens = prompt_tokens(60, seed=5)
        ref = _run(model, make_prompt_cache(model), tokens, chunk, 10)
        caches = make_cache(model, "h2o", max_kv=256)
        for i in range(len(caches)):
            if is_sliding(model, i):
                caches[i] = WindowedH2OKVCache(256, window=WINDOW)
        got = _run(model, caches, tokens, chunk, 10)
        worst = max(mx.abs(a - b).max().item() for a, b in zip(ref, got, strict=True))
        assert worst <= 1e-4
    finally:
        uninstall_router(model)


@pytest.mark.parametrize("policy", ["h2o", "h2o-q8", "h2o-mixed", "rotating"])
@pytest.mark.parametrize("score", ["attn", "ema"])
def test_every_layer_bounded_with_a_window_above_max_kv(policy, score):
    """max_kv 8 < window 16: every layer stores <= 8 tokens after every chunk and step."""
    packed = policy in ("h2o-q8", "h2o-mixed")
    model = _gemma(32 if packed else 16)
    try:
        caches = make_cache(model, policy, max_kv=8, score=score, group_size=32)
        tokens = prompt_tokens(50, seed=6)
        for start in range(0, 30, 10):
            logits = model(tokens[None, start : start + 10], cache=caches)
            mx.eval(logits)
            assert max(c.size() for c in caches) <= 8
        for t in range(30, 50):
            logits = model(tokens[None, t : t + 1], cache=caches)
            mx.eval(logits)
            assert bool(mx.isfinite(logits).all())
            assert max(c.size() for c in caches) <= 8
            assert [c.offset for c in caches] == [t + 1] * len(caches)
        for i, c in enumerate(caches):
            if is_sliding(model, i) and policy != "rotating":
                # nothing older than the window survives the evictions
                assert bool((c.positions[..., : c.size()] > c.offset - 1 - WINDOW).all())
    finally:
        uninstall_router(model)


def test_windowed_cache_save_and_load(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = _gemma()
    try:
        caches = make_cache(model, "h2o", max_kv=8)
        mx.eval(model(prompt_tokens(30, seed=7)[None], cache=caches))
        save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
        loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
        assert [type(c) for c in loaded] == [type(c) for c in caches]
        windowed = [c for c in loaded if isinstance(c, WindowedH2OKVCache)]
        assert windowed and all(c.window == WINDOW and c.offset == 30 for c in windowed)
        token = mx.array([[3]])
        a, b = model(token, cache=caches), model(token, cache=loaded)
        assert mx.abs(a - b).max().item() <= 1e-5
    finally:
        uninstall_router(model)


@pytest.mark.parametrize(
    "policy",
    [
        *("h2o", "h2o-q8", "rotating", "full", "kvarn", "h2o-kvarn", "h2o-ada", "h2o-merge"),
        "h2o-recall",
    ],
)
@pytest.mark.parametrize("max_kv", [8, 20])
def test_budget_formula_is_what_every_layer_allocates(policy, max_kv):
    """cache.budget.session_bytes == the bytes the caches hold once full, per layer kind:
    max_kv 8 < window 16 (sliding layers under the policy), 20 > 16 (their own window).
    h2o-recall's global layers hold max_kv plus a full archive of 4 x max_kv tokens.
    kvarn keeps every token: its global layers pack 300 tokens into tiles while the
    sliding layers keep their dense window; h2o-kvarn's sliding layers hold a dense
    max_kv window (no KVarN inside a window)."""
    from cache.budget import H2O_BOOKKEEPING, ModelShape, max_kv_within, session_bytes
    from models.shape import layer_windows

    model = _gemma(64 if "kvarn" in policy else 32)  # KVarN packs values in groups of 32+
    try:
        windows = tuple(w for w in layer_windows(model) if w)
        assert windows == (WINDOW, WINDOW)
        shape = ModelShape.of(model, element_bytes=4, windows=windows)
        caches = make_cache(model, policy, max_kv=max_kv, group_size=32, evict_batch=1)
        n = 300 if policy in ("kvarn", "h2o-recall") else 60  # h2o-recall: archive full
        tokens = prompt_tokens(n, seed=8)
        for start in range(0, n - 20, 128):
            mx.eval(model(tokens[None, start : min(start + 128, n - 20)], cache=caches))
        held = 0  # at the largest: h2o-kvarn shrinks a little when a tile is repacked
        for t in range(n - 20, n):
            mx.eval(model(tokens[None, t : t + 1], cache=caches))
            held = max(held, sum(c.nbytes for c in caches))
        if policy in ("full", "kvarn"):  # global layers grow with the conversation
            assert held == session_bytes(shape, policy, n)
            if policy == "kvarn":
                assert all(c.n_tiles() >= 1 for c in caches if hasattr(c, "n_tiles"))
        elif policy == "h2o-kvarn":
            # Priced at its peak: the newest token's score and position (spare slot) live
            # only inside the forward pass that evicts, in each global layer and KV head.
            priced = session_bytes(shape, policy, max_kv)
            spare = H2O_BOOKKEEPING * shape.global_layers * shape.kv_heads
            assert priced - spare == held
            assert max_kv_within(priced, shape, policy) == max_kv
        else:
            assert held == session_bytes(shape, policy, max_kv, group_size=32)
            assert max_kv_within(held, shape, policy, group_size=32) == max_kv
    finally:
        uninstall_router(model)
