"""Sessions of a sliding-window model decoding together: one batched pass vs one per row.

A sliding-window layer's mask depends on what each session's cache holds, and mlx-lm's
models ask the cache for it once per forward pass, so sessions of such a model (Gemma 3:
15 of its 18 layers) decoded one forward pass per session until each part got its own
mask (cache/batch.py `PartMasks`). This drives the server's own Batcher over B sessions
(full caches, `--context`-token prompts, greedy, no HTTP) and times its decode rounds
both ways in the same process: batched (the server now) and one pass per row (before).
Rounds interleave the two (order reversed every other round); wall and process CPU time
per decode round, medians over rounds; speed = per-row time / batched time, per round.

    python -m bench.window_batching --out docs/window_batching.md   # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.report import command, machine, publish

MODES = ("batched", "one pass per row")


def decode_rounds(model, tokenizer, prompts: list[list[int]], batched: bool, steps: int):
    """(wall ms, CPU ms) per decode round of the Batcher over these prompts."""
    from cache import make_cache
    from config.cache_spec import CacheSpec
    from server.engine.batcher import Batcher
    from server.engine.generation import Generation
    from server.engine.jobs import SamplingParams
    from server.sessions.conversation import Session

    batcher = Batcher(model, prefill_step=512, prefill_budget=4096)
    batcher.batched = batched
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
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


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
                batched = mode == "batched"
                times[rows, mode].append(
                    decode_rounds(model, tokenizer, prompts, batched, args.steps)
                )

    body = [
        "| sessions | batched ms / round | one pass per row ms / round | speed "
        "| CPU ms batched / per row |",
        "|---|---|---|---|---|",
    ]
    for rows in args.rows:
        ours, theirs = times[rows, MODES[0]], times[rows, MODES[1]]
        speed = statistics.median(b[0] / a[0] for a, b in zip(ours, theirs, strict=True))
        med = [statistics.median(x[i] for x in t) for t in (ours, theirs) for i in (0, 1)]
        body.append(
            f"| {rows} | {med[0]:.0f} | {med[2]:.0f} | {speed:.2f}x | {med[1]:.0f} / {med[3]:.0f} |"
        )
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
