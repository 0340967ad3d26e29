"""Budget math: what a conversation's caches cost, and the CacheSpec that fits a budget.

Every policy's cache class prices one layer (`LayerCache.layer_bytes`, cache/contract.py)
exactly as it allocates it, so `session_bytes` sums the layers without knowing any
policy: a global layer holds max_kv tokens of the policy's cache; a sliding-window
layer its own window when that fits in max_kv (or the policy is unbounded: a dense
window), else max_kv tokens of the cache its policy record names for such layers
(config/policies.py `in_window`), which is exactly what cache/factory.py builds. The
helpers below are the arithmetic those prices share:

A shape measured from a model (models/shape.py `layer_plan`) prices each cache slot on
its own: a per-token layer at its own heads and K/V widths, a state layer (linear
attention, SSM) at the fixed bytes it holds, live and at each kept checkpoint;
`model_refusal` says which policies the slots cannot hold (MLA's split widths packed,
Gemma 4's shared K/V packed, a group size that does not divide a head dim, sinks under
h2o-recall), and `auto` never picks one of those.

bytes/token = layers x kv_heads x (2 x head_dim x element bytes + H2O bookkeeping)
where packed K/V take head_dim x bits / 8 bytes plus one scale and one bias (in the
model's dtype) per `group_size` elements, and evicting (H2O) caches keep a float32 score
and an int32 position per KV head and slot (max_kv + 1 slots: the newest token waits in
a spare one until the eviction). KVarN caches hold both dense pools whole plus every
packed tile (`tile_nbytes`: words, float16 scales, biases and Sinkhorn factors).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from config.cache_spec import (
    DEFAULT_GROUP_SIZE,
    KVARN_SCALE_BYTES,
    QUANT_GROUP_SIZES,
    CacheSpec,
    choose,
    dense_recent_tokens,
)
from config.policies import AUTO, AUTO_ORDER, FULL, H2O, POLICIES, ROTATING
from models.shape import PER_TOKEN, SLIDING, ModelShape

H2O_BOOKKEEPING = 8  # float32 score + int32 position, per KV head and token
# A session keeps its state layers' arrays at this many prompt ends (the points a rewind
# returns to: server/sessions/conversation.py), each priced as the live state is.
STATE_CHECKPOINTS = 4
ADAPTIVE_BOOKKEEPING = 1  # h2o-ada: a uint8 head id per slot (cache/policies/adaptive.py)
MERGING_BOOKKEEPING = 4  # h2o-merge: a float32 count per slot (cache/policies/merging.py)
MIN_MAX_KV = 16
MAX_TOKENS = 2**24  # where max_kv_within stops looking (sliding layers alone never fill up)
REFERENCE_TOKENS = 8192  # bytes_per_token amortizes a cache of this many tokens
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

__all__ = ["ModelShape"]  # re-exported: callers price a shape they got from models.shape


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MB', '2g', 1048576 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 2GiB or a number of bytes)")
    number, unit, binary = m.groups()
    scale = 1024 ** "_KMGT".index(unit) if binary else _UNITS[unit]
    return int(float(number) * scale)


@dataclass(frozen=True)
class Budget:
    """Bytes for every conversation's KV cache, split evenly over `sessions`."""

    total: int
    sessions: int

    @property
    def per_session(self) -> int:
        return self.total // self.sessions


# ------------------------------------------------------------ arithmetic the prices share


def kv_width(shape: ModelShape, bits: int | None, group_size: int) -> float:
    """Bytes of one token's K or V in one head: dense, or packed plus a scale and a bias
    per group."""
    if bits is None:
        return shape.head_dim * shape.element_bytes
    return shape.head_dim * bits / 8 + 2 * shape.element_bytes * shape.head_dim / group_size


def packed_extras(shape: ModelShape, spec: CacheSpec, windowed: bool = False) -> int:
    """What a packed H2O layer (h2o-q8, h2o-q4, h2o-mixed k8v4) holds besides its slots:
    the key centre and, outside sliding windows, the dense sink pool and, with 4-bit keys,
    the dense tail of the newest tokens (cache/policies/quantized.py)."""
    segments = spec.segments()
    sinks = 0 if windowed else segments.sink
    tail = 0
    if not windowed:
        tail = dense_recent_tokens(spec.info.key_bits, segments.recent, spec.dense_recent)
    return shape.kv_heads * (1 + 2 * (sinks + tail)) * shape.head_dim * shape.element_bytes


