"""Attention router: feeds attention scores to caches that want them.

mlx-lm model modules call the module-level `scaled_dot_product_attention`
they imported from `mlx_lm.models.base`. Installing the router rebinds that
name, in the modules the model's classes come from, to a wrapper: a layer
whose cache has `update_scores` gets `sdpa_with_scores` and hands the scores
to its cache; every other layer goes through mlx-lm's original function
unchanged. No mlx-lm source is modified.
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
            out, scores = sdpa_with_scores(queries, keys, values, scale=scale, mask=mask)
            cache.update_scores(scores)
            return out
        if sinks is not None:
            kw["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    routed_sdpa.h2o_original = original
    return routed_sdpa


def install_router(model: nn.Module) -> list[str]:
    """Route attention in every module that defines the model's layers. Idempotent.

    Returns the names of the modules now routed.
    """
    module_names = {type(m).__module__ for _, m in model.named_modules()}
    module_names.add(type(model).__module__)
    routed = []
    for name in sorted(module_names):
        module = sys.modules.get(name)
        fn = getattr(module, _ATTR, None)
        if fn is None or not callable(fn):
            continue
        if not hasattr(fn, "h2o_original"):
            setattr(module, _ATTR, _route(fn))
        routed.append(name)
    return routed


def uninstall_router(model: nn.Module) -> None:
    """Restore mlx-lm's original attention function in the model's modules."""
    for _, m in [("", model), *model.named_modules()]:
        module = sys.modules.get(type(m).__module__)
        fn = getattr(module, _ATTR, None)
        if fn is not None and hasattr(fn, "h2o_original"):
            setattr(module, _ATTR, fn.h2o_original)
