"""make_cache: the per-layer cache list for a CacheSpec, with attention routed and verified."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from cache.adaptive import AdaptiveH2OKVCache
from cache.h2o import H2OKVCache
from cache.h2o_kvarn import H2OKVarNCache
from cache.kvarn import KVarNCache
from cache.kvarn import check_head_dim as check_kvarn_head_dim
from cache.merging import MergingH2OKVCache
from cache.mixed import MIXED_LAYOUTS
from cache.quantized import QuantizedH2OKVCache
from cache.recall import RecallH2OKVCache
from cache.rotating import SinkRotatingKVCache
from cache.router import install_router, verify_routing
from cache.windowed import WINDOWED
from config.cache_spec import DEFAULT_POLICY, KVARN_PRESETS, RECALL_ARCHIVE, CacheSpec
from kernels.hadamard import hadamard_block


def _h2o_knobs(spec: CacheSpec) -> dict:
    seg = spec.segments()
    return dict(
        sink=seg.sink, heavy=seg.heavy, recent=seg.recent, score=spec.score,
        evict_batch=spec.evict_batch,
    )  # fmt: skip


def _scored(cls: type, spec: CacheSpec, window: int | None, **extra) -> H2OKVCache:
    """An H2O cache of `cls`; inside a sliding window (cache/windowed.py) when one is given."""
    if window is None:
        return cls(spec.max_kv, **_h2o_knobs(spec), **extra)
    return WINDOWED[cls](spec.max_kv, window=window, **_h2o_knobs(spec), **extra)


def _quantized(spec: CacheSpec, window: int | None = None) -> QuantizedH2OKVCache:
    info = spec.info
    return _scored(
        QuantizedH2OKVCache, spec, window, group_size=spec.group_size, bits=info.key_bits,
        value_bits=info.value_bits, rotate=spec.rotate, dense_recent=spec.dense_recent,
    )  # fmt: skip


def _mixed(spec: CacheSpec, window: int | None = None) -> H2OKVCache:
    cls, widths = MIXED_LAYOUTS[spec.mixed]
    packed = {"rotate": spec.rotate, "dense_recent": spec.dense_recent}
    extra = packed if cls is QuantizedH2OKVCache else {}  # k8v4 only
    return _scored(cls, spec, window, group_size=spec.group_size, **widths, **extra)


def _h2o_kvarn(spec: CacheSpec, window: int | None = None):
    if window is not None:
        # No KVarN twin inside a window yet: such a layer gets a max_kv window, dense
        # (cache/budget.py session_bytes prices it so).
        return _rotating(spec, window)
    return H2OKVarNCache(
        spec.max_kv, *KVARN_PRESETS[spec.kvarn], **_h2o_knobs(spec),
        strategy=spec.kvarn_strategy,
    )  # fmt: skip


def _rotating(spec: CacheSpec, window: int | None = None) -> SinkRotatingKVCache:
    # Sinks only in global layers: in a sliding-window layer, tokens older than its
    # window (sinks included) triple Gemma 3's perplexity (cache/windowed.py).
    return SinkRotatingKVCache(max_size=spec.max_kv, keep=0 if window else spec.segments().sink)


# PolicyInfo.cache -> a builder of one layer's cache; `window`: the layer's sliding
# window when it is larger than max_kv (bounded policies only).
BUILDERS = {
    "full": lambda spec, window=None: KVCache(),
    "rotating": _rotating,
    "h2o": lambda spec, window=None: _scored(H2OKVCache, spec, window),
    # No pooled twin inside a window: such a layer gets per-head H2O inside its window.
    "adaptive": lambda spec, window=None: (
        AdaptiveH2OKVCache(spec.max_kv, **_h2o_knobs(spec))
        if window is None
        else _scored(H2OKVCache, spec, window)
    ),
    # No merging twin inside a window either (a window drops what leaves it).
    "merging": lambda spec, window=None: _scored(
        MergingH2OKVCache if window is None else H2OKVCache, spec, window
    ),
    # No archive inside a window either (what leaves a window is never asked for again).
    "recall": lambda spec, window=None: (
        RecallH2OKVCache(
            spec.max_kv,
            archive=RECALL_ARCHIVE * spec.max_kv,
            group_size=spec.group_size,
            **_h2o_knobs(spec),
        )
        if window is None
        else _scored(H2OKVCache, spec, window)
    ),
    "quantized": _quantized,
    "mixed": _mixed,
    "kvarn": lambda spec, window=None: KVarNCache(*KVARN_PRESETS[spec.kvarn]),
    "h2o-kvarn": _h2o_kvarn,
}


def rotates_by_default(spec: CacheSpec) -> bool:
    """Whether a spec that leaves `rotate` unset rotates: 4-bit packed keys do (at the same
    bytes, rotated h2o-q4 is +3.6% perplexity vs dense H2O, unrotated +7.2%;
    docs/quantized.md). Any head dim a group divides is even, so it can be rotated."""
    return spec.info.cache == "quantized" and spec.info.key_bits == 4


def check_head_dim(spec: CacheSpec, head_dim: int | None) -> None:
    """Raise now, not on the first token, when the policy cannot store this head dim."""
    if head_dim is None:
        return
    if spec.info.cache in ("kvarn", "h2o-kvarn"):
        check_kvarn_head_dim(head_dim)
    elif spec.rotate:
        hadamard_block(head_dim)
    if spec.info.cache in ("quantized", "mixed", "recall") and head_dim % spec.group_size:
        raise ValueError(
            f"head dim {head_dim} is not a multiple of the quantization group size "
            f"{spec.group_size}: use a smaller group_size (32) or a dense policy"
        )


def _is_sliding_layer(layer: nn.Module) -> bool:
    """mlx-lm marks sliding-window layers with one of these flags."""
    attn = getattr(layer, "self_attn", None)
    return any(
        bool(getattr(obj, flag, False))
        for obj in (layer, attn)
        if obj is not None
        for flag in ("use_sliding", "is_sliding")
    )


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding attention window; None for global attention (and other state).

    mlx-lm gives sliding-window layers a RotatingKVCache of the window's size (no
    kept tokens), or marks them with a flag next to `args.sliding_window`.
    """
    base = make_prompt_cache(model)
    layers = getattr(model, "layers", None) or [None] * len(base)
    model_window = getattr(getattr(model, "args", None), "sliding_window", None)
    windows = []
    for layer, provided in zip(layers, base, strict=True):
        if type(provided) is RotatingKVCache and provided.keep == 0:
            windows.append(provided.max_size)
        elif layer is not None and model_window and _is_sliding_layer(layer):
            windows.append(model_window)
        else:
            windows.append(None)
    return windows