def value_group(head_dim: int, fixed: int | None = None) -> int:
    """KVarN's value quantization group: `fixed` (h2o-kvarn's), else the largest of
    128/64/32 dividing the head dim."""
    widest_first = sorted(QUANT_GROUP_SIZES, reverse=True)
    for g in (fixed,) if fixed else widest_first:
        if head_dim % g == 0:
            return g
    raise ValueError(
        f"head dim {head_dim} is not a multiple of {fixed or 32}, the smallest quantization "
        "group mx.quantize supports here: KVarN cannot pack its values; use a dense policy"
    )


def tile_nbytes(head_dim: int, tile: int, key_bits: int, value_bits: int, group: int) -> int:
    """Bytes of one packed KVarN tile of one KV head: keys and values, words and every scale
    (values in groups of `group` channels)."""
    d, s, g = head_dim, KVARN_SCALE_BYTES, group
    keys = d * tile * key_bits // 8 + 2 * d * s + tile * s  # + scale/bias per channel, token factor
    values = tile * d * value_bits // 8 + 2 * tile * (d // g) * s + d * s  # + channel factor
    return keys + values


def kvarn_layer_bytes(
    shape: ModelShape,
    tokens: int,
    front: int,
    tile: int,
    bits: tuple[int, int],
    group: int,
    bookkeeping: int = 0,
) -> int:
    """One layer of KVarN storage holding `tokens`: the dense front pool (`front` slots)
    and tail pool (one tile) whole, every full tile packed, plus `bookkeeping` bytes per
    KV head."""
    tiles = max(0, tokens - front) // tile
    tail_pool = tile if tokens > front else 0
    packed = tiles * tile_nbytes(shape.head_dim, tile, *bits, group)
    per_head = (front + tail_pool) * shape.dense_token_bytes + packed + bookkeeping
    return shape.kv_heads * per_head


# ------------------------------------------------------------------- what a session costs


def _spec(policy: str | CacheSpec, max_kv: int | None, fields: dict) -> CacheSpec:
    if isinstance(policy, CacheSpec):
        return policy.replace(max_kv=max_kv or policy.max_kv, layer_shares=None, **fields)
    return CacheSpec(choose("policy", policy, POLICIES), max_kv, **fields)


def layer_bytes(shape: ModelShape, spec: CacheSpec, window: int | None = None) -> float:
    """One layer's cache as make_cache builds it: a global layer (window None) holds the
    policy's cache; a sliding-window layer its own window, dense, when that fits in max_kv
    or the policy is unbounded, else max_kv tokens of its `in_window` policy's cache."""
    from cache.contract import cache_class  # the classes price themselves, importing this

    info = spec.info
    if window is None:
        return cache_class(info).layer_bytes(shape, spec)
    if not info.bounded or window <= spec.max_kv:
        return window * shape.kv_heads * shape.dense_token_bytes
    return cache_class(info, window=True).layer_bytes(shape, spec, window)


def session_bytes(
    shape: ModelShape, policy: str | CacheSpec, max_kv: int | None = None, **fields
) -> float:
    """Bytes of one session's caches at `max_kv`, as allocated, summed over the layers.
    `fields`: the CacheSpec's other fields (group_size, kvarn, dense_recent, ...)."""
    spec = _spec(policy, max_kv, fields)
    if shape.slots:  # measured: each layer at its own heads and widths, states as they are
        total = 0.0
        for slot in shape.slots:
            if slot.kind in PER_TOKEN:
                window = slot.window if slot.kind == SLIDING else None
                total += layer_bytes(shape.for_slot(slot), spec, window)
            else:
                total += slot.fixed_bytes * (1 + STATE_CHECKPOINTS)
        return total
    total = shape.global_layers * layer_bytes(shape, spec)
    return total + sum(layer_bytes(shape, spec, window) for window in shape.windows)


