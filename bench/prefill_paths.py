"""Prompt prefill with score export: the output from the plain matmul path (the same
softmax feeds output and scores) vs one fused mx.fast SDPA call plus a logits-only
score pass, each at a few query block sizes, beside stock mlx-lm. Interleaved rounds.

    python -m bench.prefill_paths --synthetic llama-1b --dtype bfloat16 --out docs/x.md

Picks `ScoredAttention.fused_prefill`'s default per device (cache/attention.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench.decode_speed import SHAPES, synthetic_model
from bench.report import command, machine, publish
from cache import make_cache, uninstall_router
from cache.attention import ATTENTION

STOCK = "stock mlx-lm full"


def prefill_seconds(model, context: mx.array, variant: tuple[bool, int] | None, max_kv: int):
    """(wall s, CPU s, MLX peak MiB) of prefilling `context` in 512-token chunks, fresh cache."""
    if variant is None:
        uninstall_router(model)
        caches = make_prompt_cache(model)
    else:
        ATTENTION.fused_prefill, ATTENTION.block = variant
        caches = make_cache(model, policy="h2o", max_kv=max_kv)
    mx.reset_peak_memory()
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, context.size, 512):
        model(context[None, start : start + 512], cache=caches)
        mx.eval([c.state for c in caches])
    return time.perf_counter() - wall, time.process_time() - cpu, mx.get_peak_memory() / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic", default="smollm2-135m", choices=SHAPES)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-kv", type=int, default=0, help="0: context + 1024 (no eviction)")
    p.add_argument("--blocks", type=int, nargs="+", default=[128, 512])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    model = synthetic_model(args.synthetic, getattr(mx, args.dtype))
    max_kv = args.max_kv or args.context + 1024
    context = mx.random.randint(0, SHAPES[args.synthetic][-1], (args.context,))
    variants = {STOCK: None}
    for block in args.blocks:
        variants[f"h2o, matmul output, block {block}"] = (False, block)
        variants[f"h2o, fused output, block {block}"] = (True, block)
    default_fused, saved = ATTENTION._fuses_prefill(), (ATTENTION.fused_prefill, ATTENTION.block)
    try:
        prefill_seconds(model, context[:512], None, max_kv)  # warm-up: kernels, allocator
        times = {label: [] for label in variants}
        for _ in range(args.rounds):
            for label, variant in variants.items():
                times[label].append(prefill_seconds(model, context, variant, max_kv))
    finally:
        ATTENTION.fused_prefill, ATTENTION.block = saved
    lines = [
        "| prefill | tok/s | vs stock (wall / CPU) | MLX peak MiB |",
        "|---|---|---|---|",
    ]
    for label, runs in times.items():
        tps = statistics.median(args.context / r[0] for r in runs)
        wall = statistics.median(s[0] / r[0] for r, s in zip(runs, times[STOCK], strict=True))
        cpu = statistics.median(s[1] / r[1] for r, s in zip(runs, times[STOCK], strict=True))
        peak = max(r[2] for r in runs)
        lines.append(f"| {label} | {tps:.0f} | {wall:.3f} / {cpu:.3f} | {peak:.0f} |")
    intro = (
        f"Synthetic `{args.synthetic}` ({args.dtype}), {args.context} tokens in 512-token "
        f"chunks, h2o max_kv {max_kv}, {args.rounds} interleaved rounds; ratios are medians "
        f"of per-round ratios. Default here: fused output {default_fused}, block "
        f"{saved[1]}. {machine()}."
    )
    publish(
        "Prefill paths with score export",
        intro,
        command("bench.prefill_paths", argv),
        lines,
        Path(args.out) if args.out else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
