"""The cache contract: what the engine may call on a layer's KV cache.

Every cache a policy builds (config/policies.py) is a `LayerCache`: mlx-lm's protocol
(`_BaseCache`: `update_and_fetch`, `state`, `meta_state`, `offset`, `size`, `nbytes`,
`is_trimmable`/`trim`, `make_mask`, `from_state`) plus what this project asks of a
cache, each with a default:

- building and pricing (`from_spec`, `layer_bytes`, `check_head_dim`), so the factory
  and the budget never branch on a policy;
- tokens seen and stored, how many of the newest it can drop (`trimmable_tokens`);
- what it holds, for the cache view (`contents`);
- what a file cannot hold, taken from a freshly built twin after loading (`adopt`);
- whether it can join an H2O slab, and with whom (`slab_key`);
- how many draft tokens a verify pass may feed it, and giving the refused ones back
  exactly (`draft_room`, `hold_draft`, `settle_draft`: speculative decoding).

A `ScoredCache` is one whose attention goes through the router (cache/router.py): it
hands its K/V to attention as parts (`kv_segments`) and takes each call's scores
(`update_scores`, or `add_scores` block by block then `evict_if_full`; a prompt kernel
updates `scores` itself where `sums_probabilities`); the hooks
`attention_mask`, `logit_bias`, `archive_part` and `observe` default to doing nothing.

The functions at the end take any layer cache, also mlx-lm's own (a model may provide
recurrent state; spills written by older versions hold mlx-lm's KVCache): they are the
one place that knows how such a cache answers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
from mlx_lm.models.cache import RotatingKVCache

from cache.attention import DENSE, KVFormat
from cache.contents import LayerContents, every_token, window_contents

if TYPE_CHECKING:
    from cache.budget import ModelShape
    from config.cache_spec import CacheSpec
    from config.policies import Policy


class LayerCache(mlx_lm_cache._BaseCache):
    """A layer's KV cache as the engine uses it (see the module doc)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # mlx-lm's load_prompt_cache finds a saved cache's class by name in its own module:
        # every class of ours is put there, so none can be forgotten (a spill of it would
        # not load back).
        setattr(mlx_lm_cache, cls.__name__, cls)

    # ------------------------------------------------------------- building, pricing

    # max_kv comes in steps of this many tokens (a cache that allocates in blocks).
    token_step: ClassVar[int] = 1

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None) -> LayerCache:
        """One layer's cache for `spec`; inside a sliding `window` (tokens) when given."""
        raise NotImplementedError(f"{cls.__name__} is not built from a CacheSpec")

    @classmethod
    def layer_bytes(cls, shape: ModelShape, spec: CacheSpec, window: int | None = None) -> float:
        """Bytes of one layer's cache at `spec.max_kv` tokens, as allocated (what `nbytes`
        reports once it holds that many); `window`: built inside that sliding window."""
        raise NotImplementedError(f"{cls.__name__} cannot be priced")

    @classmethod
    def check_head_dim(cls, spec: CacheSpec, head_dim: int) -> None:
        """Raise now, not on the first token, when this cache cannot store `head_dim`."""

    # ------------------------------------------------------------------ what it holds

    @property
    def tokens_seen(self) -> int:
        """Tokens this layer has taken in (its offset, unless RoPE positions were re-indexed)."""
        return self.offset

    def tokens_stored(self) -> int:
        """Tokens it holds per head (fewer than seen once it evicts)."""
        return self.size()

    def trimmable_tokens(self) -> int:
        """How many of the newest tokens `trim` can drop (rewinding a conversation)."""
        return self.offset if self.is_trimmable() else 0

    def contents(self) -> LayerContents | None:
        """Token positions per KV head (and scores), for the cache view."""
        return None

    def adopt(self, fresh: LayerCache) -> None:
        """After loading from a file: take what `fresh` (built by make_cache for the same
        spec) carries that a file cannot hold."""
        if isinstance(self, ScoredCache) and isinstance(fresh, ScoredCache):
            self.scores_with_step = fresh.scores_with_step

    rope = None  # the layer's RoPE module, set where the cache re-indexes (set_context)

    def set_context(self, rope, wall: int, rotated: str = "keys") -> None:
        """The layer's RoPE module and the model's context, for a cache that re-indexes
        positions before the context runs out (config/policies.py `reindexes`). `rotated`:
        what RoPE turned, "keys", or "values" where a layer stores its RoPE part there (MLA:
        keys are the latent, values the RoPE part of the key)."""
        raise NotImplementedError(f"{type(self).__name__} does not re-index positions")

    def slab_key(self) -> Hashable | None:
        """What the members of one H2O slab share, or None when this cache cannot join
        one now (cache/batching/h2o_slab.py)."""
        return None

    # ------------------------------------------------------------ speculative decoding

    # Whether this cache ever takes a draft (its `draft_room` says how many now, from its
    # state, which a slab member lends to its slab): a class's, or its configuration's
    # (a property: packed H2O without a dense tail).
    verifies_drafts: bool = False

    def draft_room(self) -> int:
        """Draft tokens a verify pass may feed beside the decoding token, every one of which
        `settle_draft` can give back exactly as if never fed (server/engine/speculation.py);
        0: this cache decodes a token a pass."""
        return 0

    def hold_draft(self) -> None:
        """The next forward pass feeds a draft: what it would change beyond storing the
        tokens (scores, eviction) waits for `settle_draft`."""

    def settle_draft(self, fed: int, kept: int) -> None:
        """Of the `fed` tokens the held pass stored, the first `kept` stay; the rest go
        (trimmed, where that is all the pass changed)."""
        if fed > kept:
            self.trim(fed - kept)

    def compact(self) -> None:
        """Give up spare room before the cache is written to a file (buffers that grow in
        blocks hold more than their tokens)."""