def cache_bytes(shape: ModelShape, policy: str | CacheSpec, max_kv: int, **fields) -> float:
    """Bytes of one conversation's caches at `max_kv` with every layer global."""
    return shape.layers * layer_bytes(shape, _spec(policy, max_kv, fields))


def bytes_per_token(
    shape: ModelShape, policy: str | CacheSpec, max_kv: int | None = None, **fields
) -> float:
    """What one cached token costs across all layers: a cache of `max_kv` tokens
    (default REFERENCE_TOKENS) with every layer global, over its tokens."""
    tokens = max_kv or REFERENCE_TOKENS
    return cache_bytes(shape, policy, tokens, **fields) / tokens


def _priced_fields(policy: str, fields: dict) -> dict:
    """The spec fields a policy's price depends on (its record's knobs); segment sizes
    follow the preset at every max_kv tried."""
    knobs = POLICIES[policy].knobs
    return {k: v for k, v in fields.items() if k in knobs and v is not None}


def max_kv_within(nbytes: int, shape: ModelShape, policy: str, **fields) -> int:
    """The largest max_kv whose caches, as allocated, fit in `nbytes` (0 if none).
    `fields`: CacheSpec fields (those the policy's price depends on are used).

    Caches that allocate in blocks (mlx-lm's KVCache, 256 tokens) get whole blocks.
    The cost is not monotone at a window: at max_kv = window a sliding layer swaps the
    policy's cache for its own dense window, which may cost less, so each stretch
    between windows is searched on its own (the cost grows with max_kv inside one).
    """
    from cache.contract import cache_class

    info = POLICIES[choose("policy", policy, POLICIES)]
    step = cache_class(info).token_step
    priced = _priced_fields(policy, fields)

    def fits(k: int) -> bool:
        return session_bytes(shape, policy, k * step, **priced) <= nbytes

    starts = sorted({2, *shape.windows})  # max_kv 1 cannot be split into segments
    best = 0
    for i, start in enumerate(starts):
        lo = -(-start // step)
        if not fits(lo):
            continue
        if i + 1 < len(starts):
            hi = (starts[i + 1] - 1) // step
        else:  # the open last stretch: double until it no longer fits
            hi = lo
            while fits(hi) and hi < MAX_TOKENS:
                lo, hi = hi, hi * 2
        while lo < hi:  # largest k in [lo, hi] that fits; fits(lo) holds
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        best = max(best, lo * step)
    return best


def model_refusal(shape: ModelShape, policy: str, group_size: int) -> str | None:
    """Why the model's layers cannot hold `policy`'s caches (one line naming what works),
    or None. Read from the measured slots; a shape written by hand passes."""
    from cache.contract import cache_class

    info = POLICIES[policy]
    per_token = [s for s in shape.slots if s.kind in PER_TOKEN]
    split = [s for s in per_token if s.key_width != s.value_width]
    if split and (info.quantized or not info.split_widths):
        s = split[0]
        return (
            f"{len(split)} layer(s) of this model store K and V at different widths "
            f"({s.key_width} and {s.value_width}: an MLA latent and its RoPE part): policy "
            f"{policy} holds both at one width; use {H2O.name} (or {FULL.name})"
        )
    if info.quantized and shape.kv_shared_layers:
        return (
            f"{shape.kv_shared_layers} layer(s) of this model attend over another layer's K/V "
            f"outside its cache, which reads them dense: policy {policy} packs them; use "
            f"{H2O.name} (or {FULL.name})"
        )
    if info.scored and any(s.sinks for s in per_token) and not cache_class(info).takes_sinks:
        return (
            f"this model's attention adds learned sink logits, which policy {policy} does not "
            f"take; use {H2O.name} (or {ROTATING.name})"
        )
    if info.quantized:
        widths = sorted({w for s in per_token for w in (s.key_width, s.value_width)})
        odd = [w for w in widths if w % group_size]
        if odd:
            fits = [g for g in QUANT_GROUP_SIZES if all(w % g == 0 for w in widths)]
            fix = f"--kv-group-size {max(fits)}" if fits else f"a dense policy ({H2O.name})"
            return (
                f"head dim {odd[0]} is not a multiple of the quantization group {group_size}: "
                f"policy {policy} cannot pack it; use {fix}"
            )
        try:
            for width in widths:
                cache_class(info).check_head_dim(CacheSpec(policy, group_size=group_size), width)
        except ValueError as e:
            return str(e)
    return None


def group_size_for(shape: ModelShape, wanted: int) -> int:
    """`wanted`, or the widest quantization group dividing every per-token width."""
    widths = {w for s in shape.slots if s.kind in PER_TOKEN for w in (s.key_width, s.value_width)}
    if all(w % wanted == 0 for w in widths):
        return wanted
    fits = [g for g in QUANT_GROUP_SIZES if all(w % g == 0 for w in widths)]
    return max(fits) if fits else wanted


def auto_policy(shape: ModelShape, budget: Budget, group_size: int = DEFAULT_GROUP_SIZE) -> str:
    """The first of AUTO_ORDER (config/policies.py) that the model's layers can hold and
    that holds its whole context in one session's share, else the first bounded one they
    can hold: AUTO_ORDER's last, then h2o (dense), then rotating."""
    *whole_context, bounded = AUTO_ORDER
    group_size = group_size_for(shape, group_size)
    for policy in whole_context:
        if model_refusal(shape, policy.name, group_size) is not None:
            continue
        if budget.per_session >= session_bytes(shape, policy.name, shape.context):
            return policy.name
    for policy in (bounded, H2O, ROTATING):
        if model_refusal(shape, policy.name, group_size) is None:
            return policy.name
    return ROTATING.name


def fit_spec(
    shape: ModelShape,
    budget: Budget | None,
    policy: str = AUTO,
    max_kv: int | None = None,
    shares_for: Callable[[str], tuple | None] | None = None,
    **fields,
) -> CacheSpec:
    """The CacheSpec for `policy` within one session's share of `budget`.

    `auto` picks the policy from the budget. `max_kv` None takes the largest that
    fits (capped at the model's context); a given one must fit. With no budget
    (one-off generation) max_kv is taken as given. `shares_for(policy)`: its layer
    shares (a LayerProfile's), unless `fields` fix segment sizes; they move tokens
    between layers and keep the bytes. `fields`: the rest of CacheSpec.
    Raises ValueError saying what does not fit.
    """
    if policy == AUTO:
        if budget is None:
            raise ValueError("policy auto needs a memory budget")
        group_size = group_size_for(shape, fields.get("group_size") or DEFAULT_GROUP_SIZE)
        policy = auto_policy(shape, budget, group_size)
        if POLICIES[policy].quantized and group_size != (
            fields.get("group_size") or DEFAULT_GROUP_SIZE
        ):
            fields["group_size"] = group_size  # a group the model's head dims divide
        if "dense_until" in POLICIES[policy].knobs and fields.get("dense_until") is None:
            # Packed only once the conversation outgrows what its share holds dense.
            dense = max_kv_within(budget.per_session, shape, FULL.name)
            fields["dense_until"] = min(dense, shape.context)
    choose("policy", policy, POLICIES)
    refusal = model_refusal(shape, policy, fields.get("group_size") or DEFAULT_GROUP_SIZE)
    if refusal is not None:
        raise ValueError(refusal)
    explicit_segments = any(fields.get(k) is not None for k in ("sink", "heavy", "recent"))
    if shares_for is not None and not explicit_segments:
        fields["layer_shares"] = shares_for(policy)
    if budget is not None:
        limit = max_kv_within(budget.per_session, shape, policy, **fields)
        limit = min(limit, shape.context)
        if limit < MIN_MAX_KV:
            raise ValueError(
                f"--kv-budget {budget.total} B over {budget.sessions} sessions leaves {limit} "
                f"tokens per session under {policy} ({bytes_per_token(shape, policy):.0f} "
                "B/token): raise --kv-budget or lower --max-sessions"
            )
        if max_kv is not None and max_kv > limit:
            raise ValueError(
                f"max_kv {max_kv} exceeds the per-session budget: at most {limit} tokens "
                f"under {policy}"
            )
        max_kv = max_kv or limit
    if max_kv is None:
        raise ValueError("max_kv is needed when there is no memory budget")
    return CacheSpec(policy, max_kv, **fields)
