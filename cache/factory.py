"""make_cache: the per-layer cache list for a policy, with the router installed."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from cache.h2o import H2OKVCache
from cache.presets import split_budget
from cache.quantized import (
    DEFAULT_GROUP_SIZE,
    MIXED_DEFAULT,
    MIXED_SCHEMES,
    QuantizedH2OKVCache,
)
from cache.router import install_router
from cache.scores import EMA_ALPHA

POLICIES = ("full", "rotating", "h2o", "h2o-q8", "h2o-q4", "h2o-mixed")
DEFAULT_SCORE = "attn"
# Quantized policies -> (key bits, value bits) of what their caches store; h2o-mixed
# as its default scheme (MIXED_DEFAULT). The budget math (cache/budget.py) reads this too.
QUANT_BITS = {"h2o-q8": (8, 8), "h2o-q4": (4, 4)}
_mixed_widths = MIXED_SCHEMES[MIXED_DEFAULT][1]  # k8v4: QuantizedH2OKVCache's widths
QUANT_BITS["h2o-mixed"] = (_mixed_widths["bits"], _mixed_widths["value_bits"])


def _is_sliding_layer(layer: nn.Module) -> bool:
    """mlx-lm marks sliding-window layers with one of these flags."""
    attn = getattr(layer, "self_attn", None)
    return any(
        bool(getattr(obj, flag, False))
        for obj in (layer, attn)
        if obj is not None
        for flag in ("use_sliding", "is_sliding")
    )


def _sliding_window(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "sliding_window", None)


def make_cache(
    model: nn.Module,
    policy: str = "h2o",
    max_kv: int = 256,
    preset: str = "heavy",
    score: str = DEFAULT_SCORE,
    sink: int | None = None,
    heavy: int | None = None,
    recent: int | None = None,
    alpha: float = EMA_ALPHA,
    evict_batch: int | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    mixed: str = MIXED_DEFAULT,
) -> list[Any]:
    """One cache per layer for `policy` (full | rotating | h2o | h2o-q8 | h2o-q4 | h2o-mixed).

    Layers whose model-provided cache is already bounded (sliding windows,
    recurrent state) keep it. For the h2o policies the attention router is
    installed into the model (idempotent) so plain
    `mlx_lm.stream_generate(..., prompt_cache=...)` feeds scores to the caches.
    `group_size` applies to the quantized policies, `mixed` (a MIXED_SCHEMES key)
    to h2o-mixed.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if mixed not in MIXED_SCHEMES:
        raise ValueError(f"unknown mixed scheme {mixed!r}; choose from {list(MIXED_SCHEMES)}")
    budget = split_budget(max_kv, preset, sink=sink, heavy=heavy, recent=recent)
    base = make_prompt_cache(model)
    layers = getattr(model, "layers", None) or [None] * len(base)
    window = _sliding_window(model)

    caches = []
    for layer, provided in zip(layers, base, strict=True):
        if type(provided) is not KVCache:
            caches.append(provided)  # bounded or non-attention state: keep it
        elif layer is not None and window and _is_sliding_layer(layer):
            caches.append(RotatingKVCache(max_size=window))
        elif policy == "full":
            caches.append(KVCache())
        elif policy == "rotating":
            caches.append(RotatingKVCache(max_size=max_kv, keep=budget.sink))
        else:
            h2o = {
                "sink": budget.sink,
                "heavy": budget.heavy,
                "recent": budget.recent,
                "score": score,
                "alpha": alpha,
                "evict_batch": evict_batch,
            }
            if policy in ("h2o-q8", "h2o-q4"):
                bits, value_bits = QUANT_BITS[policy]
                c = QuantizedH2OKVCache(
                    budget.max_size, **h2o, group_size=group_size, bits=bits, value_bits=value_bits
                )
            elif policy == "h2o-mixed":
                cls, widths = MIXED_SCHEMES[mixed]
                c = cls(budget.max_size, **h2o, group_size=group_size, **widths)
            else:
                c = H2OKVCache(budget.max_size, **h2o)
            caches.append(c)
    if policy.startswith("h2o"):
        install_router(model)
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
