"""Past the context wall: perplexity of a text twice the model's context under evicting caches.

A conversation under `h2o` may outgrow the model's context (8192 tokens for the
default model). Two ways to place its tokens' RoPE positions, compared here:
- `h2o-original`: every token keeps its index as its position, so the distance between
  the newest query and the sinks and old heavy hitters grows past anything the
  model was trained on;
- `h2o-reindexed` (the server's behaviour, cache/policies/h2o.py): before positions reach the
  context, the held keys are re-rotated to positions 0..n-1 in token order
  (StreamingLLM's choice; llama.cpp's context shift re-rotates keys too).
`rotating` (a sliding window with sinks, original positions) is the baseline.
Tokens go in chunks of `--chunk` (decode-like); perplexity is reported per
quarter of the text, with MLX's peak memory and the cache's bytes at the end.

    python -m bench.context_wall --out docs/context_wall.md
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.ppl import nll_chunked, sample_windows
from bench.report import command, machine, publish
from cache import cache_usage, make_cache
from config.blas import preload_openblas

NEVER = 2**30  # a context no conversation reaches: positions are never re-indexed

VARIANTS = {
    "rotating": {"policy": "rotating"},
    "h2o-original": {"policy": "h2o", "context": NEVER},
    "h2o-reindexed": {"policy": "h2o"},
    "h2o-q8-reindexed": {"policy": "h2o-q8"},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--max-kv", type=int, default=512)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--times-context", type=float, default=2.0, help="text length / context")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    preload_openblas()
    from models.loading import load_model

    model, tokenizer = load_model(args.model)
    context = model.args.max_position_embeddings
    length = int(args.times_context * context)
    tokens = sample_windows(tokenizer, args.samples, length)
    edges = [round(length * q / 4) for q in range(5)]
    quarters = list(itertools.pairwise(edges))
    rows = []
    for name in args.variants:
        fields = {"max_kv": args.max_kv, **VARIANTS[name]}
        caches = make_cache(model, **fields)
        mx.reset_peak_memory()
        t0 = time.time()
        nll = nll_chunked(model, tokens, fields, args.chunk, caches=caches)
        secs = time.time() - t0
        ppls = [math.exp(mx.mean(nll[:, lo:hi]).item()) for lo, hi in quarters]
        peak = mx.get_peak_memory() / 2**20
        rows.append((name, ppls, peak, cache_usage(caches)[2] / 2**20, secs))
        print(name, " ".join(f"{x:.2f}" for x in ppls), f"{secs:.0f}s", file=sys.stderr)

    heads = " | ".join(f"[{lo}, {hi})" for lo, hi in quarters)
    body = [
        f"| cache | {heads} | MLX peak (MiB) | cache (MiB) | s |",
        "|---|" + "---|" * (len(quarters) + 3),
    ]
    for name, ppls, peak, cache_mib, secs in rows:
        cells = " | ".join(f"{x:.2f}" for x in ppls)
        body.append(f"| {name} | {cells} | {peak:.0f} | {cache_mib:.1f} | {secs:.0f} |")
    intro = (
        f"Model `{args.model}` (float32, context {context}); {machine()}. {args.samples} "
        f"essay samples of {length} tokens ({args.times_context:g}x the context), fed "
        f"{args.chunk} tokens per forward pass through each cache at max_kv {args.max_kv}; "
        "perplexity per quarter of the text (the last two lie past the context); the "
        "cache's bytes at the end.\n\n" + __doc__.split("\n\n")[1]
    )
    publish(
        "Chats past the context window", intro, command("bench.context_wall", argv), body, args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
