"""make_cache: the per-layer cache list for a CacheSpec, with attention routed and verified."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from cache.h2o import H2OKVCache
from cache.mixed import MIXED_LAYOUTS
from cache.quantized import QuantizedH2OKVCache
from cache.router import install_router, verify_routing
from config.cache_spec import DEFAULT_POLICY, CacheSpec


def _h2o_knobs(spec: CacheSpec) -> dict:
    seg = spec.segments()
    return dict(
        sink=seg.sink, heavy=seg.heavy, recent=seg.recent, score=spec.score,
        evict_batch=spec.evict_batch,
    )  # fmt: skip


def _quantized(spec: CacheSpec) -> QuantizedH2OKVCache:
    info = spec.info
    return QuantizedH2OKVCache(
        spec.max_kv, **_h2o_knobs(spec), group_size=spec.group_size, bits=info.key_bits,
        value_bits=info.value_bits,
    )  # fmt: skip


def _mixed(spec: CacheSpec) -> H2OKVCache:
    cls, widths = MIXED_LAYOUTS[spec.mixed]
    return cls(spec.max_kv, **_h2o_knobs(spec), group_size=spec.group_size, **widths)


# PolicyInfo.cache -> a builder of one layer's cache.
BUILDERS = {
    "full": lambda spec: KVCache(),
    "rotating": lambda spec: RotatingKVCache(max_size=spec.max_kv, keep=spec.segments().sink),
    "h2o": lambda spec: H2OKVCache(spec.max_kv, **_h2o_knobs(spec)),
    "quantized": _quantized,
    "mixed": _mixed,
}


def _is_sliding_layer(layer: nn.Module) -> bool:
    """mlx-lm marks sliding-window layers with one of these flags."""
    attn = getattr(layer, "self_attn", None)
    return any(
        bool(getattr(obj, flag, False))
        for obj in (layer, attn)
        if obj is not None
        for flag in ("use_sliding", "is_sliding")
    )


def make_cache(model: nn.Module, policy: str | CacheSpec = DEFAULT_POLICY, **fields) -> list[Any]:
    """One cache per layer for a CacheSpec, or for a policy name and CacheSpec fields.

    e.g. `make_cache(model, "h2o", max_kv=256, score="attn")`. Layers whose
    model-provided cache is already bounded (sliding windows, recurrent state) keep
    it. For scored policies the attention router is installed into the model and
    verified: a model whose attention would bypass it raises here, since its H2O
    caches would never evict.
    """
    spec = (
        policy.replace(**fields) if isinstance(policy, CacheSpec) else CacheSpec(policy, **fields)
    )
    build = BUILDERS[spec.info.cache]
    base = make_prompt_cache(model)
    layers = getattr(model, "layers", None) or [None] * len(base)
    window = getattr(getattr(model, "args", None), "sliding_window", None)

    caches = []
    for layer, provided in zip(layers, base, strict=True):
        if type(provided) is not KVCache:
            caches.append(provided)  # bounded or non-attention state: keep it
        elif layer is not None and window and _is_sliding_layer(layer):
            caches.append(RotatingKVCache(max_size=window))
        else:
            caches.append(build(spec))
    if spec.info.scored:
        install_router(model)
        verify_routing(model, caches)
    return caches


def cache_usage(caches: list[Any]) -> tuple[int, int, int]:
    """(tokens seen, tokens stored, bytes held) over a model's per-layer caches.

    Seen is the longest offset; stored the largest physical size of a layer
    (layers evict alike, bounded sliding-window layers hold fewer).
    """
    attention = [c for c in caches if hasattr(c, "offset")]
    if not attention:
        return 0, 0, 0
    seen = max(c.offset for c in attention)
    stored = max(c.size() for c in attention)
    return seen, stored, sum(c.nbytes for c in caches)