class ScoredCache(LayerCache):
    """A cache whose attention goes through the router and hands it the scores."""

    scores: mx.array | None = None  # accumulated importance per slot, when it keeps any
    # Its attention may carry learned sink logits (gpt-oss; cache/attention.py with_sinks).
    takes_sinks: ClassVar[bool] = True
    # Whether it takes the scores at all; False: routed only to read its packed storage
    # (kvarn), so a prompt chunk attends through mx.fast where prefill is fused (a GPU).
    keeps_scores: ClassVar[bool] = True
    kv_format: ClassVar[KVFormat] = DENSE
    # Whoever runs the decode step runs the model whole and evaluates `scores` with it (the
    # server's batcher: `step_scores`), so attention does not start them layer by layer,
    # which blocks the host once per layer (cache/attention.py start_scores), and a decode
    # token's store may wait for its attention call (`pending_store`). False: neither.
    scores_with_step: bool = False

    # Whether `attend_decode` serves this decode query (fixed shapes: an H2O slab's rows, a
    # lone H2O cache's full slot buffers); the router takes it where the reference kernel
    # would run.
    fused_decode: bool = False

    def attend_decode(
        self, queries: mx.array, parts: list, scale: float, mask, attend: Callable, how: tuple,
        bias: mx.array | None = None,
    ) -> mx.array:  # fmt: skip
        """A decode query's output over `parts` (`attend(queries, parts, scale, mask, bias)`:
        the router's attention; `how`: its settings; `bias`: its `logit_bias`), its scores
        accumulated and any eviction done, in one compiled call (only where `fused_decode`)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused decode")

    # A decode token whose store `update_and_fetch` left to the step's compiled call
    # (`store_and_attend`), or None: only under a step owner (`scores_with_step`) where the
    # router's compiled decode serves the query (`ScoredAttention.stores_with_decode`).
    # While it waits, what update_and_fetch returned is the buffers before it; attention
    # called otherwise writes it first (`store_pending`).
    pending_store: object | None = None

    def store_and_attend(
        self, queries: mx.array, scale: float, mask, attend: Callable, how: tuple
    ) -> mx.array:
        """`attend_decode` with the pending token written first, in the same compiled call:
        what a GPU kernel that stores, attends and scores does."""
        raise NotImplementedError(f"{type(self).__name__} leaves no store pending")

    def store_pending(self) -> tuple:
        """Write the pending decode token now; what `update_and_fetch` returns with none
        pending (the keys and values it returned while pending are the ones before it)."""
        raise NotImplementedError(f"{type(self).__name__} leaves no store pending")

    def kv_segments(self, keys, values) -> list[tuple[Any, Any, KVFormat]]:
        """What update_and_fetch returned, as (keys, values, format) parts for attention."""
        return [(keys, values, self.kv_format)]

    def update_scores(self, logits: mx.array, probs: mx.array | None = None) -> None:
        """One attention call's logits [B, n_q_heads, L_q, keys] (and the softmax, when the
        kernel had it): accumulate, then evict if over budget."""
        self.add_scores(logits, probs)
        self.evict_if_full()

    def update_weights(self, weights: Callable[[mx.array], mx.array]) -> bool:
        """A decode step's scores from a GPU kernel: `weights(scores)` is `scores` plus each
        key's softmax weight, summed over the query rows of its KV head, from the logits
        just attended (kernels/src/decode_weights.body). Take them and evict, where that is
        exactly this cache's update (its rule sums probabilities; the logits cover its
        slots in order); False leaves the step's logits to `update_scores`."""
        return False

    def add_scores(self, logits: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate the logits of a block of queries without evicting yet."""

    def evict_if_full(self) -> None:
        """Evict down to the budget, if over it."""

    @property
    def sums_probabilities(self) -> bool:
        """Whether a block of queries adds each key's softmax weight, summed over the rows
        and the query heads of its KV head, to `scores` [B, n_kv, slots] (the `attn` rule):
        a prompt kernel can then update `scores` itself, without the block's logits."""
        return False

    def attention_mask(self, n_q_heads: int, n_new: int, mask=None):
        """The mask its attention uses (asked on every call, after `update_and_fetch`): the
        model's, unless its slots need their own."""
        return mask

    def logit_bias(self) -> mx.array | None:
        """An additive logit per stored key [B, n_kv_heads, keys], or None."""
        return None

    def archive_part(self, n_queries: int) -> tuple | None:
        """One more attention part of keys it no longer holds (cache/policies/recall.py), or
        None."""
        return None

    def observe(self, queries: mx.array, scale: float) -> None:
        """Every attention call's queries, before it attends (cache/policies/recall.py)."""


# ---------------------------------------------------------------- any layer cache


def cache_class(policy: Policy, window: bool = False) -> type[LayerCache]:
    """The class a policy's record names (config/policies.py) for a global layer, or with
    `window` for a sliding-window layer (its own window cache, or `in_window`'s)."""
    path = policy.window_policy().window_cache if window else policy.cache
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def is_scored(cache: object) -> bool:
    return isinstance(cache, ScoredCache)


def step_scores(caches: list) -> list[mx.array]:
    """The score arrays a decode step over these layer caches updated: what its owner
    evaluates with the step's tokens when the caches wait for it (`scores_with_step`)."""
    return [c.scores for c in caches if is_scored(c) and c.scores is not None]


def is_state(cache: Any) -> bool:
    """A recurrent state layer (mlx-lm's ArraysCache and kin: linear attention, SSM): fixed
    arrays whatever the length, no per-token K/V, nothing to trim or evict."""
    return isinstance(cache, mlx_lm_cache.ArraysCache)


def tokens_seen(cache: Any) -> int:
    return cache.tokens_seen if isinstance(cache, LayerCache) else cache.offset


def trimmable_tokens(cache: Any) -> int:
    if isinstance(cache, LayerCache):
        return cache.trimmable_tokens()
    return cache.offset if cache.is_trimmable() else 0


UNBOUNDED = 1 << 30  # draft tokens a cache that trims exactly whatever it took may feed


def draft_room(caches: list) -> int:
    """Draft tokens a verify pass over these layers may feed (LayerCache.draft_room;
    mlx-lm's KVCache trims exactly whatever it took, and a recurrent state goes back to
    before the pass, its kept tokens fed again (`settle_draft`): UNBOUNDED)."""
    rooms = [
        c.draft_room() if isinstance(c, LayerCache)
        else UNBOUNDED if type(c) is mlx_lm_cache.KVCache or is_state(c)
        else 0  # mlx-lm's RotatingKVCache: a refused token cannot be taken back once wrapped
        for c in caches
    ]  # fmt: skip
    return min(rooms, default=0)


def hold_draft(caches: list) -> None:
    """The next pass feeds a draft: each layer keeps what it needs to give it back (a
    recurrent state, its arrays before the pass: the layers assign new ones)."""
    for c in caches:
        if isinstance(c, LayerCache):
            c.hold_draft()
        elif is_state(c):
            c.held_draft = list(c.cache)


def settle_draft(caches: list, fed: int, kept: int) -> bool:
    """After a verify pass (`hold_draft` before it): the first `kept` of `fed` stay. A
    recurrent state holds no token apart from the others, so where one refused a token,
    every layer goes back to before the pass and True says: feed the kept tokens again."""
    replay = fed > kept and any(is_state(c) for c in caches)
    if replay:
        kept = 0
    for c in caches:
        if isinstance(c, LayerCache):
            c.settle_draft(fed, kept)
        elif is_state(c):
            held = c.__dict__.pop("held_draft", None)
            if replay and held is not None:
                c.cache = held
        elif fed > kept:  # mlx-lm's KVCache
            c.trim(fed - kept)
    return replay


def compact(cache: Any) -> None:
    """LayerCache.compact for any layer cache (mlx-lm's KVCache read back from an older
    spill grows in blocks of 256 tokens too)."""
    if isinstance(cache, LayerCache):
        cache.compact()
    elif type(cache) is mlx_lm_cache.KVCache:
        trim_spare(cache)


def trim_spare(cache: mlx_lm_cache.KVCache) -> None:
    """A KVCache's buffers cut to the tokens it holds."""
    if cache.keys is not None and cache.offset < cache.keys.shape[2]:
        cache.keys = cache.keys[..., : cache.offset, :]
        cache.values = cache.values[..., : cache.offset, :]


def holds_tokens(cache: Any) -> bool:
    """Whether it is a KV cache (recurrent state holds no token positions)."""
    return isinstance(cache, LayerCache | mlx_lm_cache.KVCache | RotatingKVCache)


def layer_contents(cache: Any) -> LayerContents | None:
    """What a layer's cache holds, or None for state that holds no token positions."""
    if isinstance(cache, LayerCache):
        return cache.contents()
    if isinstance(cache, RotatingKVCache):
        return window_contents(cache)
    if isinstance(cache, mlx_lm_cache.KVCache):
        return every_token(cache.offset, 0 if cache.keys is None else cache.keys.shape[1])
    return None
