"""make_cache: the per-layer cache list for a CacheSpec, with attention routed and verified.

It reads the policy's record (config/policies.py) and asks the class the record names to
build each layer (`from_spec`); nothing here knows a policy by name.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from cache.contract import LayerCache, cache_class, holds_tokens, is_scored, tokens_seen
from cache.policies.full import plain
from cache.policies.rotating import SinkRotatingKVCache
from cache.router import install_router, verify_routing
from config.cache_spec import DEFAULT_POLICY, CacheSpec
from config.policies import FULL, POLICIES, Policy
from models.shape import LATENT, cache_owners, kv_shape, layer_windows

log = logging.getLogger("h2o_server.cache")


def window_fallback(policy: Policy, windows: list[int | None], max_kv: int) -> str | None:
    """What a user should know when sliding-window layers do not get `policy`'s own cache
    (its record's `in_window`), or None."""
    sliding = [w for w in windows if w is not None and w > max_kv]
    if not sliding or policy.in_window is None or not policy.bounded:
        return None
    return (
        f"{len(sliding)} of {len(windows)} layers attend through a sliding window: policy "
        f"{policy.name} has no cache inside a window, so those layers keep "
        f"{policy.in_window.name} caches of max_kv {max_kv} tokens"
    )


_TOLD: set[int] = set()  # models already told that they have no retention gates


def bind_rules(model: nn.Module, caches: list) -> str | None:
    """Give each layer's rule that binds to the model (`learned`) this model's gates for
    that layer (cache/retention/__init__.py); where the model has none they rank by their base
    rule, which is logged once per model. Returns that notice, or None."""
    rules = [c.score_rule for c in caches if getattr(c, "score_rule", None) is not None]
    if not any(r.binds_model for r in rules):
        return None
    from cache.retention import for_model, no_weights_notice

    found = for_model(model)
    for layer, c in enumerate(caches):
        rule = getattr(c, "score_rule", None)
        if rule is not None and rule.binds_model:
            size = getattr(c, "max_size", 0)
            c.score_rule = rule.bound(found.signature if found else "", layer, size)
    if found is not None:
        return None
    notice = no_weights_notice(rules[0].name)
    if id(model) not in _TOLD:
        _TOLD.add(id(model))
        log.warning("%s", notice)
    return notice


def unbound_rule_notices(caches: list) -> list[str]:
    """[the notice] where a layer's rule that binds to the model found no gates, else []."""
    from cache.retention import no_weights_notice

    for c in caches:
        rule = getattr(c, "score_rule", None)
        if rule is not None and rule.binds_model and not rule.gated:
            return [no_weights_notice(rule.name)]
    return []


def make_cache(
    model: nn.Module,
    policy: str | CacheSpec = DEFAULT_POLICY,
    *,
    context: int | None = None,
    scores_with_step: bool = False,
    **fields,
) -> list[Any]:
    """One cache per layer for a CacheSpec, or for a policy name and CacheSpec fields.

    e.g. `make_cache(model, "h2o", max_kv=256, score="attn")`. With `layer_shares`
    global layers get their own max_kv (CacheSpec.layer_sizes), as many tokens in all
    as uniform (cache/layer_profiles.py). A sliding-window layer keeps its window
    when that fits in max_kv (or the policy is unbounded), else gets max_kv tokens of
    its policy's cache inside the window (or of the policy its record names for such
    layers): every layer then holds at most its max_kv tokens. Other model-provided
    bounded caches (recurrent state) are kept.
    For scored policies the attention router is installed into the model and
    verified: a model whose attention would bypass it raises here, since its H2O
    caches would never evict. Caches of policies that re-index RoPE positions get each
    global layer's RoPE and the context (default: the model's), so a conversation may
    outgrow the context (cache/policies/h2o.py). A dense-first spec (`dense_until`) gets plain
    KVCaches where the policy's own would go, until `pack_dense`. `scores_with_step`:
    the caller evaluates the scored caches' scores with each decode step
    (`step_scores`), as the server does.
    """
    spec = (
        policy.replace(**fields) if isinstance(policy, CacheSpec) else CacheSpec(policy, **fields)
    )
    info = spec.info
    from cache.budget import model_refusal  # budget prices through the classes: not at import

    shape = kv_shape(model)  # its slots: what the model's layers hold (measured once)
    refusal = model_refusal(shape, spec.policy, spec.group_size)
    if refusal is not None:
        raise ValueError(refusal)
    plan = list(shape.slots)
    base = make_prompt_cache(model)
    if spec.layer_shares is not None and len(spec.layer_shares) != len(base):
        raise ValueError(
            f"layer shares name {len(spec.layer_shares)} layers; this model has {len(base)}"
        )
    windows = layer_windows(model)
    if spec.layer_shares is not None and any(
        w is not None and s is not None for w, s in zip(windows, spec.layer_shares, strict=True)
    ):
        # The budget prices a sliding layer at max_kv (cache/budget.py layer_bytes).
        raise ValueError("layer shares apply to global-attention layers: give sliding ones None")
    layer_specs = [spec.for_layer(k) for k in spec.layer_sizes()] or [spec] * len(base)
    own = cache_class(POLICIES[FULL.name] if spec.dense_until else info)  # pack_dense: later
    in_window = cache_class(info, window=True) if info.bounded else None
    wall = context or shape.context
    layers = cache_owners(model, base)
    caches = []
    for layer, slot, window, provided, layer_spec in zip(
        layers, plan, windows, base, layer_specs, strict=True
    ):
        if window is not None and (not info.bounded or window <= layer_spec.max_kv):
            caches.append(SinkRotatingKVCache(max_size=window, keep=0))  # exact, bounded
        elif window is not None:
            caches.append(in_window.from_spec(layer_spec, window))
        elif type(provided) is not KVCache:
            caches.append(provided)  # bounded or non-attention state: keep it
        else:
            cache = own.from_spec(layer_spec)
            rope = getattr(getattr(layer, "self_attn", None), "rope", None)
            if info.reindexes and wall and rope is not None:  # sliding layers see no far keys
                # MLA: the latent (`keys`) carries no RoPE; the key's RoPE part (`values`) does.
                cache.set_context(rope, wall, "values" if slot.kind == LATENT else "keys")
            caches.append(cache)
    bind_rules(model, caches)
    if info.scored:
        install_router(model)
        verify_routing(model, caches)
        for c in caches:
            if is_scored(c):
                c.scores_with_step = scores_with_step
    return caches


def dense_layers(caches: list[Any]) -> int:
    """A dense-first session's plain layers that pack_dense has still to pack."""
    return sum(plain(c) for c in caches)


def spec_as_held(spec: CacheSpec, caches: list[Any]) -> CacheSpec:
    """The spec whose fresh caches give each layer of `caches` what it adopts: a
    dense-first spec's (`dense_until`) without its dense start once any layer is not
    plain (one pack_dense packed, or a sliding window: the same class under both); a plain
    layer adopts nothing, so one not packed yet takes it too."""
    if spec.dense_until and not all(plain(c) for c in caches):
        return spec.replace(dense_until=0)
    return spec


def outgrows_dense(spec: CacheSpec, caches: list[Any], tokens: int) -> bool:
    """Whether dense-first `caches` (`spec.dense_until`) must be packed before they hold
    `tokens` in all."""
    return bool(spec.dense_until) and tokens > spec.dense_until and dense_layers(caches) > 0


def pack_dense(caches: list[Any], fresh: list[Any], layers: int | None = None) -> list[Any]:
    """Dense-first caches, packed: each plain layer's tokens stored into its `fresh` cache
    (make_cache's for the spec without `dense_until`); other layers (sliding windows) as
    they are. Layer by layer, so only one layer is held twice at a time. `layers`: pack
    only the first this many plain layers, the rest later (None: all)."""
    out, left = [], len(caches) if layers is None else layers
    for cache, new in zip(caches, fresh, strict=True):
        if not plain(cache) or left == 0:
            out.append(cache)
            continue
        left -= 1
        if cache.offset:
            n = cache.offset
            new.update_and_fetch(cache.keys[..., :n, :], cache.values[..., :n, :])
            cache.keys = cache.values = None
            mx.eval(new.state)
        out.append(new)
    return out


def adopt(caches: list[Any], fresh: list[Any]) -> None:
    """Give caches loaded from a file what make_cache attaches and a file cannot hold,
    taken from `fresh` caches of the same spec (LayerCache.adopt)."""
    for cache, new in zip(caches, fresh, strict=True):
        if isinstance(cache, LayerCache):
            cache.adopt(new)


def cache_usage(caches: list[Any]) -> tuple[int, int, int]:
    """(tokens seen, tokens stored, bytes held) over a model's per-layer caches.

    Seen is the longest; stored the largest physical size of a layer (layers evict
    alike, bounded sliding-window layers hold fewer).
    """
    attention = [c for c in caches if holds_tokens(c)]
    if not attention:
        return 0, 0, 0
    seen = max(tokens_seen(c) for c in attention)
    stored = max(c.size() for c in attention)
    return seen, stored, sum(c.nbytes for c in caches)
