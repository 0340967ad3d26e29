"""H2OKVCache: a per-layer KV cache bounded by heavy-hitter eviction.

It speaks the cache contract (cache/contract.py: mlx-lm's protocol plus building,
pricing, contents and slab hooks) as a ScoredCache: the attention router hands
`update_scores` each attention call's logits. Which tokens leave is the H2O rule
every evicting cache shares (cache/scores/heavy_hitters.py); this class stores them.

Layout: slots [0, size) of preallocated buffers hold one token each, per KV
head (heads keep different tokens). `positions` records each slot's token
index, which is all eviction needs; attention itself is order-free because
keys carry RoPE already. `seen` counts every token ever seen and never drops;
the physical length `size()` does. `offset` (what the model gives RoPE) equals
`seen` until the conversation nears the model's context (`wall`): then the held
keys are re-rotated to positions 0..n-1 in token order (StreamingLLM's
re-indexing, llama.cpp's context shift), so no query is ever further from a key
than the model was trained on; `offset` then runs `shift` behind `seen`.

Eviction runs after scoring, when the cache holds more than max_size tokens.
It drops the lowest-scored middle tokens (neither sink nor recent) per head,
down to max_size + 1 - evict_batch, with one argpartition and one gather into
buffers of max_size + 1 slots. A decode's eviction (the buffers at that final
size, its shapes the same every time) is one compiled call and moves only what
must move: the kept tokens among the newest slots fill the slots the leavers
left (`_fill_holes`), so slots are not in position order. The next
evict_batch - 1 decode steps only append (two slice writes, like mlx-lm's
KVCache), so an eviction is amortized; evict_batch=1 is H2O evicting one token
per step. Free slots always hold
score 0 and the position the next appended token will have, so appending
writes keys and values only.

Subclasses change how K/V are stored (cache/policies/quantized.py) by overriding the
`encode`/`_fetch`/`_grow_kv`/`_gather_kv`/`_kv_state`/`_kv_loaded` hooks; buffers may be
lists of arrays (mx.quantize's packed weights, scales, biases), every one
with the sequence on axis 2, so scoring and eviction never look inside them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_causal_mask

from cache.attention import ATTENTION
from cache.budget import H2O_BOOKKEEPING
from cache.compiled_decode import (
    attended_and_scored,
    compiled_on_template,
    scatter_write,
    scored,
    stored_attended_and_scored,
)
from cache.contents import LayerContents, scored_contents
from cache.contract import LayerCache, ScoredCache
from cache.scores import ScoreRule
from cache.scores.heavy_hitters import HeavyHitters, segment_knobs
from config.cache_spec import DEFAULT_SCORE, CacheSpec

if TYPE_CHECKING:
    from cache.budget import ModelShape


SLOT_BUFFERS = ("keys", "values", "scores", "positions")  # every one along the slot axis


class ScoresMissing(RuntimeError):
    """An H2O cache was fed tokens, but its layer's attention never reported scores."""


