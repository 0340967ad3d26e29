"""A decode token's store joined to its layer's compiled attend-and-score call, or apart:
A/B on the same sessions in one process, alternating every two steps (A A B B ...).

Under a step owner (`scores_with_step`, the server's batcher) a slab layer's or a lone
packed cache's decode token is written inside the compiled call that attends and scores
(`store_and_attend`, cache/compiled_decode.py); apart, the store is its own compiled call.
Per variant: host ms to build a step (the model call), ms of the whole step (build and
evaluation) and the process's CPU ms in it, medians over the steps.

    python -m bench.joined_store --synthetic llama-1b --out docs/joined_store.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.report import command, machine, publish

CASES = ["h2o:16", "h2o-q8:16", "h2o-q4:16", "h2o-q8:1", "h2o-q4:1"]  # policy:rows


def main(argv: list[str] | None = None) -> None:
    from bench.decode_speed import SHAPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic", choices=SHAPES, help="random weights of this shape")
    p.add_argument("--context", type=int, default=144, help="prompt tokens per session")
    p.add_argument("--max-kv", type=int, default=128)
    p.add_argument("--steps", type=int, default=48, help="timed decode steps (both variants)")
    p.add_argument("--cases", nargs="+", default=CASES, help="policy:rows (1: alone)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import mlx.core as mx

    from bench.decode_speed import synthetic_model
    from bench.gpu_step import buffers, buffers_holders
    from cache import install_router, make_cache
    from cache.attention import ATTENTION, ScoredAttention
    from cache.batching.batch import batch_caches
    from cache.batching.h2o_slab import H2OSlab, slab_key
    from cache.contract import step_scores
    from config.cache_spec import CacheSpec

    if args.synthetic:
        model = synthetic_model(args.synthetic, mx.float32)
        vocab, about = SHAPES[args.synthetic][-1], f"synthetic `{args.synthetic}`"
    else:
        from models.loading import load_model

        model, _ = load_model("default")
        vocab, about = model.args.vocab_size, "the default model"
    install_router(model)
    joined_or_not = ScoredAttention.stores_with_decode
    rows_out = []
    for case in args.cases:
        policy, rows = case.split(":")
        rows = int(rows)
        ids = mx.random.randint(0, vocab, (rows, args.context), key=mx.random.key(0))
        spec = CacheSpec(policy, args.max_kv)
        made = [make_cache(model, spec, scores_with_step=True) for _ in range(rows)]
        lasts = [model(ids[r : r + 1], cache=c)[:, -1] for r, c in enumerate(made)]
        token = mx.argmax(mx.concatenate(lasts), axis=-1)[:, None]
        held = made
        caches = lambda made=made: made[0]  # noqa: E731
        if rows > 1:
            slab = H2OSlab(slab_key(made[0]))
            slab.join(list(enumerate(made)))
            held, caches = [slab], (lambda slab=slab: batch_caches([], slab))
        scored = list(buffers_holders(held))
        mx.eval(token, buffers(held))
        times = {True: ([], [], []), False: ([], [], [])}  # build, step, CPU
        try:
            for i in range(args.steps + 4):  # the first 4 trace both variants
                joined = (i // 2) % 2 == 0
                ATTENTION.stores_with_decode = (
                    (lambda c: joined_or_not(ATTENTION, c)) if joined else (lambda c: False)
                )
                start, start_cpu = time.perf_counter(), time.process_time()
                logits = model(token, cache=caches())
                built = time.perf_counter()
                token = mx.argmax(logits[:, -1], axis=-1)[:, None]
                mx.eval(token, step_scores(scored))
                if i >= 4:
                    build, step, cpu = times[joined]
                    build.append(built - start)
                    step.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - start_cpu)
        finally:
            del ATTENTION.stores_with_decode  # the class's method again
        med = {k: [statistics.median(x) * 1e3 for x in v] for k, v in times.items()}
        (jb, js, jc), (ab, as_, ac) = med[True], med[False]
        rows_out.append(
            f"| {policy} | {rows} | {jb:.2f} / {ab:.2f} | {jb / ab:.2f}x | {js:.1f} / {as_:.1f} "
            f"| {js / as_:.2f}x | {jc / ac:.2f}x |"
        )
        print(rows_out[-1], file=sys.stderr)
    intro = (
        f"{about.capitalize()} (float32), {args.context}-token prompts, max_kv {args.max_kv}, "
        f"{args.steps} decode steps per case alternating joined / apart every two steps on "
        f"the same sessions (rows > 1: one H2OSlab). Machine: {machine()}."
    )
    body = [
        "| cache | rows | build ms joined / apart | x | step ms joined / apart | x | step CPU x |",
        "|---|---|---|---|---|---|---|",
        *rows_out,
    ]
    publish(
        "A decode token's store joined to its compiled call, or apart",
        intro,
        command("bench.joined_store", argv),
        body,
        args.out,
    )


if __name__ == "__main__":
    main()
