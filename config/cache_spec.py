"""The cache vocabulary: presets, score rules, their knobs, and the CacheSpec naming one cache.

Standard library only, so that everything can derive from it without importing MLX:
the settings and request models (pydantic Literals), the CLI choices, the `kv_cache`
request extension, the budget math (cache/budget.py) and the cache factory
(cache/factory.py). Policies are records in config/policies.py; a new score rule is
one entry here plus its file in cache/scores/.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from config.policies import AUTO, DEFAULT_POLICY, POLICIES, Policy

PRESETS: dict[str, str] = {
    "heavy": "heavy = max/2, recent = max/2 - sink",
    "balanced": "heavy = max/4, the rest to the recent window",
    "lean": "recent = max/8, the rest to heavy (for rules that weigh recency themselves)",
}
SCORE_RULES: dict[str, str] = {
    "attn": "accumulated softmax probability (original H2O)",
    "ema": "EMA of |pre-softmax logit|, C = a*C + (1-a)*|s| (the MLX H2O paper)",
    "mean": "accumulated probability per query that has seen the key (no bias toward old keys)",
    "tova": "probability from the newest query only (TOVA)",
    "snap": "SnapKV: a prompt's last 32 queries vote, max-pooled over 5 neighbours",
    "value": "mean times the value's distance from the held values' mean (DropKV-like)",
    "learned": "mean times a retention gate of key and value trained per model "
    "(cache/retention/__init__.py; mean where the model has none)",
}
# h2o-mixed layouts (cache/policies/quantized.py implements them; docs/quantized.md measures them).
MIXED_SCHEMES: dict[str, str] = {
    "k8v4": "keys 8-bit, values 4-bit in every segment",
    "paper": "heavy segment 8-bit, recent window 4-bit (a token is quantized twice)",
    "dense-recent": "recent window dense, 8-bit once a token leaves it",
}

# KVarN presets: name -> (key bits, value bits).
KVARN_PRESETS: dict[str, tuple[int, int]] = {"k4v2": (4, 2), "k4v4": (4, 4), "k2v2": (2, 2)}
KVARN_TILE = 128  # kvarn: tokens per packed tile (KVarN's tile)
KVARN_SINK = 128  # kvarn: first tokens kept dense (the sink pool)
# h2o-kvarn: how a tile loses tokens (cache/policies/h2o_kvarn.py says why the default).
KVARN_STRATEGIES: dict[str, str] = {
    "requantize": "token-level H2O; damaged tiles are packed again",
    "tile": "whole tiles leave, lowest summed score first",
}
KVARN_SCALE_BYTES = 2  # float16 scales, biases and Sinkhorn factors
# h2o-kvarn's value group (channels per scale at 2 bits): the smallest mx.quantize packs.
# Its kept tokens are the ones attention weighs most; 32 for 64 cut its KL to dense H2O
# 9-13% on three window sets for ~2% more bytes (docs/kvarn_ablation.md).
H2O_KVARN_VALUE_GROUP = 32
# Sinkhorn rounds for the tiles h2o-kvarn re-packs at an eviction (new tiles get the
# full SINKHORN_ITERS): balancing survivors again measured no better (KL 0.0145 vs
# 0.0146, 0.0112 vs 0.0114, 0.0112 vs 0.0115 on three window sets) and was half of
# an eviction's cost (docs/kvarn_ablation.md).
H2O_KVARN_REPACK_SINKHORN_ITERS = 0

DEFAULT_PRESET = "heavy"
DEFAULT_SCORE = "mean"  # docs/performance.md: measured against attn, tova, snap, h2o-ada
DEFAULT_MIXED = "k8v4"
DEFAULT_KVARN = "k4v2"
DEFAULT_MAX_KV = 256
DEFAULT_SINK = 4
DEFAULT_GROUP_SIZE = 64  # quantization group along the head dim
# Packed H2O caches with 4-bit keys keep their newest tokens dense too
# (cache/policies/quantized.py):
# the recent window takes most of the attention, and 4-bit keys there cost most of the
# error (rotated h2o-q4 group 32 vs dense h2o, KL 0.028 -> 0.005 with 16, 0.010 with 8).
DENSE_RECENT_4BIT = 16


def dense_recent_tokens(key_bits: int, recent: int, asked: int | None = None) -> int:
    """Newest tokens a packed H2O cache with `key_bits` keys also holds dense: `asked`
    (None: 16 for 4-bit keys, else none), at most its recent window."""
    if asked is None:
        asked = DENSE_RECENT_4BIT if key_bits == 4 else 0
    return min(asked, recent)


QUANT_GROUP_SIZES = (32, 64, 128)  # what mx.quantize packs
RECALL_ARCHIVE = 4  # h2o-recall: evicted tokens archived per layer and head, x max_kv
RECALL_BITS = 8  # h2o-recall: the archive's K/V width
MIN_RECALL = 16  # h2o-recall: tokens a prompt may bring back, at least (a phrase)
MIN_LAYER_KV = 16  # the least max_kv layer shares give one layer (when max_kv allows)

# For pydantic fields and type hints; built from the tables above.
PolicyName = Literal[tuple(POLICIES)]  # type: ignore[valid-type]
ServePolicyName = Literal[(*POLICIES, AUTO)]  # type: ignore[valid-type]
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
ScoreRuleName = Literal[tuple(SCORE_RULES)]  # type: ignore[valid-type]
KVarNPresetName = Literal[tuple(KVARN_PRESETS)]  # type: ignore[valid-type]


def choose(kind: str, name: str, table: dict) -> str:
    """`name` if `table` has it, else a ValueError listing the choices."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose from {list(table)}")
    return name


