"""Decode speed of each cache policy at a long context, measured side by side.

Each round prefills the same essay context into a fresh cache for every
policy, then times `--steps` single-token decode steps. Rounds interleave the
policies so machine noise hits them alike; ratios are taken within a round and
the median over rounds is reported.

    python -m bench.decode_speed --context 2048 --rounds 3 --out docs/decode_speed.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.report import command, machine, publish
from bench.text import essay_token_ids
from cache import make_cache
from server.models import load_model

# (label, make_cache kwargs, label of the baseline it is compared with)
CASES = [
    ("full", {"policy": "full"}, None),
    ("h2o, no eviction (max_kv 4096)", {"policy": "h2o", "max_kv": 4096}, "full"),
    ("rotating 256", {"policy": "rotating", "max_kv": 256}, None),
    ("h2o 256, evicting (batch 16)", {"policy": "h2o", "max_kv": 256}, "rotating 256"),
    (
        "h2o 256 ema, evicting (batch 16)",
        {"policy": "h2o", "max_kv": 256, "score": "ema"},
        "rotating 256",
    ),
    (
        "h2o 256, evicting 1 per step",
        {"policy": "h2o", "max_kv": 256, "evict_batch": 1},
        "rotating 256",
    ),
]


def decode_tps(model, context: mx.array, steps: int, **cache_kwargs) -> float:
    caches = make_cache(model, **cache_kwargs)
    for start in range(0, context.size, 512):
        mx.eval(model(context[None, start : start + 512], cache=caches))
    token = context[-1:].reshape(1, 1)
    logits = model(token, cache=caches)  # warm-up step, not timed
    mx.eval(logits)
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(logits[:, -1], axis=-1).reshape(1, 1)
        logits = model(token, cache=caches)
        mx.eval(logits)
    return steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=2048, help="tokens in the cache before decoding")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)

    model, tokenizer = load_model(args.model)
    context = mx.array(essay_token_ids(tokenizer, args.context))
    tps: dict[str, list[float]] = {label: [] for label, _, _ in CASES}
    for r in range(args.rounds):
        for label, kwargs, _ in CASES:
            tps[label].append(decode_tps(model, context, args.steps, **kwargs))
            print(f"round {r + 1}: {label}: {tps[label][-1]:.2f} tok/s", file=sys.stderr)

    rows = ["| cache | decode tok/s (median) | ratio | vs |", "|---|---|---|---|"]
    for label, _, base in CASES:
        ratio = ""
        if base:
            per_round = [a / b for a, b in zip(tps[label], tps[base], strict=True)]
            ratio = f"{statistics.median(per_round):.3f}"
        rows.append(f"| {label} | {statistics.median(tps[label]):.2f} | {ratio} | {base or ''} |")
    publish(
        "Decode speed by cache policy",
        f"Model `{args.model}`, {args.context} tokens of context, {args.steps} timed "
        f"decode steps, {args.rounds} interleaved rounds; ratio = median of per-round ratios. "
        f"Machine: {machine()}.",
        command("bench.decode_speed", argv),
        rows,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
