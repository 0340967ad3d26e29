"""Budget math: bytes per cached token, and the CacheSpec that fits a memory budget.

Pure arithmetic over the cache vocabulary (config/cache_spec.py); no MLX.

bytes/token = layers x kv_heads x (2 x head_dim x element bytes + H2O bookkeeping)
where quantized policies store head_dim x bits / 8 bytes plus one scale and one
bias (float32 on CPU, float16 elsewhere) per `group_size` elements, and scored
(H2O) policies keep a float32 score and an int32 position per KV head and token.

kvarn and h2o-kvarn are priced by `cache_bytes` at their largest, exactly as their
`nbytes` counts (cache/kvarn.py): the dense front pool (kvarn: 128 sink slots; h2o-kvarn:
H2O's sinks) and the dense tail pool (one tile of slots) whole, plus every packed tile
(`tile_nbytes`: words, float16 scales, biases and Sinkhorn factors); h2o-kvarn adds
H2O's score and position for max_kv + 1 slots. Their bytes per token are that total
amortized over max_kv tokens, so they depend on max_kv.

A session's bytes are summed per layer (`session_bytes`), since layers hold different
counts: a global layer holds max_kv tokens as above, a sliding-window layer its window
when that fits in max_kv (or the policy is unbounded; a dense sliding cache), else
max_kv tokens of the policy's cache (h2o-kvarn: a dense max_kv window), exactly what
cache/factory.py builds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from config.cache_spec import (
    AUTO,
    DEFAULT_GROUP_SIZE,
    DEFAULT_KVARN,
    H2O_KVARN_VALUE_GROUP,
    KVARN_PRESETS,
    KVARN_SCALE_BYTES,
    KVARN_SINK,
    KVARN_TILE,
    POLICIES,
    QUANT_GROUP_SIZES,
    RECALL_ARCHIVE,
    RECALL_BITS,
    CacheSpec,
    choose,
    dense_recent_tokens,
    h2o_kvarn_tile,
    split_segments,
)

H2O_BOOKKEEPING = 8  # float32 score + int32 position, per KV head and token
ADAPTIVE_BOOKKEEPING = 1  # h2o-ada: a uint8 head id per slot (cache/adaptive.py)
MERGING_BOOKKEEPING = 4  # h2o-merge: a float32 count per slot (cache/merging.py)
FULL_CACHE_STEP = 256  # mlx-lm KVCache.step
# What `auto` picks when the context does not fit packed: at equal bytes 8-bit H2O
# holds 3.3x dense H2O's tokens at no measurable loss per token (docs/equal_bytes.md).
AUTO_BOUNDED = "h2o-q8"
MIN_MAX_KV = 16
MAX_TOKENS = 2**24  # where max_kv_within stops looking (sliding layers alone never fill up)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


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
class ModelShape:
    layers: int  # attention layers holding a KV cache
    kv_heads: int
    head_dim: int
    element_bytes: int  # K/V dtype: 4 for float32 (CPU), 2 for float16/bfloat16
    context: int  # the model's trained context length
    # Sliding-window sizes of the layers that have one (Gemma 3: 15 of 18 at 512);
    # the other layers attend globally.
    windows: tuple[int, ...] = ()

    @classmethod
    def of(cls, model, element_bytes: int, windows: tuple[int, ...] = ()) -> ModelShape:
        """`windows`: what cache.factory.layer_windows reports for this model."""
        args = model.args
        heads = args.num_attention_heads
        kv_heads = getattr(args, "num_key_value_heads", None) or heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
        context = getattr(args, "max_position_embeddings", None) or 4096
        return cls(len(model.layers), kv_heads, head_dim, element_bytes, context, windows)

    @property
    def global_layers(self) -> int:
        return self.layers - len(self.windows)


@dataclass(frozen=True)
class Budget:
    """Bytes for every conversation's KV cache, split evenly over `sessions`."""

    total: int
    sessions: int

    @property
    def per_session(self) -> int:
        return self.total // self.sessions


KVARN_POLICIES = ("kvarn", "h2o-kvarn")
KVARN_REFERENCE_TOKENS = 8192  # bytes_per_token of the kvarn policies without a max_kv


def value_group(head_dim: int, policy: str = "kvarn") -> int:
    """KVarN's value quantization group: H2O_KVARN_VALUE_GROUP for h2o-kvarn, else the
    largest of 128/64/32 dividing the head dim."""
    widest_first = sorted(QUANT_GROUP_SIZES, reverse=True)
    for g in (H2O_KVARN_VALUE_GROUP,) if policy == "h2o-kvarn" else widest_first:
        if head_dim % g == 0:
            return g
    raise ValueError(
        f"head dim {head_dim} is not a multiple of 32, the smallest quantization group "
        "mx.quantize supports: KVarN cannot pack its values; use a dense policy"
    )


