"""RecallH2OKVCache: H2O whose evicted tokens wait in a packed archive until a turn asks.

Question-agnostic eviction cannot keep a fact nobody has attended to yet: a number
stated in turn 1 and asked for in turn 5 is long gone under any score rule
(docs/recall.md: 0/24 for every rule at max_kv 64 and 128). Here an evicted token is
not dropped but packed (8-bit, `mx.quantize`) into a per-head archive of up to
`archive` tokens (the lowest-scored leave when it is full). A new turn's prompt
reads the archive as one more attention part: its chunks, and its last token, which
the server feeds as the first decode step. That token's query and the prompt's
queries before it (SnapKV's observation window, `RECALL_WINDOW`: the ones closest to
what will be generated) then weigh every archived token by the attention mass they
give its position, next to the cache's keys, summed over the layer's heads and
max-pooled over position neighbours, so that heads bring a phrase back whole, not
fragments of it. The `recall` best tokens per head, if above the cache's weakest
middle token, come back into the cache, pinned until the next prompt (eviction ranks
them with the sinks); what they displace goes into the archive. Decode steps read the
cache only, so their cost and attention memory stay those of max_kv; a prompt pays
attention over the archive (Quest and InfLLM retrieve evicted blocks per decode
step; once per turn is what a chat needs).

Positions stay the original RoPE ones: the policy does not re-index near the
context wall (an archived key would need re-rotating with the cache's).
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_flatten

from cache.attention import DENSE
from cache.budget import H2O_BOOKKEEPING, kv_width
from cache.policies.h2o import H2OKVCache
from cache.policies.quantized import check_group, quantize
from cache.scores.snap import sliding_max
from config.cache_spec import (
    DEFAULT_GROUP_SIZE,
    RECALL_ARCHIVE,
    RECALL_BITS,
    CacheSpec,
    default_recall,
)

RECALL_WINDOW = 32  # queries of a chunk that look into the archive (SnapKV's window)
# Position neighbours a recalled token brings along: a short phrase. The recall harness
# (bench/recall_grid.py, max_kv 128, 16 slots): kernel 7 recalled 6/12 documents, 9 6/8,
# 13 11/12 and 21/24; kernel 17 with 32 slots 16/24.
RECALL_KERNEL = 13
ARCHIVE_BITS = RECALL_BITS  # +0.5% perplexity when attended (h2o-q8, docs/quantized.md)


class RecallH2OKVCache(H2OKVCache):
    # A prompt's attention over the archive is merged after the sinks would apply.
    takes_sinks = False
    # A verify pass is a decode step of several queries: it reads the cache only, and its
    # queries choose nothing (`archive_part`, `observe`); eviction waits for the verdict.
    verifies_drafts = True

    def __init__(
        self,
        max_size: int,
        *,
        archive: int,
        recall: int | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        **h2o,
    ):
        """`archive`: evicted tokens kept packed per head; `recall`: the most a chunk brings
        back per head (at most heavy - evict_batch + 1, so pinned tokens always fit;
        None: `default_recall`).
        `h2o`: H2OKVCache's knobs (sink, heavy, recent, score, evict_batch)."""
        super().__init__(max_size, **h2o)
        if archive < 0:
            raise ValueError(f"archive must be >= 0 tokens, got {archive}")
        room = self.heavy + 1 - self.evict_batch
        if recall is None:
            recall = default_recall(self.heavy, self.evict_batch)
        if not 0 <= recall <= room:
            raise ValueError(
                f"recall must be between 0 and heavy - evict_batch + 1 ({room}), got {recall}"
            )
        self.archive, self.recall, self.group_size = archive, recall, group_size
        self.archived = None  # (keys, values) packed lists, each [B, H, A, ...]
        self.archived_positions = None  # int32 [B, H, A]
        self.archived_scores = None  # float32 [B, H, A]: the rank a token had when evicted
        self.pinned = None  # int32 [B, H, P]: positions recalled by the last chunk
        # A prompt's newest queries [B, n_q, <= RECALL_WINDOW, D] until it is recalled for.
        self._window, self._recall_due, self._scale = None, False, 1.0
        self.recalled = 0  # tokens brought back so far (per head, summed over heads / H)

    @classmethod
    def spec_knobs(cls, spec: CacheSpec) -> dict:
        return {"archive": RECALL_ARCHIVE * spec.max_kv, "group_size": spec.group_size}

    @classmethod
    def extra_bytes(cls, shape, spec: CacheSpec, window: int | None) -> float:
        """The archive at its fullest: RECALL_ARCHIVE x max_kv tokens per KV head, 8-bit K
        and V with a scale and a bias per group, a position and a score each."""
        per_token = 2 * kv_width(shape, ARCHIVE_BITS, spec.group_size) + H2O_BOOKKEEPING
        return RECALL_ARCHIVE * spec.max_kv * shape.kv_heads * per_token

    @classmethod
    def check_head_dim(cls, spec: CacheSpec, head_dim: int) -> None:
        check_group(head_dim, spec.group_size)

    # ----------------------------------------------------------------- the recall hook

    def archive_part(self, n_queries: int) -> tuple | None:
        """The archive as one more attention part (keys, values, format) for a prompt's
        queries: a chunk of `n_queries` > 1, or the single token right after chunks (the
        server feeds a prompt's last token as the first decode step). None for decode
        steps, or when the archive is empty."""
        if self.held is not None:  # a verify pass: decode steps read the cache only
            return None
        if self.archived_positions is None or not (n_queries > 1 or self._window is not None):
            return None
        # Unpacked once per call, not per query block: the dense kernel is the fast one.
        keys, values = (self._unpack(part) for part in self.archived)
        return keys, values, DENSE

    def observe(self, queries: mx.array, scale: float) -> None:
        """Queries (post-RoPE) of every attention call. A prompt's last `RECALL_WINDOW`
        (its chunks', then the single token after them) choose what comes back, once,
        when that token's scores are in (evict_if_full)."""
        if self.held is not None or (queries.shape[2] == 1 and self._window is None):
            return  # decoding (a verify pass's queries are decode steps')
        rows = queries if self._window is None else mx.concatenate([self._window, queries], 2)
        self._window = rows[:, :, -RECALL_WINDOW:]
        self._recall_due = queries.shape[2] == 1
        self._scale = scale

    def draft_room(self) -> int:
        """No draft while a prompt's recall waits for its last token, fed alone as the first
        decode step; then as dense H2O's."""
        return 0 if self._window is not None else super().draft_room()

    def evict_if_full(self) -> None:
        if self._recall_due:
            self._recall(self._window, self._scale)
            self._window, self._recall_due = None, False
        super().evict_if_full()

    def _recall(self, queries: mx.array, scale: float) -> None:
        """Bring the archived tokens these queries attend to most back, pinned."""
        self.pinned = None
        if self.archived_positions is None or self.recall == 0:
            return
        B, H, A = self.archived_positions.shape
        n = self.used
        arc_k = self._unpack(self.archived[0])
        rows = queries.reshape(B, H, -1, queries.shape[-1]).astype(mx.float32)  # GQA groups
        held_logits = (rows @ self.keys[:, :, :n].astype(mx.float32).swapaxes(-1, -2)) * scale
        arc_logits = (rows @ arc_k.astype(mx.float32).swapaxes(-1, -2)) * scale
        # Each row's softmax over the cache and the archive together: the mass a token
        # would get if it were held, comparable between the two.
        lse = mx.logaddexp(
            mx.logsumexp(held_logits, axis=-1, keepdims=True),
            mx.logsumexp(arc_logits, axis=-1, keepdims=True),
        )
        arc_mass = mx.exp(arc_logits - lse).sum(axis=2)  # [B, H, A]
        held_mass = mx.exp(held_logits - lse).sum(axis=2)  # [B, H, n]
        # A token's worth is its layer's: the mass every head gives its position (held or
        # archived there), so that heads bring the same phrase back, not fragments of it;
        # pooled over position neighbours, so that the phrase comes back whole.
        held_pos = self.positions[..., :n]
        by_pos = _sum_by_position(
            [(arc_mass, self.archived_positions), (held_mass, held_pos)], self.seen
        )
        pooled = _at_positions(sliding_max(by_pos, RECALL_KERNEL), self.archived_positions)
        # Worth a slot only above the cache's weakest middle token (which it may displace).
        middle = self.in_middle(held_pos, self.seen)
        held_worth = _at_positions(by_pos, held_pos)
        floor = mx.where(middle, held_worth, mx.inf).min(axis=-1, keepdims=True)
        k = min(self.recall, A)
        order = mx.argpartition(-pooled, kth=k - 1, axis=-1)
        picked, rest = order[..., :k], order[..., k:]
        wanted = mx.take_along_axis(pooled, picked, axis=-1) > floor  # [B, H, k]
        # Heads bring back equal counts (slots stay aligned): a head short of wanted tokens
        # takes its next best; the count is what the most eager head wants.
        count = int(wanted.sum(axis=-1).max().item())
        if count == 0:
            return
        by_mass = mx.argsort(-mx.take_along_axis(pooled, picked, axis=-1), axis=-1)
        picked = mx.take_along_axis(picked, by_mass, axis=-1)
        picked, rest = picked[..., :count], mx.concatenate([picked[..., count:], rest], -1)

        back_k = _take_packed(self.archived[0], picked)
        back_v = _take_packed(self.archived[1], picked)
        back_pos = mx.take_along_axis(self.archived_positions, picked, axis=-1)
        self._keep_archived(rest)
        dtype = self.keys.dtype
        keys, values = self._unpack(back_k).astype(dtype), self._unpack(back_v).astype(dtype)
        self._insert(keys, values, back_pos)
        self.pinned = back_pos
        self.recalled += count

    def _unpack(self, packed) -> mx.array:
        """Archived keys or values (words, scales, biases) as dense [B, H, n, D]."""
        return mx.dequantize(*packed, group_size=self.group_size, bits=ARCHIVE_BITS)

    def _insert(self, keys: mx.array, values: mx.array, positions: mx.array) -> None:
        """Append recalled tokens as held slots (score 0: what they earn from here on)."""
        end = self.used + keys.shape[2]
        if end > self.positions.shape[-1]:
            self._grow(keys, values, end)
        self.keys[:, :, self.used : end] = keys
        self.values[:, :, self.used : end] = values
        self.positions[..., self.used : end] = positions
        self.scores[..., self.used : end] = 0.0
        self.used = end
        self.reset_free_slots()

    # ------------------------------------------------------------ eviction into the archive

    def eviction_ranks(self, pos: mx.array) -> mx.array:
        ranks = super().eviction_ranks(pos)
        if self.pinned is None:
            return ranks
        pinned = (pos[..., :, None] == self.pinned[..., None, :]).any(axis=-1)
        return mx.where(pinned, mx.inf, ranks)

    def _evict(self) -> None:
        n = self.used
        kept, gone = self._eviction_split()
        if self.archive:
            ranks = self.rule_rank(self.scores[..., :n], self.positions[..., :n], self.seen)
            self._archive(
                mx.take_along_axis(self.keys[:, :, :n], gone[..., None], axis=2),
                mx.take_along_axis(self.values[:, :, :n], gone[..., None], axis=2),
                mx.take_along_axis(self.positions[..., :n], gone, axis=-1),
                mx.take_along_axis(ranks, gone, axis=-1),
            )
        self._gather(kept, capacity=self.max_size + 1)

    def _archive(self, keys, values, positions, scores) -> None:
        """Pack leaving tokens into the archive; past `archive` tokens, the lowest-ranked go."""
        packed = (
            quantize(keys, self.group_size, ARCHIVE_BITS),
            quantize(values, self.group_size, ARCHIVE_BITS),
        )
        if self.archived_positions is not None:
            packed = tuple(
                [mx.concatenate([old, new], axis=2) for old, new in zip(a, b, strict=True)]
                for a, b in zip(self.archived, packed, strict=True)
            )
            positions = mx.concatenate([self.archived_positions, positions], axis=-1)
            scores = mx.concatenate([self.archived_scores, scores], axis=-1)
        self.archived, self.archived_positions, self.archived_scores = packed, positions, scores
        if positions.shape[-1] > self.archive:
            best = mx.argpartition(-scores, kth=self.archive - 1, axis=-1)
            self._keep_archived(best[..., : self.archive])

    def _keep_archived(self, idx: mx.array) -> None:
        """Keep archive entries `idx` [B, H, K] only (none: the archive is empty)."""
        if idx.shape[-1] == 0:
            self.archived = self.archived_positions = self.archived_scores = None
            return
        self.archived = tuple(_take_packed(part, idx) for part in self.archived)
        self.archived_positions = mx.take_along_axis(self.archived_positions, idx, axis=-1)
        self.archived_scores = mx.take_along_axis(self.archived_scores, idx, axis=-1)

    def archived_tokens(self) -> int:
        """Tokens per head waiting in the archive."""
        return 0 if self.archived_positions is None else self.archived_positions.shape[-1]

    # ------------------------------------------------------------------ protocol

    @property
    def nbytes(self) -> int:
        """H2O's bytes plus the archive's (the pinned list, <= `recall` int32, not counted)."""
        extra = (self.archived, self.archived_positions, self.archived_scores)
        return super().nbytes + sum(a.nbytes for _, a in tree_flatten(extra) if a is not None)

    @property
    def state(self):
        """H2O's, the archive's, then what recall keeps between calls: the positions the
        last prompt brought back (pinned until the next one) and a prompt's newest
        queries while its recall waits for its last token (restored mid-prompt, the
        next step recalls as it would have)."""
        *held, meta = super().state
        pending = (self.pinned, self._window)
        if self.archived_positions is None:
            return (*held, *([None] * 8), *pending, meta)
        (kw, ks, kb), (vw, vs, vb) = self.archived
        arc = (kw, ks, kb, vw, vs, vb, self.archived_positions, self.archived_scores)
        return (*held, *arc, *pending, meta)

    @state.setter
    def state(self, v) -> None:
        # H2O's four arrays, the archive's eight, what recall keeps (absent from files
        # written before it was saved), the meta.
        held, arc, pending, meta = v[:4], v[4:12], v[12:-1], v[-1]
        H2OKVCache.state.fset(self, (*held, meta))
        kw, ks, kb, vw, vs, vb, positions, scores = arc
        self.archived = None if positions is None else ((kw, ks, kb), (vw, vs, vb))
        self.archived_positions, self.archived_scores = positions, scores
        self.pinned, self._window = (*pending, None, None)[:2]

    @property
    def meta_state(self) -> tuple[str]:
        meta = json.loads(super().meta_state[0])
        meta.update(archive=self.archive, recall=self.recall, group_size=self.group_size)
        meta.update(recalled=self.recalled, recall_due=self._recall_due, scale=self._scale)
        return (json.dumps(meta),)

    @meta_state.setter
    def meta_state(self, v) -> None:
        H2OKVCache.meta_state.fset(self, v)
        meta = json.loads(v[0])
        self.archive, self.recall = meta["archive"], meta["recall"]
        self.group_size, self.recalled = meta["group_size"], meta.get("recalled", 0)
        self._window = None  # the state setter restores it
        self._recall_due, self._scale = meta.get("recall_due", False), meta.get("scale", 1.0)


def _sum_by_position(parts: list[tuple[mx.array, mx.array]], length: int) -> mx.array:
    """Values [B, H, n] summed over heads by token position: [B, length]."""
    B = parts[0][0].shape[0]
    total = mx.zeros((B * length,), dtype=mx.float32)
    for values, positions in parts:
        flat = positions + (mx.arange(B) * length)[:, None, None]
        total = total.at[flat.reshape(-1)].add(values.reshape(-1).astype(mx.float32))
    return total.reshape(B, length)


def _at_positions(by_pos: mx.array, positions: mx.array) -> mx.array:
    """by_pos [B, length] read at positions [B, H, n]."""
    B, H, n = positions.shape
    return mx.take_along_axis(by_pos, positions.reshape(B, H * n), axis=-1).reshape(B, H, n)


def _take_packed(parts, idx: mx.array) -> tuple:
    """Rows `idx` [B, H, K] of each packed buffer (words, scales, biases) [B, H, A, ...]."""
    return tuple(mx.take_along_axis(a, idx[..., None], axis=2) for a in parts)
