"""One record per cache policy: everything the rest of the project asks of a policy.

Standard library only (the HTTP layer reads it before MLX is loaded). Each record names
its cache class by import path; the class builds a layer from a CacheSpec
(`from_spec`), prices one (`layer_bytes`) and speaks the cache contract
(cache/contract.py). The factory, the budget, the slab, the batcher, the cache view, the
CLI and the API's enums read these records, so a new policy is a record here plus its
class, and tests/test_policies.py walks every record through build, price, spill and
restore, batching and the cache view.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    name: str
    help: str
    # "module:Class" of a global-attention layer's cache; the class's `from_spec` builds it
    # and its `layer_bytes` prices it.
    cache: str
    bounded: bool  # holds at most max_kv tokens per layer
    scored: bool  # its attention goes through the router, which hands it the scores
    # "module:Class" of its cache inside a sliding window larger than max_kv (built with
    # the window); None: it has none, and `in_window` names the policy whose serves.
    window_cache: str | None = None
    key_bits: int | None = None  # packed K/V widths; None: dense, in the model's dtype
    value_bits: int | None = None
    # Re-indexes RoPE positions near the context (cache/policies/h2o.py): a conversation may
    # outgrow the model's context, one prompt at a time.
    reindexes: bool = False
    # Decodes with other sessions of its configuration in one slab (cache/batching/h2o_slab.py,
    # cache/batching/kvarn_slab.py, cache/batching/kvarn_padded.py; the caches' `slab_key` says
    # with whom,
    # or that a layout cannot).
    slab: bool = False
    # Each layer may get its own max_kv (CacheSpec.layer_shares, cache/layer_profiles.py).
    layer_budgeted: bool = False
    # Packed K/V Hadamard-rotated unless the spec says otherwise (CacheSpec.rotate).
    rotates: bool = False
    # The policy whose window cache a sliding-window layer gets when this one has none;
    # the server warns at start-up when a model has such layers. None: its own.
    in_window: Policy | None = None
    # CacheSpec fields it reads besides the H2O segments (shown with a session's figures).
    knobs: tuple[str, ...] = ()
    # Holds K and V of different widths (an MLA latent and its RoPE part). Packed
    # storage packs both at one width; h2o-recall's archive concatenates them as one.
    split_widths: bool = True

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    def __post_init__(self) -> None:
        if self.bounded and (self.window_cache is None) == (self.in_window is None):
            raise ValueError(f"{self.name}: name a window cache or the policy serving one")

    def window_policy(self) -> Policy:
        """The policy whose window cache serves this one's sliding-window layers."""
        return self.in_window or self