def tile_nbytes(head_dim: int, tile: int, key_bits: int, value_bits: int, group: int) -> int:
    """Bytes of one packed KVarN tile of one KV head: keys and values, words and every scale
    (values in groups of `group` channels)."""
    d, s, g = head_dim, KVARN_SCALE_BYTES, group
    keys = d * tile * key_bits // 8 + 2 * d * s + tile * s  # + scale/bias per channel, token factor
    values = tile * d * value_bits // 8 + 2 * tile * (d // g) * s + d * s  # + channel factor
    return keys + values


def cache_bytes(shape: ModelShape, policy: str, max_kv: int, kvarn: str = DEFAULT_KVARN) -> int:
    """Bytes of one conversation's kvarn / h2o-kvarn cache at its largest (max_kv tokens)."""
    if policy not in KVARN_POLICIES:
        raise ValueError(f"cache_bytes prices the kvarn policies, not {policy!r}")
    key_bits, value_bits = KVARN_PRESETS[kvarn]
    tile = KVARN_TILE if policy == "kvarn" else h2o_kvarn_tile(max_kv)
    dense_slot = 2 * shape.head_dim * shape.element_bytes
    if policy == "kvarn":
        front, tokens, book = KVARN_SINK, max_kv, 0
    else:  # the newest token sits in a spare slot until eviction, as in dense H2O
        front, tokens = split_segments(max_kv).sink, max_kv + 1
        book = H2O_BOOKKEEPING * tokens
    tiles = max(0, tokens - front) // tile
    tail_pool = tile if tokens > front else 0
    group = value_group(shape.head_dim, policy)
    packed = tiles * tile_nbytes(shape.head_dim, tile, key_bits, value_bits, group)
    per_head = (front + tail_pool) * dense_slot + packed + book
    return shape.layers * shape.kv_heads * per_head


def kv_width(shape: ModelShape, bits: int | None, group_size: int) -> float:
    """Bytes of one token's K or V in one head: dense, or packed plus a scale and a bias
    per group."""
    if bits is None:
        return shape.head_dim * shape.element_bytes
    return shape.head_dim * bits / 8 + 2 * shape.element_bytes * shape.head_dim / group_size


def bytes_per_token(
    shape: ModelShape,
    policy: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    max_kv: int | None = None,
    kvarn: str = DEFAULT_KVARN,
) -> float:
    """Bytes one cached token costs across all layers under `policy` (every layer's cache
    of the policy's kind; `session_bytes` counts what each layer really holds).

    kvarn / h2o-kvarn (preset `kvarn`): `cache_bytes` over max_kv (default
    KVARN_REFERENCE_TOKENS).
    """
    info = POLICIES[choose("policy", policy, POLICIES)]
    if policy in KVARN_POLICIES:
        tokens = max_kv or KVARN_REFERENCE_TOKENS
        return cache_bytes(shape, policy, tokens, kvarn) / tokens

    per_head = kv_width(shape, info.key_bits, group_size)
    per_head += kv_width(shape, info.value_bits, group_size)
    if info.scored:
        per_head += H2O_BOOKKEEPING
    if info.cache == "adaptive":
        per_head += ADAPTIVE_BOOKKEEPING
    if info.cache == "merging":
        per_head += MERGING_BOOKKEEPING
    return shape.layers * shape.kv_heads * per_head