class H2OKVCache(HeavyHitters, ScoredCache):
    step = 256

    def __init__(
        self,
        max_size: int,
        sink: int | None = None,
        heavy: int | None = None,
        recent: int | None = None,
        score: str | ScoreRule = DEFAULT_SCORE,
        evict_batch: int | None = None,
    ):
        self.set_rule(max_size, sink, heavy, recent, score, evict_batch)
        self.keys = self.values = None  # [B, H, capacity, D] (or a list of such buffers)
        self.scores = None  # float32 [B, H, capacity]: accumulated importance
        self.positions = None  # int32 [B, H, capacity]: token index held by each slot
        self.lags = None  # int32 [B, H, capacity]: token index - RoPE position (once re-indexed)
        self.seen = self.shift = 0
        self.used = 0  # slots in use

    # ------------------------------------------------------------ building, pricing

    @classmethod
    def from_spec(cls, spec: CacheSpec, window: int | None = None) -> H2OKVCache:
        """A layer of max_kv tokens (the windowed twins, cache/policies/windowed.py, take
        `window`)."""
        if window is not None:
            raise ValueError(
                f"{cls.__name__} is no sliding-window cache (cache/policies/windowed.py)"
            )
        return cls(spec.max_kv, **segment_knobs(spec), **cls.spec_knobs(spec))

    @classmethod
    def spec_knobs(cls, spec: CacheSpec) -> dict:
        """Constructor knobs of this class, beyond the H2O rule's, from a spec."""
        return {}

    @classmethod
    def layer_bytes(cls, shape: ModelShape, spec: CacheSpec, window: int | None = None) -> float:
        """max_kv + 1 slots (the newest token waits in a spare one until the eviction) of
        K/V, a float32 score and an int32 position, per KV head; plus `extra_bytes`."""
        per_slot = cls.slot_bytes(shape, spec) + H2O_BOOKKEEPING + cls.slot_extra_bytes
        return (spec.max_kv + 1) * shape.kv_heads * per_slot + cls.extra_bytes(shape, spec, window)

    @classmethod
    def slot_bytes(cls, shape: ModelShape, spec: CacheSpec) -> float:
        """K and V of one token in one KV head, as stored."""
        return shape.dense_token_bytes

    slot_extra_bytes = 0  # per slot and KV head, beside K/V, score and position

    @classmethod
    def extra_bytes(cls, shape: ModelShape, spec: CacheSpec, window: int | None) -> float:
        """What a layer holds besides its slots."""
        return 0

    # ------------------------------------------------------------------ the contract

    @property
    def tokens_seen(self) -> int:
        return self.seen

    def contents(self) -> LayerContents:
        return scored_contents(self, self.size())

    def adopt(self, fresh: LayerCache) -> None:
        """RoPE and the context wall: make_cache attaches them, a file cannot hold them."""
        super().adopt(fresh)
        self.wall, self.rope, self.rotated = fresh.wall, fresh.rope, fresh.rotated

    def set_context(self, rope, wall: int, rotated: str = "keys") -> None:
        if rotated not in ("keys", "values"):
            raise ValueError(f"rotated: keys or values, not {rotated!r}")
        self.rope, self.wall, self.rotated = rope, wall, rotated

    def slab_key(self) -> Hashable | None:
        """Dense and packed (cache/policies/quantized.py) H2O caches can join a slab once filled,
        never re-indexed; other layouts (subclasses) cannot."""
        return self._config_key() if self.slab_rows else None

    def eviction_key(self) -> Hashable | None:
        """The compiled eviction this cache shares (`_compiled_eviction`), or None where
        it evicts op by op (a layout that has not opted in, a re-indexed cache)."""
        return self._config_key() if self.compiles_eviction else None

    def _config_key(self) -> Hashable | None:
        """Its class, configuration and buffer shapes; None before its buffers exist or
        once re-indexed (its lags shift on eviction too)."""
        if self.positions is None or self.lags is not None:
            return None
        stored = (self.keys, self.values)
        shapes = tuple((a.dtype, a.shape[1], a.shape[3:]) for _, a in tree_flatten(stored))
        config = (self.max_size, self.sink, self.heavy, self.recent, self.evict_batch)
        return (type(self).__name__, *config, self.score_rule, self.slab_layout(), shapes)

    # Whether its slots are all it stores per token (nothing else that moves): an H2OSlab
    # can hold its rows (cache/batching/h2o_slab.py).
    slab_rows: bool = True
    # Whether a decode step, the buffers at their final size, reads every slot under a
    # mask (`fused_decode`): slots one per token and KV head, and anything else kept per
    # slot (merging's counts) read the same way.
    fixed_decode: bool = True
    # Whether a decode's eviction, at the buffers' final size, runs as one compiled call
    # of `_evict_ops` over `eviction_buffers` (a layout that keeps more per slot lists it).
    compiles_eviction: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Each class opts in: a subclass may store or move what the slab does not know.
        cls.slab_rows = cls.__dict__.get("slab_rows", False)
        cls.compiles_eviction = cls.__dict__.get("compiles_eviction", cls.slab_rows)
        cls.fixed_decode = cls.__dict__.get("fixed_decode", cls.slab_rows)
        cls.verifies_drafts = cls.__dict__.get("verifies_drafts", False)

    # A verify pass's draft can be held and settled (`hold_draft`): a layout whose newest
    # tokens sit in its newest slots as fed, nothing else moving (dense H2O).
    verifies_drafts = True
    # A draft's pass under verification: its scores wait here, and nothing is evicted,
    # until `settle_draft` says how many of its tokens stay (server/engine/speculation.py).
    held: list | None = None

    def eviction_buffers(self) -> tuple[str, ...]:
        """What a compiled eviction takes and gives back: the slot buffers."""
        return SLOT_BUFFERS

    def slab_layout(self) -> tuple:
        """What else than the slots a slab row of this cache holds, in its key."""
        return ()

    def pack_pending(self) -> None:
        """Write what waits to be stored (packed caches defer their newest tokens)."""

    def slab_buffers(self) -> tuple[str, ...]:
        """The attributes a slab stacks per row: the slot buffers (keys, values, scores,
        positions: the slot axis 2), then any fixed per-row arrays."""
        return SLOT_BUFFERS

    # Context shift: make_cache sets both (set_context) for policies whose storage can
    # re-rotate keys (config/policies.py `reindexes`: dense, packed and merging H2O).
    wall: int | None = None  # RoPE positions stay below this (the model's context)
    rope = None  # the layer's RoPE module: rope(x, offset=...)
    rotated = "keys"  # the buffer RoPE turned: "values" for MLA (the RoPE part of its keys)

    @property
    def offset(self) -> int:
        """The next token's RoPE position (mlx-lm's models read it): `seen` - `shift`."""
        return self.seen - self.shift

    @offset.setter
    def offset(self, value: int) -> None:
        self.seen = value + self.shift

    # ------------------------------------------------------------ speculative decoding

    def draft_room(self) -> int:
        """As many draft tokens as fit before the next eviction, so that none is evicted
        on the strength of a draft token refused after; none near the context wall (a
        re-index mid-draft) or once re-indexed."""
        if not self.verifies_drafts or self.positions is None or self.lags is not None:
            return 0
        room = (self.slot_budget - self.used) // self._slots_per_token
        if self.rope is not None:
            room = min(room, self.reindex_from - self.offset - 1)
        return max(0, room)

    def hold_draft(self) -> None:
        self.held = []

    def settle_draft(self, fed: int, kept: int) -> None:
        """Drop the refused tokens (the newest slots: nothing was evicted since they were
        stored), then take the kept tokens' query rows of the held scores, over the keys
        they saw, and evict as `kept` decode steps would have."""
        held, self.held = self.held, None
        slots = self._keep_drafted(fed, kept)
        for logits, probs in held or []:
            self.add_scores(
                *(None if x is None else x[:, :, :kept, slots] for x in (logits, probs))
            )
        self.evict_if_full()

    def _keep_drafted(self, fed: int, kept: int) -> slice | mx.array:
        """Give back the slots of the refused tokens (the newest); the slots the verify
        pass's logits cover that stay, in their new order."""
        if fed > kept:
            self.used -= (fed - kept) * self._slots_per_token
            self.offset -= fed - kept
            self.reset_free_slots()
        return slice(0, self.used)

    # ------------------------------------------------------------------ protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store N new tokens (post-RoPE keys) and return every stored key/value."""
        self._check_scored()
        n_new = keys.shape[2]
        end = self.used + n_new
        keys, values = self.encode(keys, values)
        if self.positions is None or end > self.positions.shape[-1]:
            self._grow(keys, values, end)
        # Free slots already hold score 0 and these tokens' positions.
        self._write_slots(keys, values, self.used, end)
        self.used = end
        self.offset += n_new
        self.fused_decode = self._every_slot(n_new)
        return self._fetch()

    def update_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate one attention call's logits [B, n_q_heads, L_q, size], then evict.

        `probs`: the softmax the attention used, when it has it (saves rules a second one).
        After a decode that read every slot (`fused_decode`), the logits may cover those
        keys (the attention's own) or the held ones only (a caller scoring by hand).
        """
        every_slot, self.fused_decode = self.fused_decode, False  # the step ends here
        if every_slot and scores.shape[-1] != self.used:  # over every slot (and the tail)
            rule, n_kv = self.score_rule, self.positions.shape[1]
            tail, front = self._tail(), self._front()
            self.scores = scored(rule, n_kv, self.scores, [], scores, probs, tail, front)
            self.evict_if_full()
            return
        if scores.shape[-1] != self.used:
            raise ValueError(
                f"scores cover {scores.shape[-1]} keys but the cache holds {self.used}"
            )
        self.add_scores(scores, probs)
        self.evict_if_full()

    def attend_decode(
        self, queries: mx.array, parts: list, scale: float, mask, attend: Callable, how: tuple,
        bias: mx.array | None = None,
    ) -> mx.array:  # fmt: skip
        """Attention over every slot (the free ones masked) and the score update in one
        compiled call (cache/compiled_decode.py), then any eviction."""
        rule, n_kv = self.score_rule, self.positions.shape[1]
        out, self.scores = attended_and_scored(
            queries, parts, scale, mask, attend, how, rule, n_kv, self.scores, [], self._tail(),
            self._front(), bias,
        )  # fmt: skip
        self.fused_decode = False  # the step ends here: readers get the held slots again
        self.evict_if_full()
        return out

    def store_and_attend(
        self, queries: mx.array, scale: float, mask, attend: Callable, how: tuple
    ) -> mx.array:
        """`attend_decode` with the pending token's store first, in the same compiled call."""
        store, names, new = self.pending_store
        self.pending_store = None
        mask = self.attention_mask(queries.shape[1], 1, mask)
        parts = self.kv_segments(*self._fetch())  # what the store rewrites, read as written
        rule, n_kv = self.score_rule, self.positions.shape[1]
        stored = [getattr(self, name) for name in names]
        out, self.scores, written = stored_attended_and_scored(
            store, stored, new, queries, parts, scale, mask, attend, how, rule, n_kv,
            self.scores, [], self._tail(), self._front(),
        )  # fmt: skip
        self.__dict__.update(zip(names, written, strict=True))
        self.fused_decode = False  # the step ends here: readers get the held slots again
        self.evict_if_full()
        return out

    def store_pending(self) -> tuple:
        self._write_pending()
        return self._fetch()

    def _store(self, store: Callable, names: tuple[str, ...], new: list, now: bool) -> None:
        """`store(*buffers named, *new)` writes the named buffers: now, or left to the
        step's attention call where it joins one (`ATTENTION.stores_with_decode`)."""
        self.pending_store = (store, names, new)
        if now or not ATTENTION.stores_with_decode(self):
            self._write_pending()

    def _write_pending(self) -> None:
        store, names, new = self.pending_store
        self.pending_store = None
        written = store(*(getattr(self, name) for name in names), *new)
        self.__dict__.update(zip(names, written, strict=True))

    def update_weights(self, weights: Callable[[mx.array], mx.array]) -> bool:
        """Its slots one per token and KV head (`fixed_decode` layouts), the logits in slot
        order unless a decode that read every slot moves pools' logits (`_front`, `_tail`)."""
        every_slot = self.fused_decode and (self._front() or self._tail())
        if (
            not (self.fixed_decode and self.sums_probabilities)
            or every_slot
            or self.held is not None
        ):
            return False
        self.fused_decode = False  # the step ends here
        self.scores = weights(self.scores)
        self.evict_if_full()
        return True

    def add_scores(self, scores: mx.array, probs: mx.array | None = None) -> None:
        """Accumulate logits of some query rows (in order) without evicting yet.

        They may cover the first n slots only: the keys a block of a prompt chunk
        can see (slots of one chunk are stored in order).
        """
        if self.held is not None:  # a draft's: kept apart until settled
            self.held.append((scores, probs))
            return
        n = scores.shape[-1]
        if n > self.used:
            raise ValueError(f"scores cover {n} keys but the cache holds {self.used}")
        full = n == self.scores.shape[-1]
        held = self.scores if full else self.scores[..., :n]
        updated = self.score_rule.accumulate(held, scores, self.positions.shape[1], probs)
        if full:
            self.scores = updated
        else:
            self.scores[..., :n] = updated

    @property
    def sums_probabilities(self) -> bool:
        return self.score_rule.sums_probabilities

    def evict_if_full(self) -> None:
        """Evict down to max_kv; then re-index if RoPE positions near the wall."""
        if self.held is not None:  # a draft's pass: settle_draft evicts
            return
        if self.used > self.slot_budget:
            self._evict()
        # Re-indexing must win back at least an eighth of the context to be worth its work.
        near = self.rope is not None and self.offset >= self.reindex_from
        if near and self.offset - self.size() >= self.wall // 8:
            self.reindex()

    @property
    def reindex_from(self) -> int:
        """The RoPE offset from which it re-indexes: a quarter of the context is left for
        the next chunk (the server's is 512 tokens)."""
        return self.wall - self.wall // 4

    def reindex(self) -> None:
        """Re-rotate the held keys to RoPE positions 0..n-1 in token order (every head holds
        n); the next token gets position n. Attention between held tokens keeps their order
        but not their distances: what StreamingLLM does past the window, measured better
        than the original positions beyond the context (docs/context_wall.md)."""
        n = self.used
        pos = self.positions[..., :n]
        rank = mx.argsort(mx.argsort(pos, axis=-1), axis=-1).astype(mx.int32)
        rope_pos = pos if self.lags is None else pos - self.lags[..., :n]
        self._rerope_keys(rank - rope_pos)
        if self.lags is None:
            self.lags = mx.zeros(self.positions.shape, dtype=mx.int32)
        self.lags[..., :n] = pos - rank
        self.shift = self.seen - n
        self.reset_free_slots()

    # ------------------------------------------------------------ fixed-shape decode

    def _every_slot(self, n_new: int) -> bool:
        """One decode token into buffers at their final size (max_kv + 1 slots): attend all
        of them, the free ones masked, so that the step's shapes (and the compiled graph of
        its attention and score update: `fused_decode`) repeat every step. Shorter buffers
        grow; a prompt reads what it holds."""
        if n_new != 1 or not self.fixed_decode or self.positions is None:
            return False
        return self.positions.shape[-1] == self.slot_budget + self._slots_per_token

    def attention_mask(self, n_q_heads: int, n_new: int, mask=None):
        """With every slot attended: the held ones (`_slots_of_keys` below `_slots_served`)."""
        if not self.fused_decode:
            return mask
        visible = self._visible_slots()
        if isinstance(mask, mx.array):  # a model's own (a str is causal: nothing for one query)
            return visible & mask if mask.dtype == mx.bool_ else mx.where(visible, mask, -mx.inf)
        return visible

    def _visible_slots(self) -> mx.array:
        """bool [1, 1, 1, keys]: `_slots_of_keys` below `_slots_served`, kept per buffer size
        and count served: the step that first uses one evaluates it, and from then on it
        adds no op to a step (the comparison was one op per layer and step). Between
        evictions a decode's count cycles through evict_batch + 1 values."""
        n, served = self.positions.shape[-1], self._slots_served()
        if self._visible_of is None or self._visible_of[0] != n:
            ids = self._slots_of_keys(n).reshape(1, 1, 1, -1)
            self._visible_of = (n, ids, {})
        _, ids, masks = self._visible_of
        if served not in masks:
            if len(masks) >= _VISIBLE_MEMO:  # counts off the decode cycle (trims): start over
                masks.clear()
            masks[served] = ids < served
        return masks[served]

    _visible_of = None  # (slots, their `_slots_of_keys`, {count served: visible mask})

    def _slots_of_keys(self, slots: int) -> mx.array:
        """The slot of each key attention reads from buffers of `slots` slots: every slot."""
        return mx.arange(slots, dtype=mx.int32)

    def _slots_served(self) -> int:
        """Keys whose `_slots_of_keys` is below this are visible: the held slots."""
        return self.used

    def _tail(self) -> list:
        """[the slot each dense tail token fills] (cache/compiled_decode.py), or []."""
        return []

    def _front(self) -> int:
        """Dense keys read before every slot, whose copies in slots [0, front) are masked
        (cache/compiled_decode.py): none here."""
        return 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for N new tokens: every stored key visible, the new keys causal.

        Built from the physical length, which is the same in every H2O layer.
        """
        if window_size is not None:
            # A window mask depends on positions, which differ per layer and head
            # after eviction, while mlx-lm shares one mask across layers.
            raise ValueError("H2OKVCache cannot serve a sliding-window attention layer")
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self.size())
        return "causal"

    def size(self) -> int:
        """Tokens physically stored (per head; on average when heads hold different counts)."""
        return self.used // self._slots_per_token

    def empty(self) -> bool:
        return self.positions is None

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held: keys, values, scores and positions, spare slots included."""
        if self.positions is None:
            return 0
        held = (self.keys, self.values, self.scores, self.positions)
        return sum(a.nbytes for _, a in tree_flatten(held) if a is not None)

    def is_trimmable(self) -> bool:
        return self.trimmable_tokens() > 0

    def trimmable_tokens(self) -> int:
        """How many of the newest tokens every head still holds, all of them: trim's limit.

        Everything after the last eviction is held, and so is the recent window that
        eviction protected (and any heavy hitters right before it); trimming past the
        newest evicted token would need a token the cache no longer has.
        """
        if self.positions is None:
            return 0
        n = self.used
        held = mx.sort(self.positions[..., :n], axis=-1)
        # Sorted positions end at seen - 1; they are contiguous over a suffix only.
        in_order = held == mx.arange(self.seen - n, self.seen, dtype=held.dtype)
        return int(in_order.sum(axis=-1).min().item())

    def trim(self, n: int) -> int:
        """Drop the n newest tokens, never past an evicted one; return how many."""
        n = max(0, min(n, self.trimmable_tokens()))
        if n == 0:
            return 0
        keep = self.positions[..., : self.used] < self.seen - n
        slots = mx.arange(self.used)
        # Kept slots first, in slot order: every head keeps the same count.
        order = mx.sort(mx.where(keep, slots, self.used + slots), axis=-1)
        self.offset -= n
        dropped = n * self._slots_per_token
        self._gather(order[..., : self.used - dropped], capacity=self.positions.shape[-1])
        return n

    @property
    def state(self):
        if self.positions is None:
            return None, None, None, None, self.meta_state[0]
        n = self.used
        positions = self.positions[..., :n]
        if self.lags is not None:  # re-indexed: the lags travel with the positions
            positions = mx.stack([positions, self.lags[..., :n]])
        return (*self._kv_state(), self.scores[..., :n], positions, self.meta_state[0])

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.scores, self.positions, meta = v
        self.lags = None
        if self.positions is not None and self.positions.ndim == 4:
            self.positions, self.lags = self.positions[0], self.positions[1]
        self.meta_state = (meta,)
        self.used = 0 if self.positions is None else self.positions.shape[-1]
        self._kv_loaded()

    def _kv_loaded(self) -> None:
        """After a state is loaded: rebuild what `_kv_state` flattened into the K/V (a hook)."""

    @property
    def meta_state(self) -> tuple[str]:
        meta = {
            **self.rule_meta(),
            "offset": self.seen,  # tokens seen; RoPE's offset is seen - shift
            "shift": self.shift,
        }
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        meta = json.loads(v[0])
        self.load_rule_meta(meta)
        self.seen = meta["offset"]
        self.shift = meta.get("shift", 0)  # wall and rope: make_cache or adopt

    # ------------------------------------------------------------ K/V storage hooks

    def _write_slots(self, keys, values, start: int, end: int) -> None:
        """Encoded K/V (`encode`'s form) into slots [start, end) of every buffer."""
        if isinstance(keys, mx.array):  # dense: no tree walk, once per layer and step
            self.keys[:, :, start:end] = keys
            self.values[:, :, start:end] = values
            return
        if isinstance(keys[0], mx.array):  # mx.quantize's parts: a walk of the tree costs
            stored, fresh = (*self.keys, *self.values), (*keys, *values)  # ~1 ms per step
        else:
            stored = [a for _, a in tree_flatten((self.keys, self.values))]
            fresh = [a for _, a in tree_flatten((keys, values))]
        for buf, new in zip(stored, fresh, strict=True):
            buf[:, :, start:end] = new

    def encode(self, keys: mx.array, values: mx.array):
        """New tokens in the form the buffers store (dense: as they come)."""
        return keys, values

    def _fetch(self):
        """What attention reads: every stored key/value, spare slots cut off."""
        n = self.used
        if n == self.positions.shape[-1] or self.fused_decode:  # every slot, free ones masked
            return self.keys, self.values
        if isinstance(self.keys, mx.array):
            return self.keys[:, :, :n], self.values[:, :, :n]
        return tree_map(lambda a: a[:, :, :n], (self.keys, self.values))

    def _kv_state(self) -> tuple:
        return tree_map(lambda a: a[:, :, : self.used], (self.keys, self.values))

    def _grow_kv(self, keys, values, capacity: int) -> None:
        """Reallocate the K/V buffers to `capacity` slots (keys/values: encoded new tokens)."""

        def grown(new: mx.array, buf: mx.array | None) -> mx.array:
            return self._grown(buf, new.shape[:2], new.shape[3:], new.dtype, capacity)

        self.keys = tree_map(grown, keys, self.keys)
        self.values = tree_map(grown, values, self.values)

    def _rerope_keys(self, delta: mx.array) -> None:
        """Rotate each held key [B, H, n] by `delta` positions (RoPE composes by adding):
        the keys, or the values where they hold the keys' RoPE part (MLA)."""
        n = self.used
        if self.rotated == "values":
            self.values[:, :, :n] = turn_keys(self.rope, self.values[:, :, :n], delta)
        else:
            self.keys[:, :, :n] = turn_keys(self.rope, self.keys[:, :, :n], delta)

    def _gather_kv(self, idx: mx.array, capacity: int) -> None:
        """K/V of slots `idx` [B, H, K] into `capacity` slots."""
        self.keys, self.values = tree_map(
            lambda buf: gather_slots(buf[:, :, : self.used], idx[..., None], capacity),
            (self.keys, self.values),
        )

    # ------------------------------------------------------------------ internals

    # Slots one token takes along the slot axis: one here (a slot row per KV head);
    # a layout whose heads share one slot axis (cache/policies/adaptive.py) takes one per head.
    _slots_per_token = 1

    @property
    def slot_budget(self) -> int:
        """Slots in use past which eviction runs."""
        return self.max_size * self._slots_per_token

    def _check_scored(self) -> None:
        """Eviction runs when scores arrive; a cache past max_size never got them."""
        if self.used > self.slot_budget:
            raise ScoresMissing(
                f"this H2O cache holds {self.used} tokens (max_kv {self.max_size}): its layer's "
                "attention did not pass scores to update_scores, so nothing was evicted. The "
                "model's attention must call mlx-lm's scaled_dot_product_attention through the "
                "router installed by cache.make_cache; use policy full or rotating otherwise"
            )

    def _grown(
        self, buf: mx.array | None, lead: tuple, tail: tuple, dtype: mx.Dtype, capacity: int
    ) -> mx.array:
        """A [*lead, capacity, *tail] buffer holding `buf`'s used slots."""
        fresh = mx.zeros((*lead, capacity, *tail), dtype=dtype)
        if buf is not None and self.used:
            fresh[:, :, : self.used] = buf[:, :, : self.used]
        return fresh

    def _grow(self, keys, values, needed: int) -> None:
        # Decode needs max_size + 1 slots at most (one for the newest token); a
        # prefill chunk gets exactly what it needs until eviction cuts it back.
        decode_slots = self.slot_budget + self._slots_per_token
        if needed <= decode_slots:
            capacity = min(-(-needed // self.step) * self.step, decode_slots)
        else:
            capacity = needed
        if self.positions is None:  # first tokens: nothing to copy over
            self.keys = tree_map(lambda _: None, keys)
            self.values = tree_map(lambda _: None, values)
        self._grow_kv(keys, values, capacity)
        lead = tree_flatten(keys)[0][1].shape[:2]  # [B, H]
        self.scores = self._grown(self.scores, lead, (), mx.float32, capacity)
        self.positions = self._grown(self.positions, lead, (), mx.int32, capacity)
        if self.lags is not None:
            self.lags = self._grown(self.lags, lead, (), mx.int32, capacity)
        self.reset_free_slots()

    def reset_free_slots(self) -> None:
        """Free slots get score 0 and the positions (and lag) the next appended tokens will
        have."""
        free = self.positions.shape[-1] - self.used
        if free:
            if isinstance(self.seen, int):
                after = mx.arange(self.seen, self.seen + free, dtype=mx.int32)
            else:  # an array inside a compiled eviction (_compiled_eviction)
                after = self.seen + mx.arange(free, dtype=mx.int32)
            self.positions[..., self.used :] = after
            self.scores[..., self.used :] = 0.0
            if self.lags is not None:
                self.lags[..., self.used :] = self.shift

    def _gather(self, idx: mx.array, capacity: int) -> None:
        """Rebuild the buffers from slots `idx` [B, H, K] into `capacity` slots."""
        n = self.used
        self._gather_kv(idx, capacity)
        self.scores = gather_slots(self.scores[:, :, :n], idx, capacity)
        self.positions = gather_slots(self.positions[:, :, :n], idx, capacity)
        if self.lags is not None:
            self.lags = gather_slots(self.lags[:, :, :n], idx, capacity)
        self.used = idx.shape[-1]
        self.reset_free_slots()

    def _evict(self) -> None:
        """Keep sinks, the recent window and the best middle tokens: max_size + 1 - batch."""
        if self._evicts_at_final_size() and (compiled := _compiled_eviction(self)):
            self._evict_compiled(compiled)
            return
        self._evict_ops()

    def _evict_ops(self) -> None:
        """`_evict` op by op (what `_compiled_eviction` traces)."""
        kept, _ = self._eviction_split()
        if self._evicts_at_final_size() and self.fills_holes:
            self._fill_holes(kept)
        else:
            self._gather(kept, capacity=self.max_size + 1)

    # Whether a decode's eviction may leave slots out of position order (`_fill_holes`): a
    # dense tail needs the newest tokens in the last slots (cache/policies/quantized.py).
    fills_holes: bool = True

    def _fill_holes(self, kept: mx.array) -> None:
        """Eviction that moves only what must move: the kept tokens among the slots past
        `keep` (at most used - keep per head: the newest) go into the slots the leavers
        left below it, every other token stays where it is. A gather would rewrite every
        slot of K/V; this writes used - keep per head (the lone cache's twin of a slab's
        freed slots, with its slots still [0, used) for the next tokens' slice writes)."""
        n, keep = self.used, kept.shape[-1]
        lead = self.positions.shape[:2]
        is_kept = mx.put_along_axis(mx.zeros((*lead, n), mx.bool_), kept, mx.array(True), -1)
        below = mx.arange(keep, dtype=mx.int32)
        # Each head's holes below `keep`, ascending (as many as it keeps past it), then n.
        holes = mx.sort(mx.where(is_kept[..., :keep], n, below), axis=-1)[..., : n - keep]
        movers = is_kept[..., keep:]
        rank = mx.maximum(mx.cumsum(movers.astype(mx.int32), axis=-1) - 1, 0)
        past = mx.arange(keep, n, dtype=mx.int32)
        dest = mx.where(movers, mx.take_along_axis(holes, rank, axis=-1), past)  # else: stays
        move = partial(_moved_slots, dest, keep, n)
        self.keys, self.values = tree_map(move, (self.keys, self.values))
        self.scores, self.positions = move(self.scores), move(self.positions)
        self.used = keep
        self.reset_free_slots()

    def _evicts_at_final_size(self) -> bool:
        """A decode's eviction: every slot of buffers at their final size full, so its shapes
        repeat from one eviction to the next. Layouts that move more than their slots on
        eviction (subclasses that do not opt in: `compiles_eviction`) and re-indexed caches
        (their lags shift too) evict op by op."""
        if not self.compiles_eviction or self.lags is not None:
            return False
        slots = self.positions.shape[-1]
        return self.used == slots == self.slot_budget + self._slots_per_token

    def _evict_compiled(self, compiled: Callable) -> None:
        """`_evict`'s ranking, selection and writes as one compiled call (`seen`, which
        changes every time, is its input): ~40 ops per layer the host would build one by
        one every evict_batch steps."""
        buffers = {name: getattr(self, name) for name in self.eviction_buffers()}
        seen = mx.array(self.seen, dtype=mx.int32)
        self.__dict__.update(compiled(buffers, {"seen": seen}))
        self.evicted += self.used - self.keep
        self.used = self.keep

    def _eviction_split(self) -> tuple[mx.array, mx.array]:
        """(slots kept, slots leaving) [B, H, *], the leavers counted as evicted."""
        return self.split(self.eviction_ranks(self.positions[..., : self.used]))

    def ranking_kv(self, n: int) -> tuple[mx.array, mx.array] | None:
        """Dense K/V of slots [0, n), as stored."""
        return self.keys[:, :, :n], self.values[:, :, :n]

    def eviction_ranks(self, pos: mx.array) -> mx.array:
        """What eviction keeps the top of (HeavyHitters.rank_middle over the held slots)."""
        return self.rank_middle(self.scores[..., : self.used], pos, self.seen)


_VISIBLE_MEMO = 64  # visible masks a cache keeps (`_visible_slots`), each one byte a slot
_EVICTIONS: dict[Hashable, Callable] = {}  # compiled evictions by configuration (slab_key)


def _compiled_eviction(cache: H2OKVCache) -> Callable | None:
    """(slot buffers, {"seen"}) -> slot buffers after `_evict`, compiled once per
    configuration: `_evict`'s own code on a template of that configuration, so its rule,
    segments and layout (whether it fills holes or gathers) are what the trace holds.
    None where the configuration has no key (its pools still fill)."""
    key = cache.eviction_key()
    if key is None:
        return None
    if key not in _EVICTIONS:

        def evict(view: H2OKVCache) -> None:
            view.used = view.positions.shape[-1]
            view._evict_ops()

        _EVICTIONS[key] = compiled_on_template(cache, evict, cache.eviction_buffers())
    return _EVICTIONS[key]


def _moved_slots(dest: mx.array, start: int, stop: int, buf: mx.array) -> mx.array:
    """`buf` [B, H, slots, ...] with its slots [start, stop) written to slots `dest`
    [B, H, stop - start] (a slot's own index where it stays)."""
    return scatter_write(dest, buf, buf[:, :, start:stop])


def gather_slots(buf: mx.array, idx: mx.array, capacity: int) -> mx.array:
    """`buf`'s slots `idx` along axis 2, in a buffer of `capacity` slots (spares zeroed)."""
    picked = mx.take_along_axis(buf, idx, axis=2)
    if capacity == picked.shape[2]:
        return picked
    fresh = mx.zeros((*buf.shape[:2], capacity, *buf.shape[3:]), dtype=buf.dtype)
    fresh[:, :, : picked.shape[2]] = picked
    return fresh


def turn_keys(rope, keys: mx.array, delta: mx.array) -> mx.array:
    """keys [B, H, n, D] each rotated by its own `delta` [B, H, n] positions through `rope`."""
    B, H, n, D = keys.shape
    flat = keys.reshape(B * H * n, 1, 1, D)  # one row per key: RoPE takes one offset per row
    # On the CPU stream: MLX 0.32.4's CUDA RoPE turns rows by negative per-row offsets
    # wrongly (errors of 4-8 on an H100, docs/gpu.md), and re-indexing turns keys back.
    # It runs once per wall / 8 tokens at most.
    with mx.stream(mx.cpu):
        turned = rope(flat, offset=delta.reshape(-1))
    return turned.reshape(B, H, n, D).astype(keys.dtype)
