"""What one h2o-merge eviction costs a layer: middle keys only, against every slot's.

A merging eviction ranks each middle token by its distance to the nearest middle key
ranked above it (cache/policies/merging.py). Its first form normalised and compared every slot's
key with every other's, [slots x slots], though sinks and the recent window (half of
max_kv) never leave and were masked out after; it now compares the middle keys only,
[middle x middle], with the same leavers (tests/test_merging_cache.py). This times one
layer's compiled eviction call (ranking, merge and writes, at the buffers' final size)
both ways, interleaved round by round, with the process CPU time, and gives its cost per
decode step (an eviction every evict_batch steps).

    python -m bench.merge_eviction --max-kv 128 512 2048 --out docs/merge_eviction.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.report import command, machine, publish
from cache.policies.h2o import H2OKVCache, _compiled_eviction
from cache.policies.merging import MergingH2OKVCache


class AllPairsMerging(MergingH2OKVCache):
    """The merge rank as first written: every slot's key against every slot's."""

    compiles_eviction = True

    def eviction_ranks(self, pos: mx.array) -> mx.array:
        ranks = H2OKVCache.eviction_ranks(self, pos)
        n = pos.shape[-1]
        middle = self.in_middle(pos, self.seen)
        keys = self.keys[:, :, :n].astype(mx.float32)
        unit = keys / mx.maximum(mx.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
        similarity = unit @ unit.swapaxes(-1, -2)  # [B, H, slot, other slot]
        mine, theirs = ranks[..., :, None], ranks[..., None, :]
        slot = mx.arange(n)
        higher = (theirs > mine) | ((theirs == mine) & (slot[None, :] < slot[:, None]))
        nearest = mx.where(middle[:, :, None, :] & higher, similarity, -mx.inf).max(axis=-1)
        return mx.where(middle, ranks * mx.clip(1.0 - nearest, 1e-3, 2.0), ranks)


def eviction_call(kind: type[MergingH2OKVCache], max_kv: int, heads: int, dim: int, dtype):
    """A full merging cache's compiled eviction and its inputs (random K/V and scores)."""
    c = kind(max_kv, score="mean")
    key = mx.random.key(max_kv)
    k = mx.random.normal((1, heads, max_kv, dim), key=key).astype(dtype)
    c.update_and_fetch(k, k)  # a prompt: the buffers at their final max_kv + 1 slots
    while not c._evicts_at_final_size():
        c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    compiled = _compiled_eviction(c)
    buffers = {name: getattr(c, name) for name in c.eviction_buffers()}
    buffers["scores"] = mx.random.uniform(shape=buffers["scores"].shape, key=key)
    seen = mx.array(c.seen, dtype=mx.int32)
    mx.eval(buffers)
    return lambda: compiled(buffers, {"seen": seen}), c.evict_batch


def timed(call, repeats: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per call, each call evaluated before the next."""
    mx.eval(call())  # warm: the trace
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        mx.eval(call())
    return (
        (time.perf_counter() - wall) * 1e3 / repeats,
        (time.process_time() - cpu) * 1e3 / repeats,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-kv", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--heads", type=int, default=8, help="KV heads a layer (llama-1b: 8)")
    p.add_argument("--dim", type=int, default=64, help="head dim (llama-1b: 64)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10, help="calls timed per round")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    dtype = getattr(mx, args.dtype)
    rows = [
        "| max_kv | evict batch | all pairs ms | middle only ms | ratio (CPU) "
        "| per decode step: all pairs / middle only ms |",
        "|---|---|---|---|---|---|",
    ]
    for max_kv in args.max_kv:
        kinds = (AllPairsMerging, MergingH2OKVCache)
        calls = [eviction_call(kind, max_kv, args.heads, args.dim, dtype) for kind in kinds]
        batch = calls[0][1]
        runs = [[], []]
        for _ in range(args.rounds):  # A, B, A, B: the machine's noise falls on both
            for run, (call, _) in zip(runs, calls, strict=True):
                run.append(timed(call, args.repeats))
        (whole, whole_cpu), (middle, middle_cpu) = (
            tuple(statistics.median(x[i] for x in run) for i in (0, 1)) for run in runs
        )
        rows.append(
            f"| {max_kv} | {batch} | {whole:.2f} | {middle:.2f} | {middle / whole:.2f} "
            f"({middle_cpu / whole_cpu:.2f}) | {whole / batch:.3f} / {middle / batch:.3f} |"
        )
        print(rows[-1], flush=True)
    publish(
        "h2o-merge: one eviction's cost, middle keys only vs every pair",
        f"One layer of {args.heads} KV heads x {args.dim} dims ({args.dtype}), the compiled "
        f"eviction at the buffers' final size (`heavy` preset, `mean`); medians of "
        f"{args.rounds} interleaved rounds of {args.repeats} calls; ratio middle only / all "
        f"pairs (process CPU time's in parentheses). Machine: {machine()}.",
        command("bench.merge_eviction", argv),
        rows,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
