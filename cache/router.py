"""Attention router: feeds attention scores to the caches that evict by them.

mlx-lm model modules call the module-level `scaled_dot_product_attention` they
imported from `mlx_lm.models.base`. Installing the router rebinds that name, in
the modules the model's classes come from, to a wrapper: a layer whose cache
has `update_scores` attends through cache/attention.py (which exports the
scores) and hands the scores to its cache; every other layer goes through
mlx-lm's original function unchanged. A BatchedCache (several sessions in one
forward pass, cache/batching/batch.py) is attended part by part, each by these same
rules. No mlx-lm source is modified.

Learned attention sinks (gpt-oss's `sinks=`) reach the scored attention, which applies
them to its output from the exported logits (cache/attention.py `with_sinks`).
Loud, never silent: a scored layer whose attention passes another argument the scoring
kernels do not take (or sinks to a cache that cannot take them) raises
`UnroutedAttention`, and
`verify_routing` (run by make_cache) traces one token through the model and
raises when a scored layer's attention never reaches the router (e.g. a model
calling mx.fast.scaled_dot_product_attention directly), naming the architecture.
Without that, its H2O cache would never evict and the memory budget would break.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from cache.attention import ATTENTION
from cache.batching.batch import BatchedCache
from cache.contract import ScoredCache, is_scored

_ATTR = "scaled_dot_product_attention"


class UnroutedAttention(ValueError):
    """A scored cache sits on a layer whose attention the router cannot score."""


def _route(original: Callable) -> Callable:
    def routed_sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kw):
        if isinstance(cache, BatchedCache):  # part by part, each by these same rules

            def attend_part(q, k, v, part, part_mask):
                return routed_sdpa(q, k, v, part, scale, part_mask, sinks, **kw)

            return cache.attend(queries, keys, values, mask, attend_part)
        if not is_scored(cache):
            if sinks is not None:
                kw["sinks"] = sinks
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        if kw:
            raise UnroutedAttention(
                f"this layer's attention passes {', '.join(sorted(kw))}, which the "
                "score-exporting kernels do not take: H2O cannot score it; use policy full "
                "or rotating"
            )
        if sinks is not None and not cache.takes_sinks:
            raise UnroutedAttention(
                f"this layer's attention adds learned sinks, which {type(cache).__name__} "
                "does not take: use policy h2o"
            )
        bias = cache.logit_bias()
        return ATTENTION.attend_scored(queries, keys, values, cache, scale, mask, bias, sinks)

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

    The router changes nothing for layers without a scored cache, so it stays
    installed for the process (uninstall_router restores mlx-lm's function).
    Returns the names of the modules now routed.
    """
    modules = _attention_modules(model)
    for name, fn in modules.items():
        if not hasattr(fn, "h2o_original"):
            setattr(sys.modules[name], _ATTR, _route(fn))
    return list(modules)


@contextmanager
def tapped(model: nn.Module, tap: Callable) -> Iterator[None]:
    """Inside: `tap(queries, keys, values, scale, mask)` sees every attention call of the
    model (layer by layer, in order) before it runs as it would (training reads them)."""
    modules = _attention_modules(model)

    def wrap(fn: Callable) -> Callable:
        def tapped_sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
            tap(queries, keys, values, scale, mask)
            return fn(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

        return tapped_sdpa

    for name, fn in modules.items():
        setattr(sys.modules[name], _ATTR, wrap(fn))
    try:
        yield
    finally:
        for name, fn in modules.items():
            setattr(sys.modules[name], _ATTR, fn)


def uninstall_router(model: nn.Module) -> None:
    """Restore mlx-lm's original attention function in the model's modules."""
    for name, fn in _attention_modules(model).items():
        if hasattr(fn, "h2o_original"):
            setattr(sys.modules[name], _ATTR, fn.h2o_original)


def verify_routing(model: nn.Module, caches: list) -> None:
    """Raise UnroutedAttention unless every scored layer's attention reaches the router.

    Traces one token through the model with probe caches in the scored layers'
    places (the graph is built, never evaluated, so it costs milliseconds); the
    result is remembered per model and set of layers.
    """
    scored = frozenset(i for i, c in enumerate(caches) if is_scored(c))
    verified = getattr(model, "_h2o_routed_layers", frozenset())
    if not scored or scored <= verified:
        return
    # Fresh model-provided caches elsewhere, so probing leaves the real ones untouched.
    probes = [_Probe() if i in scored else c for i, c in enumerate(make_prompt_cache(model))]
    model(mx.array([[0]]), cache=probes)
    missed = sorted(i for i in scored if not probes[i].scored)
    if missed:
        arch = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
        raise UnroutedAttention(
            f"model type {arch!r}: the attention of layer(s) {missed} does not go through "
            f"mlx-lm's {_ATTR}, so H2O cannot see its scores and would never evict. "
            "Use policy full or rotating with this model"
        )
    object.__setattr__(model, "_h2o_routed_layers", verified | scored)


class _Probe(ScoredCache):
    """Stands in for a scored cache while tracing: records that scores arrived."""

    offset = 0

    def __init__(self):
        self.scored = False
        self.keys = None

    def update_and_fetch(self, keys, values):
        return keys, values

    def update_scores(self, scores, probs=None) -> None:
        self.scored = True

    def size(self) -> int:
        return 1

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None if N == 1 else "causal"
