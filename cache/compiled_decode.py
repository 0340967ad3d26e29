"""A scored layer's decode step in one compiled call: [store,] attention, the score update.

On a GPU a decode step is launch- and host-bound (docs/gpu.md): a scored layer built
op by op is a few dozen small launches (logits, softmax, the weighted sum, the score
rule's reduction and accumulation) and as much Python. Where a cache's slots keep their
shapes from step to step (a lone H2O cache once its buffers reach max_kv + 1 slots,
cache/policies/h2o.py; an H2O slab's rows, cache/batching/h2o_slab.py), those ops are one
`mx.compile`d
function, traced once per shape and replayed: what a GPU kernel's epilogue does, where
the kernel (not the reference) attends, only the score update is compiled. Under a step
owner (`scores_with_step`) a packed cache's token store joins that call too
(`stored_attended_and_scored`; a slab's whole step is cache/batching/h2o_slab.py `_decode_step`):
one call per layer stores, attends and scores (a 16-row slab's step builds in
0.86-0.88x the host time; a lone cache's in about the same: docs/joined_store.md).

Both callers speak the same two bodies; their arguments differ in what they hold:
- `held`: [] when every slot the attention does not mask is held (a lone cache masks its
  free slots, whose probabilities are then 0), else [bool [rows, H, slots]] (a slab's
  rows hold different slots, and their free ones keep score 0);
- `tail`: [] without a dense tail, else [int32 [rows, H or 1, tail]]: the slot each tail
  token fills (its packed copy is masked and the tail's logits are scored there);
- `front`: 0, or the dense sink pool read before every packed slot (a lone packed cache
  attends its packed buffers whole): the pool's logits are scored in slots [0, front),
  where their packed copies (masked) were read.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx
from mlx.utils import tree_flatten


def updated_scores(
    rule, n_kv_heads: int, scores, held: list, logits, probs, tail: list, front: int = 0
):
    """Every row's scores after one step's logits (and probabilities, or None): a front
    pool's and a tail's logits moved to the slots their tokens fill, accumulated by the
    rule, the slots a row does not hold kept at 0."""
    if front:  # [front | its packed copies, masked | the other slots ...]: drop the copies
        logits, probs = (
            None if x is None else mx.concatenate([x[..., :front], x[..., 2 * front :]], -1)
            for x in (logits, probs)
        )
    if tail:
        logits, probs = (None if x is None else tail_in_slots(x, tail[0]) for x in (logits, probs))
    updated = rule.accumulate(scores, logits, n_kv_heads, probs)
    return mx.where(held[0], updated, 0.0) if held else updated


def scored(
    rule, n_kv_heads: int, scores, held: list, logits, probs, tail: list, front: int = 0
) -> mx.array:
    """`updated_scores` in one compiled call: after an attention kernel that is not
    compiled with it (a GPU kernel's, or a step that does not fuse)."""
    with_probs = [] if probs is None else [probs]
    compiled = _scored(rule.accumulation, n_kv_heads, probs is not None, front)
    return compiled(scores, held, logits, with_probs, tail)


def attended_and_scored(
    queries, parts: list, scale: float, mask, attend: Callable, how: tuple,
    rule, n_kv_heads: int, scores, held: list, tail: list, front: int = 0, bias=None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """(output, scores): attention over `parts` [(keys, values, KVFormat)] by `attend`
    (`attend(queries, parts, scale, mask, bias)`: the router's op-by-op attention; `how`,
    its settings, keys the trace) and `updated_scores`, in one compiled call. The logits
    and probabilities stay inside the fused graph. `bias`: the cache's additive logit per
    slot (cache/policies/merging.py), or None."""
    formats = tuple(fmt for _, _, fmt in parts)
    fused = _attend_and_score(attend, how, formats, rule.accumulation, n_kv_heads, scale, front)
    biased = [] if bias is None else [bias]
    return fused(queries, [(k, v) for k, v, _ in parts], mask, scores, held, tail, biased)


def stored_attended_and_scored(
    store: Callable, stored: list, new: list, queries, parts: list, scale: float, mask,
    attend: Callable, how: tuple, rule, n_kv_heads: int, scores, held: list, tail: list,
    front: int = 0,
) -> tuple[mx.array, mx.array, list]:  # fmt: skip
    """`attended_and_scored` with a decode token's store first, in the same compiled call
    (what a GPU kernel that writes its token, attends and scores does): `store(*stored,
    *new)` returns `stored` written (the same structure), and a part's keys or values that
    are one of `stored` (the same object) are read as written. (output, scores, written)."""
    formats = tuple(fmt for _, _, fmt in parts)
    # A part's K or V that the store rewrites passes as its index into `stored` alone (not
    # twice as an input): matched by object, a host loop of a few `is` tests. mlx's
    # tree_flatten here cost ~12 us a layer, the compiled call itself ~17.
    kv = [x for k, v, _ in parts for x in (k, v)]  # [k0, v0, k1, v1, ...]
    where = tuple(_index_of(x, stored) for x in kv)
    flat = [x if i < 0 else [] for x, i in zip(kv, where, strict=True)]
    fused = _store_attend_score(
        store, where, attend, how, formats, rule.accumulation, n_kv_heads, scale, front
    )
    return fused(stored, new, queries, flat, mask, scores, held, tail)


def _index_of(x, stored: list) -> int:
    for i, s in enumerate(stored):
        if s is x:
            return i
    return -1


@functools.cache
def _scored(rule, n_kv_heads: int, with_probs: bool, front: int) -> Callable:
    def scored(scores, held: list, logits, probs: list, tail: list) -> mx.array:
        probs = probs[0] if with_probs else None
        return updated_scores(rule, n_kv_heads, scores, held, logits, probs, tail, front)

    return mx.compile(scored)


def attend_then_score(
    attend: Callable, formats: tuple, rule, n_kv_heads: int, scale: float, front: int,
    queries, arrays: list, mask, scores, held: list, tail: list, bias: list,
) -> tuple:  # fmt: skip
    """The body every compiled decode call ends with: (output, updated scores)."""
    parts = [(k, v, fmt) for (k, v), fmt in zip(arrays, formats, strict=True)]
    out, logits, probs = attend(queries, parts, scale, mask, *bias)
    scores = updated_scores(rule, n_kv_heads, scores, held, logits, probs, tail, front)
    # The output depends on the new scores: whoever evaluates the step evaluates them,
    # with no wait at this layer (start_scores) and no lazy chain of them across steps.
    return mx.depends([out], [scores])[0], scores


@functools.cache
def _attend_and_score(
    attend: Callable, how: tuple, formats: tuple, rule, n_kv_heads: int, scale: float,
    front: int,
) -> Callable:  # fmt: skip
    return mx.compile(partial(attend_then_score, attend, formats, rule, n_kv_heads, scale, front))


@functools.cache
def _store_attend_score(
    store: Callable, where: tuple, attend: Callable, how: tuple, formats: tuple, rule,
    n_kv_heads: int, scale: float, front: int,
) -> Callable:  # fmt: skip
    attend_scored = partial(attend_then_score, attend, formats, rule, n_kv_heads, scale, front)

    def step(stored: list, new: list, queries, flat: list, mask, scores, held, tail) -> tuple:
        written = store(*stored, *new)
        read = [x if i < 0 else written[i] for x, i in zip(flat, where, strict=True)]
        arrays = list(zip(read[::2], read[1::2], strict=True))
        out, scores = attend_scored(queries, arrays, mask, scores, held, tail, [])
        return out, scores, written

    return mx.compile(step)


def tail_in_slots(x: mx.array, tail_slots: mx.array) -> mx.array:
    """Per-key values over [slots | tail] [rows, q_heads, 1, slots + tail] as per slot: each
    tail token's in place of its (masked) packed copy's; `tail_slots` [rows, H, tail] (H: the
    KV heads, or 1 where every head's tail fills the same slots)."""
    slots = x.shape[-1] - tail_slots.shape[-1]
    group = x.shape[1] // tail_slots.shape[1]
    where = mx.repeat(tail_slots[:, :, None], group, axis=1)
    return mx.put_along_axis(x[..., :slots], where, x[..., slots:], axis=-1)


def select_write(taken: mx.array, buf: mx.array, new: mx.array) -> mx.array:
    """`buf` [B, H, slots, ...] with `new` [B, H, 1, ...] in the slots `taken` marks."""
    return mx.where(taken.reshape(*taken.shape, *[1] * (new.ndim - 3)), new, buf)


def scatter_write(at: mx.array, buf: mx.array, new: mx.array) -> mx.array:
    """`buf` [B, H, slots, ...] with `new` [B, H, n, ...] in slots `at` [B, H, n]."""
    where = mx.broadcast_to(at.reshape(*at.shape, *[1] * (new.ndim - 3)), new.shape)
    return mx.put_along_axis(buf, where, new, axis=2)


def slot_write(at: mx.array, buf: mx.array, new: mx.array) -> mx.array:
    """`buf` [B, H, slots, ...] with `new` [B, H, n, ...] in slots [at, at + n) of every
    row and head (`at`: int32 [1], an input, so that one trace serves every slot)."""
    return mx.slice_update(buf, new, at, axes=(2,))


def compiled_on_template(cache, step: Callable, outputs: Sequence[str]) -> Callable:
    """(buffers, scalars) -> the `outputs` attributes after `step(view)`, compiled: `view`
    is a copy of `cache` holding no array of its own (a template keeps no session's
    memory) given `buffers` and `scalars` (host numbers that change from call to call,
    passed as arrays so that one trace serves them all). So an eviction's own code, run
    once, is what the trace holds; its host-side counters are the caller's to update."""
    template = copy.copy(cache)
    for name, value in vars(cache).items():
        if any(isinstance(a, mx.array) for _, a in tree_flatten(value)):
            setattr(template, name, None)

    def run(buffers: dict, scalars: dict) -> dict:
        view = copy.copy(template)
        view.__dict__.update(buffers)
        view.__dict__.update(scalars)
        step(view)
        return {name: getattr(view, name) for name in outputs}

    return mx.compile(run)