def make_cache(
    model: nn.Module,
    policy: str | CacheSpec = DEFAULT_POLICY,
    *,
    context: int | None = None,
    **fields,
) -> list[Any]:
    """One cache per layer for a CacheSpec, or for a policy name and CacheSpec fields.

    e.g. `make_cache(model, "h2o", max_kv=256, score="attn")`. With `layer_shares`
    global layers get their own max_kv (CacheSpec.layer_sizes), as many tokens in all
    as uniform (cache/layer_profiles.py). A sliding-window layer keeps its window
    when that fits in max_kv (or the policy is unbounded), else gets the policy's
    cache inside its window: every layer then holds at most its max_kv tokens. Other
    model-provided bounded caches (recurrent state) are kept.
    For scored policies the attention router is installed into the model and
    verified: a model whose attention would bypass it raises here, since its H2O
    caches would never evict. H2O caches of global-attention layers re-index their
    RoPE positions before they reach `context` (default: the model's), so a
    conversation may outgrow the context (cache/h2o.py).
    """
    spec = (
        policy.replace(**fields) if isinstance(policy, CacheSpec) else CacheSpec(policy, **fields)
    )
    build = BUILDERS[spec.info.cache]
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    hidden = getattr(args, "hidden_size", None)
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads else None)
    if spec.rotate is None:
        spec = spec.replace(rotate=rotates_by_default(spec))
    check_head_dim(spec, head_dim)
    base = make_prompt_cache(model)
    if spec.layer_shares is not None and len(spec.layer_shares) != len(base):
        raise ValueError(
            f"layer shares name {len(spec.layer_shares)} layers; this model has {len(base)}"
        )
    windows = layer_windows(model)
    if spec.layer_shares is not None and any(
        w is not None and s is not None for w, s in zip(windows, spec.layer_shares, strict=True)
    ):
        # The budget prices a sliding layer at max_kv (cache/budget.py session_bytes).
        raise ValueError("layer shares apply to global-attention layers: give sliding ones None")
    layer_specs = [spec.for_layer(k) for k in spec.layer_sizes()] or [spec] * len(base)
    caches = []
    for window, provided, layer_spec in zip(windows, base, layer_specs, strict=True):
        if window is not None and (not spec.info.bounded or window <= layer_spec.max_kv):
            caches.append(SinkRotatingKVCache(max_size=window, keep=0))  # exact, bounded
        elif window is not None:
            caches.append(build(layer_spec, window))
        elif type(provided) is not KVCache:
            caches.append(provided)  # bounded or non-attention state: keep it
        else:
            caches.append(build(layer_spec))
    if spec.info.scored:
        install_router(model)
        verify_routing(model, caches)
    wall = context or getattr(args, "max_position_embeddings", None)
    if spec.info.reindexes and wall and len(model.layers) == len(caches):
        for layer, cache in zip(model.layers, caches, strict=True):
            rope = getattr(getattr(layer, "self_attn", None), "rope", None)
            global_h2o = isinstance(cache, H2OKVCache) and not hasattr(cache, "window")
            if rope is not None and global_h2o:  # sliding layers never see far keys
                cache.wall, cache.rope = wall, rope
    return caches


def adopt_rope(caches: list[Any], fresh: list[Any]) -> None:
    """Give caches loaded from a file what make_cache attaches and a file cannot hold:
    each H2O layer's RoPE and wall, taken from `fresh` caches of the same spec."""
    for cache, new in zip(caches, fresh, strict=True):
        if isinstance(cache, H2OKVCache):
            cache.wall, cache.rope = new.wall, new.rope


def tokens_seen(cache: Any) -> int:
    """Tokens a layer's cache has taken in: its offset, unless RoPE positions were
    re-indexed (H2O's `seen` counts on past its context)."""
    return getattr(cache, "seen", cache.offset)


def cache_usage(caches: list[Any]) -> tuple[int, int, int]:
    """(tokens seen, tokens stored, bytes held) over a model's per-layer caches.

    Seen is the longest offset; stored the largest physical size of a layer
    (layers evict alike, bounded sliding-window layers hold fewer).
    """
    attention = [c for c in caches if hasattr(c, "offset")]
    if not attention:
        return 0, 0, 0
    seen = max(tokens_seen(c) for c in attention)
    stored = max(c.size() for c in attention)
    return seen, stored, sum(c.nbytes for c in caches)
