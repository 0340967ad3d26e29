"""Sessions of a sliding-window model decoding together: one batched pass vs one per row.

A sliding-window layer's mask depends on what each session's cache holds, and mlx-lm's
models ask the cache for it once per forward pass, so sessions of such a model (Gemma 3:
15 of its 18 layers) decoded one forward pass per session until each part got its own
mask (cache/batching/batch.py `PartMasks`), and as parts until their sliding windows joined the
KVSlab (mlx-lm's BatchRotatingKVCache). This drives the server's own Batcher over B
sessions (full caches, `--context`-token prompts, greedy, no HTTP) and times its decode
rounds three ways in the same process: one KVSlab (the server now), a part per session,
one pass per row. Rounds interleave them (order reversed every other round); wall and
process CPU time per decode round, medians over rounds; speed = the other mode's time /
the KVSlab's, per round, then the median.

    python -m bench.window_batching --out docs/window_batching.md   # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.gpu_step import counting_evals
from bench.report import command, machine, publish

# The server now; sessions batched as parts (before their windows joined a KVSlab); one
# forward pass per session (before sliding-window models batched at all).
MODES = ("one KVSlab", "a part per session", "one pass per row")


def decode_rounds(model, tokenizer, prompts: list[list[int]], mode: str, steps: int):
    """(wall ms, CPU ms) per decode round of the Batcher over these prompts, and the MLX
    primitives one round evaluates."""
    from cache import make_cache
    from config.cache_spec import CacheSpec
    from server.engine.batcher import Batcher
    from server.engine.generation import Generation
    from server.engine.jobs import SamplingParams
    from server.sessions.conversation import Session

    batcher = Batcher(model, prefill_step=512, prefill_budget=4096)
    batcher.batched = mode != "one pass per row"
    if mode == "a part per session":
        batcher._slabbable = lambda g: False
    spec = CacheSpec("full", 4096)
    params = SamplingParams(max_tokens=10**6, temperature=0.0)
    gens = []
    for i, prompt in enumerate(prompts):
        session = Session(id=str(i), spec=spec, keyed=True, caches=make_cache(model, spec))
        gens.append(Generation(tokenizer, session, prompt, 0, params))
    while any(g.prefilling for g in gens):
        batcher.run(gens)
    for _ in range(2):  # the first decode rounds trace and allocate
        batcher.run(gens)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        batcher.run(gens)
    wall, cpu = (
        (time.perf_counter() - wall) / steps * 1e3,
        (time.process_time() - cpu) / steps * 1e3,
    )
    ops = [0]
    with counting_evals(ops):  # one more round, its primitives counted (launches on a GPU)
        batcher.run(gens)
    return wall, cpu, ops[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--rows", type=int, nargs="+", default=[4, 8])
    p.add_argument("--context", type=int, default=300, help="prompt tokens per session")
    p.add_argument("--steps", type=int, default=24, help="timed decode rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from bench.text import essay_token_ids
    from models.loading import load_model

    model, tokenizer = load_model(args.model)
    ids = essay_token_ids(tokenizer, args.context * max(args.rows))
    times = {(rows, mode): [] for rows in args.rows for mode in MODES}
    for r in range(args.rounds):
        for rows in args.rows:
            prompts = [ids[i * args.context : (i + 1) * args.context] for i in range(rows)]
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                times[rows, mode].append(decode_rounds(model, tokenizer, prompts, mode, args.steps))

    body = [
        "| sessions | "
        + " | ".join(f"{m} ms / round" for m in MODES)
        + " | KVSlab speed vs parts | vs one pass per row | CPU ms, each mode "
        "| ops per round, each mode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rows in args.rows:
        runs = [times[rows, mode] for mode in MODES]
        walls = [statistics.median(wall for wall, _, _ in t) for t in runs]
        cpus = [statistics.median(cpu for _, cpu, _ in t) for t in runs]
        ops = [t[-1][2] for t in runs]
        speeds = [  # per round, then the median
            statistics.median(b[0] / a[0] for a, b in zip(runs[0], other, strict=True))
            for other in runs[1:]
        ]
        body.append(
            f"| {rows} | " + " | ".join(f"{w:.0f}" for w in walls)
            + " | " + " | ".join(f"{x:.2f}x" for x in speeds)
            + " | " + " / ".join(f"{c:.0f}" for c in cpus)
            + " | " + " / ".join(str(n) for n in ops) + " |"
        )  # fmt: skip
    intro = (
        f"Model `{args.model}`, full caches, {args.context}-token prompts, greedy, "
        f"{args.steps} timed decode rounds of the server's Batcher per case, {args.rounds} "
        f"interleaved rounds. Machine: {machine()}."
    )
    title = "Sliding-window sessions decoding together"
    publish(title, intro, command("bench.window_batching", argv), body, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
