"""Attention router: feeds attention scores to caches that want them.

mlx-lm model modules call the module-level `scaled_dot_product_attention`
they imported from `mlx_lm.models.base`. Installing the router rebinds that
name, in the modules the model's classes come from, to a wrapper: a layer
whose cache has `update_scores` gets `sdpa_with_scores` and hands the scores
to its cache; every other layer goes through mlx-lm's original function
unchanged. A cache that stores K/V its own way (quantized, in segments) has
`attention_with_scores` and computes both itself. No mlx-lm source is modified.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import mlx.nn as nn

from kernels import sdpa_with_scores

_ATTR = "scaled_dot_product_attention"


def _route(original: Callable) -> Callable:
    def routed_sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kw):
        if sinks is None and not kw and hasattr(cache, "update_scores"):
            attend = getattr(cache, "attention_with_scores", sdpa_with_scores)
            out, scores = attend(queries, keys, values, scale=scale, mask=mask)
            cache.update_scores(scores)
            return out
        if sinks is not None:
            kw["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    routed_sdpa.h2o_original = original
    return routed_sdpa


def _attention_modules(model: nn.Module) -> dict[str, Callable]:
    """Python modules defining the model's classes that call `_ATTR`, with its current value."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    found = {}
    for name in sorted(names):
        fn = getattr(sys.modules.get(name), _ATTR, None)
        if callable(fn):
            found[name] = fn
    return found


def install_router(model: nn.Module) -> list[str]:
    """Route attention in every module that defines the model's layers. Idempotent.

    Returns the names of the modules now routed.
    """
    modules = _attention_modules(model)
    for name, fn in modules.items():
        if not hasattr(fn, "h2o_original"):
            setattr(sys.modules[name], _ATTR, _route(fn))
    return list(modules)


def uninstall_router(model: nn.Module) -> None:
    """Restore mlx-lm's original attention function in the model's modules."""
    for name, fn in _attention_modules(model).items():
        if hasattr(fn, "h2o_original"):
            setattr(sys.modules[name], _ATTR, fn.h2o_original)
