"""What batching B decode rows into one forward pass buys on this machine, per cache.

The server advances every decoding session in one forward pass per round
(server/engine/batcher.py); how much that gains over one stream is bounded by what the
model's batched forward itself gains. This measures that bound without the server
(no HTTP, tokenizer or sampling): B rows of `--context` tokens each, then greedy
decode steps with the next step queued before waiting (as generate_step does).

- `stock`: mlx-lm as it ships, the B rows in one KVCache (what mlx_lm.server's
  BatchGenerator runs): the anchor's ceiling;
- `h2o`: B separate h2o caches (max_kv 256, evicting) joined per layer by
  cache/batching/batch.py, each row a part of its own (one scored call per session and
  layer), as the server batched H2O sessions before H2OSlab;
- `h2o slab`: the same sessions as rows of one H2OSlab (cache/batching/h2o_slab.py), as the
  server batches dense H2O sessions of one configuration now (`--policy kvarn`: a
  KVarNPaddedSlab, cache/batching/kvarn_padded.py, rows of different lengths: see `--spread`).

Rounds interleave every (cache, B) pair, order reversed every other round; scaling =
B x (B=1 step time) / (B step time), medians over rounds. `--slab-policies`: slabs of
other policies in the same rounds, each step against the `--policy` slab's of its round.

    python -m bench.batch_scaling --out docs/batch_scaling.md     # ~5 min on 2 cores

`--synthetic llama-1b --dtype bfloat16` runs a random llama of that shape instead (no
model file or tokenizer: random prompt tokens), as on a lent GPU (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from bench.decode_speed import SHAPES, synthetic_model
from bench.report import command, machine, publish


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=300, help="tokens per row before decoding")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--policy", default="h2o", help="the H2O cases' policy (h2o, h2o-q8, ...)")
    p.add_argument("--slab-policies", nargs="*", default=[], help="more slabs, e.g. h2o-q4")
    p.add_argument(
        "--spread",
        type=int,
        default=0,
        help="row r's prompt is --context + r x spread tokens (sessions of different lengths)",
    )
    p.add_argument("--synthetic", choices=SHAPES, help="random weights of this shape")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.text import essay_token_ids
    from cache import install_router, make_cache, uninstall_router
    from cache.batching.batch import batch_caches, open_h2o_slab
    from cache.batching.h2o_slab import slab_key
    from config.policies import POLICIES

    width = args.context + args.spread * (max(args.rows) - 1)  # the longest row's prompt
    total = width * max(args.rows)
    if args.synthetic:
        model = synthetic_model(args.synthetic, getattr(mx, args.dtype))
        ids = mx.random.randint(0, SHAPES[args.synthetic][-1], (total,), key=mx.random.key(0))
        ids, about = ids.tolist(), f"Synthetic `{args.synthetic}` (random weights, {args.dtype})"
    else:
        from models.loading import load_model  # the server's packages: not on a lent GPU

        model, tokenizer = load_model("default")
        ids, about = essay_token_ids(tokenizer, total), "Default model (float32)"

    def prompts(rows: int) -> list[list[int]]:  # a different passage per row
        return [ids[r * width : r * width + args.context + r * args.spread] for r in range(rows)]

    def stock(rows: int):
        uninstall_router(model)
        caches = make_prompt_cache(model)
        if args.spread:  # left-padded, as mlx-lm's BatchGenerator holds rows of any length
            from mlx_lm.models.cache import BatchKVCache

            rows_in = prompts(rows)
            pads = [max(map(len, rows_in)) - len(p) for p in rows_in]
            caches = [BatchKVCache(pads) for _ in caches]
            padded = mx.array([[0] * pad + p for pad, p in zip(pads, rows_in, strict=True)])
            return lambda: caches, model(padded, cache=caches)
        logits = model(mx.array(prompts(rows)), cache=caches)
        return lambda: caches, logits

    def prefilled_sessions(rows: int, policy: str) -> tuple[list, mx.array]:
        """`rows` sessions of `policy`, each prompt prefilled alone (as the server does);
        their caches and last logits."""
        install_router(model)
        sessions = [make_cache(model, policy, max_kv=256) for _ in range(rows)]
        lasts = [
            model(mx.array([p]), cache=c)[:, -1:]
            for p, c in zip(prompts(rows), sessions, strict=True)
        ]
        return sessions, mx.concatenate(lasts)

    def h2o(rows: int):
        sessions, logits = prefilled_sessions(rows, args.policy)
        return partial(batch_caches, sessions), logits

    def h2o_slab(rows: int, policy: str):
        sessions, logits = prefilled_sessions(rows, policy)
        if rows == 1:  # the server slabs two or more
            return partial(batch_caches, sessions), logits
        slab = open_h2o_slab(slab_key(sessions[0]))
        slab.join(list(enumerate(sessions)))
        return partial(batch_caches, [], slab), logits

    def step_seconds(make, rows: int) -> tuple[float, float]:
        """make(rows) -> (the caches of each forward pass, built per pass as the server
        does; the prompt's logits)."""
        caches, logits = make(rows)
        mx.eval(logits)
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(model(token, cache=caches()))  # warm-up, untimed
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            following = mx.argmax(model(token, cache=caches())[:, -1], axis=-1)[:, None]
            mx.async_eval(following)
            mx.eval(token)
            token = following
        mx.eval(token)
        n = args.steps
        return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n

    def named(policy: str) -> str:  # max_kv bounds what evicting policies hold
        return policy + " max_kv 256" * POLICIES[policy].bounded

    def slab_case(policy: str) -> str:
        return f"{named(policy)}, one slab (cache/batching/batch.py open_h2o_slab)"

    cases = {
        "stock mlx-lm (one KVCache)": stock,
        f"{named(args.policy)}, a part per session (cache/batching/batch.py)": h2o,
        **{slab_case(p): partial(h2o_slab, policy=p) for p in [args.policy, *args.slab_policies]},
    }
    pairs = [(name, rows) for name in cases for rows in args.rows]
    got: dict[tuple[str, int], list[tuple[float, float]]] = {pair: [] for pair in pairs}
    for r in range(args.rounds):
        for name, rows in pairs if r % 2 == 0 else pairs[::-1]:
            got[name, rows].append(step_seconds(cases[name], rows))
            wall = got[name, rows][-1][0]
            print(f"round {r}: {name} B={rows}: {wall * 1e3:.1f} ms/step", file=sys.stderr)
    install_router(model)

    lines = [
        "| cache | rows | ms per step (median) | tok/s | scaling vs 1 row (median) "
        "| per-round scaling | CPU ms per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in cases:
        one = [w for w, _ in got[name, args.rows[0]]]
        for rows in args.rows:
            walls = [w for w, _ in got[name, rows]]
            scaling = [rows * a / b for a, b in zip(one, walls, strict=True)]
            step = statistics.median(walls)
            lines.append(
                f"| {name} | {rows} | {step * 1e3:.1f} | {rows / step:.1f} | "
                f"{statistics.median(scaling):.2f}x | {', '.join(f'{x:.2f}' for x in scaling)} | "
                f"{statistics.median(c for _, c in got[name, rows]) * 1e3:.1f} |"
            )
    if args.slab_policies:
        lines += [
            "",
            f"Slab step rate against the {args.policy} slab's in the same round:",
            "",
            "| cache | rows | vs the " + args.policy + " slab (median) | per round |",
            "|---|---|---|---|",
        ]
        for policy in args.slab_policies:
            for rows in args.rows:
                base, mine = got[slab_case(args.policy), rows], got[slab_case(policy), rows]
                ratios = [a[0] / b[0] for a, b in zip(base, mine, strict=True)]
                lines.append(
                    f"| {slab_case(policy)} | {rows} | {statistics.median(ratios):.3f}x | "
                    f"{', '.join(f'{x:.2f}' for x in ratios)} |"
                )
    publish(
        "Batched decode: what one forward pass for B rows gains",
        f"{about}, {args.context} tokens per row"
        + (f" (row r: + r x {args.spread})" if args.spread else "")
        + f", {args.steps} pipelined greedy "
        f"steps per measurement, {args.rounds} interleaved rounds; scaling within each round "
        f"against the same cache's {args.rows[0]}-row step. Machine: {machine()}.",
        command("bench.batch_scaling", argv),
        lines,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