@dataclass(frozen=True)
class Segments:
    """How H2O splits max_size: sink + heavy + recent == max_size; sinks and recent always stay."""

    max_size: int
    sink: int
    heavy: int
    recent: int

    def __post_init__(self) -> None:
        if min(self.sink, self.heavy, self.recent) < 0:
            raise ValueError(f"negative H2O segment in {self}")
        if self.recent < 1:
            raise ValueError("the recent window must hold at least the newest token")
        if self.sink + self.heavy + self.recent != self.max_size:
            raise ValueError(
                f"sink ({self.sink}) + heavy ({self.heavy}) + recent ({self.recent}) "
                f"must equal max_kv ({self.max_size})"
            )


def split_segments(
    max_size: int,
    preset: str = DEFAULT_PRESET,
    sink: int | None = None,
    heavy: int | None = None,
    recent: int | None = None,
) -> Segments:
    """Presets: `heavy` (heavy = max/2, recent = max/2 - sink), `balanced` (heavy = max/4),
    `lean` (recent = max/8).

    Explicit sink/heavy/recent override the preset; when only some are given the
    rest of max_size goes to the recent window (or to heavy if recent is given).
    """
    choose("preset", preset, PRESETS)
    if max_size < 2:
        raise ValueError("max_kv must be at least 2")
    if sink is None:
        sink = min(DEFAULT_SINK, max_size // 4)
    if heavy is None and recent is None and preset == "lean":
        recent = max(1, max_size // 8)
    if heavy is None and recent is None:
        heavy = max_size // 2 if preset == "heavy" else max_size // 4
    if heavy is None:
        heavy = max_size - sink - recent
    if recent is None:
        recent = max_size - sink - heavy
    return Segments(max_size=max_size, sink=sink, heavy=heavy, recent=recent)


def h2o_kvarn_tile(max_size: int) -> int:
    """h2o-kvarn's tile: 64 tokens from max_kv 256 up, else 32. A tile's worth leaves at
    a time, so 64-token tiles at max_kv 128 drop half the heavy hitters per eviction
    (+10% perplexity vs dense h2o, +5% with 32); at max_kv 256, 32 re-packs twice as
    often and loses (+2.2% vs +1.9%). docs/kvarn_ablation.md."""
    return 64 if max_size >= 256 else 32


def apportion(total: int, shares: list[float], floor: int) -> list[int]:
    """`total` tokens split over layers in proportion to `shares`, each at least `floor`,
    summing to exactly `total` (largest remainders get the rounding)."""
    n = len(shares)
    if floor * n > total:
        raise ValueError(f"{total} tokens cannot give {n} layers {floor} each")
    ideal = [total * s / sum(shares) for s in shares]
    for _ in range(n):  # layers pinned at the floor give up their share to the others
        pinned = [x <= floor for x in ideal]
        free_total = total - floor * sum(pinned)
        free_shares = sum(s for s, p in zip(shares, pinned, strict=True) if not p)
        ideal = [
            floor if p else free_total * s / free_shares
            for s, p in zip(shares, pinned, strict=True)
        ]
        if all(x >= floor for x in ideal):
            break
    sizes = [int(x) for x in ideal]
    by_remainder = sorted(range(n), key=lambda i: sizes[i] - ideal[i])
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def default_evict_batch(max_size: int, heavy: int) -> int:
    """Tokens evicted at once: 1/16 of the cache, at most the heavy segment (>= 1)."""
    return max(1, min(heavy, max_size // 16))


def default_recall(heavy: int, evict_batch: int) -> int:
    """h2o-recall: tokens a prompt chunk may bring back per head: a quarter of the heavy
    segment, at least MIN_RECALL (a short phrase and its neighbours), at most what
    pinning them leaves room for (cache/policies/recall.py)."""
    return max(0, min(heavy + 1 - evict_batch, max(MIN_RECALL, heavy // 4)))


@dataclass(frozen=True)
class CacheSpec:
    """Everything a conversation's per-layer caches are built from (cache.make_cache).

    Validated on construction, so a spec that exists can be built.
    """

    policy: str = DEFAULT_POLICY
    max_kv: int = DEFAULT_MAX_KV
    preset: str = DEFAULT_PRESET
    score: str = DEFAULT_SCORE
    sink: int | None = None
    heavy: int | None = None
    recent: int | None = None
    evict_batch: int | None = None  # None: default_evict_batch
    mixed: str = DEFAULT_MIXED  # h2o-mixed layout
    group_size: int = DEFAULT_GROUP_SIZE  # quantized policies
    # h2o-q8/h2o-q4/h2o-mixed k8v4: Hadamard-rotate K/V before packing. None: the
    # policy's default (its record's `rotates`: h2o-q4's 4-bit keys).
    rotate: bool | None = None
    # h2o-q8/h2o-q4/h2o-mixed k8v4: newest tokens also kept dense. None: 16 for 4-bit keys
    # (dense_recent_tokens above), none for 8-bit.
    dense_recent: int | None = None
    kvarn: str = DEFAULT_KVARN  # kvarn, h2o-kvarn: KVARN_PRESETS key
    kvarn_strategy: str = "requantize"  # h2o-kvarn: KVARN_STRATEGIES key
    # kvarn: the conversation's layers stay plain dense caches until it would hold more
    # than this many tokens, and are packed then (cache/factory.py pack_dense). 0: packed
    # from the first tile. `auto` sets it to what a session's share holds dense.
    dense_until: int = 0
    # One weight per model layer: layers split layers x max_kv tokens in these proportions
    # (cache/layer_profiles.py measures them); None for a layer that keeps max_kv (a
    # sliding-window layer). None: every layer gets max_kv.
    layer_shares: tuple[float | None, ...] | None = None

    def __post_init__(self) -> None:
        choose("policy", self.policy, POLICIES)
        if self.layer_shares is not None:  # JSON (spill files) brings a list
            object.__setattr__(self, "layer_shares", tuple(self.layer_shares))
        choose("score rule", self.score, SCORE_RULES)
        choose("mixed scheme", self.mixed, MIXED_SCHEMES)
        choose("kvarn preset", self.kvarn, KVARN_PRESETS)
        choose("kvarn strategy", self.kvarn_strategy, KVARN_STRATEGIES)
        if self.dense_until < 0:
            raise ValueError(f"dense_until cannot be negative, got {self.dense_until}")
        if self.dense_until and "dense_until" not in self.info.knobs:
            raise ValueError(f"policy {self.policy} does not start dense (dense_until)")
        if self.dense_recent is not None and self.dense_recent < 0:
            raise ValueError(f"dense_recent cannot be negative, got {self.dense_recent}")
        if self.group_size not in QUANT_GROUP_SIZES:
            raise ValueError(
                f"quantization group size {self.group_size}: choose from {QUANT_GROUP_SIZES}"
            )
        segments = self.segments()  # checks preset and sizes
        if self.evict_batch is not None and not 1 <= self.evict_batch <= max(1, segments.heavy):
            raise ValueError(
                f"evict_batch must be between 1 and the heavy budget ({segments.heavy}), "
                f"got {self.evict_batch}"
            )
        if self.layer_shares is not None:
            if not self.info.layer_budgeted:
                raise ValueError(f"policy {self.policy} cannot give layers their own max_kv")
            if any(x is not None for x in (self.sink, self.heavy, self.recent)):
                raise ValueError(
                    "layer shares and explicit sink/heavy/recent sizes exclude each other"
                )
            if any(s is not None and not s > 0 for s in self.layer_shares):
                raise ValueError(f"layer shares must be positive, got {self.layer_shares}")
            for size in set(self.layer_sizes()):
                self.for_layer(size)  # each layer's size splits into segments

    @property
    def info(self) -> Policy:
        return POLICIES[self.policy]

    def rotates(self) -> bool:
        """Whether packed K/V are Hadamard-rotated: as asked, else the policy's default."""
        return self.info.rotates if self.rotate is None else self.rotate

    def segments(self) -> Segments:
        return split_segments(self.max_kv, self.preset, self.sink, self.heavy, self.recent)

    def layer_sizes(self) -> list[int]:
        """Each layer's max_kv under `layer_shares` (the shared layers' sum is theirs x
        max_kv, so the memory is the same as uniform); [] without shares."""
        if self.layer_shares is None:
            return []
        shared = [s for s in self.layer_shares if s is not None]
        sizes = iter(apportion(len(shared) * self.max_kv, shared, min(MIN_LAYER_KV, self.max_kv)))
        return [self.max_kv if s is None else next(sizes) for s in self.layer_shares]

    def for_layer(self, max_kv: int) -> CacheSpec:
        """This spec at one layer's own max_kv (its segments split by the preset)."""
        return replace(self, max_kv=max_kv, layer_shares=None)

    def replace(self, **changes) -> CacheSpec:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)