# Unbounded policies never get a window cache: a sliding-window layer keeps its window.
FULL = Policy(
    "full", "mlx-lm KVCache: keeps every token", "cache.policies.full:FullKVCache",
    bounded=False, scored=False,
)  # fmt: skip
# Inside a sliding window: max_kv tokens, no sinks (cache/policies/rotating.py).
ROTATING = Policy(
    "rotating", "sliding window of max_kv tokens with `sink` kept tokens",
    "cache.policies.rotating:SinkRotatingKVCache", bounded=True, scored=False,
    window_cache="cache.policies.rotating:SinkRotatingKVCache",
)  # fmt: skip
H2O = Policy(
    "h2o", "H2O: sinks + heavy hitters + recent window", "cache.policies.h2o:H2OKVCache",
    bounded=True, scored=True, window_cache="cache.policies.windowed:WindowedH2OKVCache",
    reindexes=True, slab=True, layer_budgeted=True,
)  # fmt: skip
_PACKED_KNOBS = ("group_size", "rotate", "dense_recent")
_PACKED_IN_WINDOW = "cache.policies.windowed:WindowedQuantizedH2OKVCache"
H2O_Q8 = Policy(
    "h2o-q8", "H2O over 8-bit K/V", "cache.policies.quantized:QuantizedH2OKVCache",
    bounded=True, scored=True, window_cache=_PACKED_IN_WINDOW, key_bits=8, value_bits=8,
    reindexes=True, slab=True, layer_budgeted=True, knobs=_PACKED_KNOBS,
)  # fmt: skip
# 4-bit keys rotate: at the same bytes rotated h2o-q4 is +3.6% perplexity vs dense H2O,
# unrotated +7.2% (docs/quantized.md).
H2O_Q4 = Policy(
    "h2o-q4", "H2O over 4-bit K/V", "cache.policies.quantized:QuantizedH2OKVCache",
    bounded=True, scored=True, window_cache=_PACKED_IN_WINDOW, key_bits=4, value_bits=4,
    reindexes=True, slab=True, layer_budgeted=True, rotates=True, knobs=_PACKED_KNOBS,
)  # fmt: skip
# Widths of its default layout (MIXED_SCHEMES in config/cache_spec.py: k8v4, which
# batches in a slab; the segmented layouts do not).
H2O_MIXED = Policy(
    "h2o-mixed", "H2O, keys 8-bit and values 4-bit", "cache.policies.mixed:MixedH2OKVCache",
    bounded=True, scored=True, window_cache="cache.policies.windowed:WindowedMixedH2OKVCache",
    key_bits=8, value_bits=4, slab=True, layer_budgeted=True,
    knobs=("mixed", *_PACKED_KNOBS),
)  # fmt: skip
# The next three have no twin inside a sliding window (a window drops what leaves it, so
# there is nothing to merge, recall or pool): their sliding layers hold plain H2O.
H2O_MERGE = Policy(
    "h2o-merge", "H2O that merges each evicted token into its most similar kept one",
    "cache.policies.merging:MergingH2OKVCache", bounded=True, scored=True, reindexes=True,
    layer_budgeted=True, in_window=H2O,
)  # fmt: skip
H2O_RECALL = Policy(
    "h2o-recall",
    "H2O that archives evicted tokens (8-bit) and brings back what a new prompt asks for",
    "cache.policies.recall:RecallH2OKVCache", bounded=True, scored=True, layer_budgeted=True,
    in_window=H2O, knobs=("group_size",), split_widths=False,
)  # fmt: skip
H2O_ADA = Policy(
    "h2o-ada", "H2O with one pool per layer: heads share the middle slots (AdaKV)",
    "cache.policies.adaptive:AdaptiveH2OKVCache", bounded=True, scored=True, layer_budgeted=True,
    in_window=H2O,
)  # fmt: skip
# KVarN (cache/policies/kvarn.py, cache/policies/h2o_kvarn.py): widths of the default preset
# (k4v2); `kvarn`
# picks another from KVARN_PRESETS. Scored: no eviction, but its packed tiles are read
# through the router.
KVARN = Policy(
    "kvarn", "KVarN: every token kept, Hadamard-rotated, Sinkhorn-balanced 128-token tiles",
    "cache.policies.kvarn:KVarNCache", bounded=False, scored=True, key_bits=4, value_bits=2,
    slab=True, knobs=("kvarn", "dense_until"),
)  # fmt: skip
# Its packed tiles fix the sizes a layer can hold (no per-layer max_kv), and no KVarN
# cache exists inside a sliding window yet: such layers get a dense max_kv window.
H2O_KVARN = Policy(
    "h2o-kvarn", "H2O eviction over KVarN storage (64-token tiles)",
    "cache.policies.h2o_kvarn:H2OKVarNCache", bounded=True, scored=True, key_bits=4, value_bits=2,
    in_window=ROTATING, slab=True, knobs=("kvarn", "kvarn_strategy"),
)  # fmt: skip

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        FULL, ROTATING, H2O, H2O_Q8, H2O_Q4, H2O_MIXED, H2O_MERGE, H2O_RECALL, H2O_ADA,
        KVARN, H2O_KVARN,
    )
}  # fmt: skip

DEFAULT_POLICY = H2O.name
AUTO = "auto"  # serve only: pick from the budget (cache/budget.py auto_policy)
# What `auto` tries, in order: the whole context dense, then packed (nothing forgotten,
# within ~0.5% of full), then 8-bit H2O: at equal bytes it holds 3.3x dense H2O's
# tokens at no measurable loss per token (docs/equal_bytes.md).
AUTO_ORDER = (FULL, KVARN, H2O_Q8)
# The policies `calibrate` measures layer profiles for by default.
CALIBRATED = (H2O, H2O_MERGE)
# What the cache view calls a layer: evicting by score, keeping every token (dense or
# KVarN-packed), or a sliding window (cache/contents.py).
VIEW_KINDS = (H2O.name, KVARN.name, FULL.name, ROTATING.name)