def archive_bytes_per_token(shape: ModelShape, group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """h2o-recall: one archived token across all layers (8-bit K and V with a scale and a
    bias per group, its position and score)."""
    packed = 2 * kv_width(shape, RECALL_BITS, group_size)
    return shape.layers * shape.kv_heads * (packed + H2O_BOOKKEEPING)


def packed_extras(
    shape: ModelShape,
    max_kv: int,
    windowed: bool = False,
    key_bits: int = 8,
    dense_recent: int | None = None,
) -> int:
    """What a packed H2O layer (h2o-q8, h2o-q4, h2o-mixed k8v4) holds besides its slots:
    the key centre and, outside sliding windows, the dense sink pool and, with 4-bit keys,
    the dense tail of the newest tokens (`dense_recent`, None: the default for `key_bits`;
    cache/quantized.py)."""
    segments = split_segments(max_kv)
    sinks = 0 if windowed else segments.sink
    tail = 0 if windowed else dense_recent_tokens(key_bits, segments.recent, dense_recent)
    return shape.kv_heads * (1 + 2 * (sinks + tail)) * shape.head_dim * shape.element_bytes


def _layer_bytes(
    shape: ModelShape,
    policy: str,
    max_kv: int,
    group_size: int,
    kvarn: str,
    windowed: bool = False,
    dense_recent: int | None = None,
) -> float:
    """One layer's cache of `policy`'s kind at max_kv, as allocated (spare slot, steps);
    `windowed`: inside a sliding window larger than max_kv."""
    info = POLICIES[policy]
    if policy in KVARN_POLICIES:
        return cache_bytes(shape, policy, max_kv, kvarn) / shape.layers
    if not info.bounded:
        slots = -(-max_kv // FULL_CACHE_STEP) * FULL_CACHE_STEP
    else:
        slots = max_kv + 1 if info.scored else max_kv
    held = slots * bytes_per_token(shape, policy, group_size)
    if info.cache in ("quantized", "mixed"):
        extras = packed_extras(shape, max_kv, windowed, info.key_bits, dense_recent)
        held += extras * shape.layers
    if info.cache == "recall":
        held += RECALL_ARCHIVE * max_kv * archive_bytes_per_token(shape, group_size)
    return held / shape.layers


def session_bytes(
    shape: ModelShape,
    policy: str,
    max_kv: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    kvarn: str = DEFAULT_KVARN,
    dense_recent: int | None = None,
) -> float:
    """Bytes of one session's caches at `max_kv`, as allocated, summed over the layers."""
    info = POLICIES[choose("policy", policy, POLICIES)]
    per_layer = _layer_bytes(shape, policy, max_kv, group_size, kvarn, False, dense_recent)
    dense = bytes_per_token(shape, "rotating") / shape.layers  # one token, one layer
    total = shape.global_layers * per_layer
    for window in shape.windows:
        if not info.bounded or window <= max_kv:
            total += window * dense  # the layer keeps its own window
        elif policy == "h2o-kvarn":
            total += max_kv * dense  # a max_kv window (no KVarN twin inside a window)
        elif info.cache in ("adaptive", "merging", "recall"):
            total += _layer_bytes(shape, "h2o", max_kv, group_size, kvarn)  # plain H2O
        else:
            total += _layer_bytes(shape, policy, max_kv, group_size, kvarn, windowed=True)
    return total


def max_kv_within(
    nbytes: int,
    shape: ModelShape,
    policy: str,
    kvarn: str = DEFAULT_KVARN,
    group_size: int = DEFAULT_GROUP_SIZE,
    dense_recent: int | None = None,
) -> int:
    """The largest max_kv whose caches, as allocated, fit in `nbytes` (0 if none).

    A full cache gets whole steps of 256 tokens. The cost is not monotone at a
    window: at max_kv = window a sliding layer swaps the policy's cache for its own
    dense window, which may cost less, so each stretch between windows is searched
    on its own (the cost grows with max_kv inside one).
    """
    step = FULL_CACHE_STEP if POLICIES[choose("policy", policy, POLICIES)].cache == "full" else 1

    def fits(k: int) -> bool:
        return session_bytes(shape, policy, k * step, group_size, kvarn, dense_recent) <= nbytes

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


def auto_policy(shape: ModelShape, budget: Budget) -> str:
    """full when the model's whole context fits, else kvarn when it fits packed (nothing
    forgotten, within ~0.5% of full), else 8-bit H2O: in the same bytes it keeps more
    than dense or merging H2O, and loses less (docs/equal_bytes.md)."""
    share = budget.per_session
    if share >= session_bytes(shape, "full", shape.context):
        return "full"
    if share >= session_bytes(shape, "kvarn", shape.context):
        return "kvarn"
    return AUTO_BOUNDED


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
        policy = auto_policy(shape, budget)
    choose("policy", policy, POLICIES)
    explicit_segments = any(fields.get(k) is not None for k in ("sink", "heavy", "recent"))
    if shares_for is not None and not explicit_segments:
        fields["layer_shares"] = shares_for(policy)
    if budget is not None:
        kvarn = fields.get("kvarn", DEFAULT_KVARN)
        group_size = fields.get("group_size", DEFAULT_GROUP_SIZE)
        dense_recent = fields.get("dense_recent")
        limit = max_kv_within(budget.per_session, shape, policy, kvarn, group_size, dense_recent)
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
