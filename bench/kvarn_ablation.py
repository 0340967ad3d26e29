"""Where h2o-kvarn k4v2's perplexity cost over dense H2O comes from (issue 12).

Teacher-forced perplexity (one token per step, as bench.quantized) on essay windows
that the other benchmarks do not use (token `--start` on), each variant against
dense h2o, with the mean KL(dense h2o || variant) per step. Variants that change a
knob go through make_cache; counterfactuals patch the KVarN storage for the run
only:
- `exact-repack`: damaged tiles are re-packed from each survivor's original
  (rotated) K/V kept aside, not from its dequantized copy: no compounding;
- `value-group64`: values quantized in groups of 64 channels, not 32 (before);
- `mx-grids`: keys and values on mx.quantize's grids (min..max moved to put a
  level on 0), not fitted per group (cache/policies/kvarn_tiles.py, fit_quantize);
- `ls-values`: values on the least-squares grid without the unit-gain rescale;
- `gain-keys`: keys rescaled to unit gain as well;
- `no-sinkhorn`: tiles packed without Sinkhorn balancing (rotation and fitted
  grids only);
- `repack-sinkhorn`: tiles re-packed at an eviction Sinkhorn-balanced too (before);
- `fit-1round`: the fitted grids refitted once, not FIT_ITERS times;
- `clipped-values`: each value group's range clipped to whichever of 100-60% of
  min-max leaves the least squared error (mx.quantize on the clipped group).

    python -m bench.kvarn_ablation --out docs/kvarn_ablation.md
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from unittest import mock

import mlx.core as mx

import cache.factory
import cache.policies.kvarn_tiles
from bench.quantized import teacher_forced
from bench.report import command, machine, publish
from bench.text import essay_token_ids
from cache.policies.h2o_kvarn import H2OKVarNCache
from cache.policies.kvarn_tiles import SINKHORN_ITERS, fit_quantize, quantize_keys, quantize_values
from kernels.hadamard import rotate
from models.loading import load_model

CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6)


class ExactRepackCache(H2OKVarNCache):
    """h2o-kvarn whose re-packed tiles start from the original K/V (kept dense aside)."""

    shadow: list[mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        new = [rotate(x).astype(mx.float32) for x in (keys, values)]
        old = self.shadow
        self.shadow = (
            new if old is None else [mx.concatenate(p, axis=2) for p in zip(old, new, strict=True)]
        )
        return super().update_and_fetch(keys, values)

    def _rebuild(self, order: mx.array, intact: mx.array) -> None:
        self.shadow = [mx.take_along_axis(s, order[..., None], axis=2) for s in self.shadow]
        self._originals = iter(self.shadow)
        super()._rebuild(order, intact)

    def _dense_slots(self, parts: list, order: mx.array) -> mx.array:
        return next(self._originals)  # keys, then values, already in the kept order


def clipped_quantize(x: mx.array, group_size: int, bits: int):
    """mx.quantize of x, each group's range clipped to the ratio with the least error."""
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    lo, hi = groups.min(-1, keepdims=True), groups.max(-1, keepdims=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best = None
    for r in CLIP_RATIOS:
        clipped = mx.clip(groups, mid - r * half, mid + r * half).reshape(x.shape)
        q = mx.quantize(clipped, group_size=group_size, bits=bits)
        back = mx.dequantize(*q, group_size=group_size, bits=bits)
        err = ((back - x) ** 2).reshape(groups.shape).sum(-1)
        if best is not None:
            better = err < best[0]
            words = mx.repeat(better, group_size * bits // 32, axis=-1)
            q = [
                mx.where(m, a, b)
                for m, a, b in zip((words, better, better), q, best[1], strict=True)
            ]
            err = mx.minimum(err, best[0])
        best = (err, q)
    return tuple(best[1])


@contextmanager
def _quantized_with(keys, values) -> Iterator[None]:
    """KVarN's key and value tiles packed by these (mx.quantize's signature) for the run."""
    with (
        mock.patch.object(cache.policies.kvarn_tiles, "quantize_keys", keys),
        mock.patch.object(cache.policies.kvarn_tiles, "quantize_values", values),
    ):
        yield


def _h2o_kvarn_with(**knobs):
    """h2o-kvarn caches built with these H2OKVarNCache knobs for the run."""
    return mock.patch.object(cache.factory, "H2OKVarNCache", partial(H2OKVarNCache, **knobs))


# name -> (label, make_cache kwargs, patch for the run)
CASES = {
    "h2o": ("h2o (dense)", {"policy": "h2o"}, nullcontext),
    "h2o-evict32": (
        "h2o, 32 evicted at a time",
        {"policy": "h2o", "evict_batch": 32},
        nullcontext,
    ),
    "h2o-evict64": ("h2o, 64 evicted at a time", {"policy": "h2o", "evict_batch": 64}, nullcontext),
    "h2o-sink32": ("h2o, 32 sinks", {"policy": "h2o", "sink": 32}, nullcontext),
    "k4v2": ("h2o-kvarn k4v2", {"policy": "h2o-kvarn"}, nullcontext),
    "k4v4": ("h2o-kvarn k4v4", {"policy": "h2o-kvarn", "kvarn": "k4v4"}, nullcontext),
    "k4v2-evict16": (
        "h2o-kvarn k4v2, 16 evicted at a time",
        {"policy": "h2o-kvarn", "evict_batch": 16},
        nullcontext,
    ),
    "k4v2-sink32": ("h2o-kvarn k4v2, 32 sinks", {"policy": "h2o-kvarn", "sink": 32}, nullcontext),
    "exact-repack": (
        "h2o-kvarn k4v2, re-packed from the original K/V",
        {"policy": "h2o-kvarn"},
        lambda: mock.patch.object(cache.factory, "H2OKVarNCache", ExactRepackCache),
    ),
    "value-group64": (
        "h2o-kvarn k4v2, value groups of 64 (before)",
        {"policy": "h2o-kvarn"},
        partial(_h2o_kvarn_with, value_group_size=64),
    ),
    "mx-grids": (
        "h2o-kvarn k4v2, mx.quantize's grids (before)",
        {"policy": "h2o-kvarn"},
        partial(_quantized_with, mx.quantize, mx.quantize),
    ),
    "ls-values": (
        "h2o-kvarn k4v2, values least squares, not at unit gain",
        {"policy": "h2o-kvarn"},
        partial(_quantized_with, fit_quantize, fit_quantize),
    ),
    "gain-keys": (
        "h2o-kvarn k4v2, keys at unit gain too",
        {"policy": "h2o-kvarn"},
        partial(_quantized_with, partial(fit_quantize, unit_gain=True), quantize_values),
    ),
    "no-sinkhorn": (
        "h2o-kvarn k4v2, tiles not Sinkhorn-balanced",
        {"policy": "h2o-kvarn"},
        partial(_h2o_kvarn_with, sinkhorn_iters=0),
    ),
    "repack-sinkhorn": (
        "h2o-kvarn k4v2, re-packed tiles balanced too (before)",
        {"policy": "h2o-kvarn"},
        partial(_h2o_kvarn_with, repack_sinkhorn_iters=SINKHORN_ITERS),
    ),
    "fit-1round": (
        "h2o-kvarn k4v2, grids refitted once",
        {"policy": "h2o-kvarn"},
        partial(
            _quantized_with,
            partial(fit_quantize, iters=1),
            partial(fit_quantize, iters=1, unit_gain=True),
        ),
    ),
    "clipped-values": (
        "h2o-kvarn k4v2, values clipped for least error",
        {"policy": "h2o-kvarn"},
        partial(_quantized_with, quantize_keys, clipped_quantize),
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--start", type=int, default=30000, help="first essay token")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per window")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--max-kv", type=int, default=256)
    p.add_argument("--cases", default=",".join(CASES), help="the first is the baseline")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    names = args.cases.split(",")
    model, tokenizer = load_model(args.model)
    n = args.tokens
    ids = essay_token_ids(tokenizer, args.start + n * args.windows)[args.start :]
    ids = mx.array(ids).reshape(args.windows, n)
    targets = ids[:, args.prompt :]
    rows, base = [], None
    for name in names:
        label, kwargs, patch = CASES[name]
        began = time.perf_counter()
        with patch():
            logprobs = teacher_forced(model, ids, args.prompt, {**kwargs, "max_kv": args.max_kv})
        nll = -mx.take_along_axis(logprobs, targets[..., None], axis=-1).mean(axis=(1, 2))
        per_window = [math.exp(x) for x in nll.tolist()]
        ppl = math.exp(nll.mean().item())
        if base is None:
            base = (ppl, logprobs, per_window)
        kl = (mx.exp(base[1]) * (base[1] - logprobs)).sum(-1).mean().item()
        rel = [p / b - 1 for p, b in zip(per_window, base[2], strict=True)]
        rows.append(
            f"| {label} | {ppl:.3f} | {ppl / base[0] - 1:+.2%} | {kl:.4f} | "
            f"{min(rel):+.2%} .. {max(rel):+.2%} | {time.perf_counter() - began:.0f} |"
        )
        print(rows[-1], flush=True)
    intro = (
        f"Model `{args.model}` (float32), {machine()}. {args.windows} essay windows of "
        f"{n} tokens from token {args.start}, a {args.prompt}-token prompt, then teacher-forced "
        f"one token per step; max_kv {args.max_kv}, heavy preset, default score rule."
    )
    body = [
        f"| cache | perplexity | vs {CASES[names[0]][0]} | mean KL (nats/token) | "
        "per-window range | seconds |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    publish("h2o-kvarn k4v2: where its cost comes from", intro, command(
        "bench.kvarn_ablation", argv), body, args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
