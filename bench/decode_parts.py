"""Packed decode with one softmax over every part vs a softmax per part merged by log-sum-exp.

Packed H2O caches attend in parts (the dense sink pool, the packed rest; a mixed
cache's two widths). cache/attention.py takes one softmax over all parts' logits
for a decode query on the reference backend (`_joint_decode`); the alternative is
each part on its own, merged by log-sum-exp. Both run on the SAME caches after one
prompt, alternating every round (A, B, B, A, ...), wall and process CPU time.

    python -m bench.decode_parts --out docs/decode_parts.md     # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.report import command, machine, publish

CASES = {  # label -> make_cache kwargs
    "h2o-q8, max_kv 256": {"policy": "h2o-q8", "max_kv": 256},
    "h2o-q8, max_kv 861": {"policy": "h2o-q8", "max_kv": 861},
    "h2o-q4 rotated, group 32, max_kv 256": {"policy": "h2o-q4", "max_kv": 256, "group_size": 32},
}


def timed(model, caches, y, steps: int) -> tuple[float, float, object]:
    """(tok/s wall, tok/s of process CPU time, last token) over `steps` greedy steps."""
    import mlx.core as mx

    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[:, None]
        mx.eval(y)
    return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu), y


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import mlx.core as mx

    from bench.text import essay_token_ids
    from cache import make_cache
    from cache.attention import ScoredAttention
    from server.models import load_model

    model, tokenizer = load_model("default")
    prompt = mx.array(essay_token_ids(tokenizer, args.context)[: args.context])[None]
    joint = ScoredAttention._joint_softmax

    def per_part(self, queries, parts) -> bool:
        return False

    lines = [
        "| cache | one softmax tok/s | per part tok/s | ratio (median) | per-round ratios "
        "| CPU-time ratio (median) |",
        "|---|---|---|---|---|---|",
    ]
    try:
        for label, kwargs in CASES.items():
            caches = make_cache(model, **kwargs)
            for start in range(0, args.context, 512):
                logits = model(prompt[:, start : start + 512], cache=caches)
                mx.eval(logits)
            y = mx.argmax(logits[:, -1], axis=-1)[:, None]
            got: dict[str, list[tuple[float, float]]] = {"joint": [], "per part": []}
            for r in range(args.rounds):
                for name in ("joint", "per part") if r % 2 == 0 else ("per part", "joint"):
                    ScoredAttention._joint_softmax = joint if name == "joint" else per_part
                    wall, cpu, y = timed(model, caches, y, args.steps)
                    got[name].append((wall, cpu))
            ratios = [a[0] / b[0] for a, b in zip(got["joint"], got["per part"], strict=True)]
            cpu = [a[1] / b[1] for a, b in zip(got["joint"], got["per part"], strict=True)]
            lines.append(
                f"| {label} | {statistics.median(w for w, _ in got['joint']):.2f} | "
                f"{statistics.median(w for w, _ in got['per part']):.2f} | "
                f"{statistics.median(ratios):.3f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                f"{statistics.median(cpu):.3f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        ScoredAttention._joint_softmax = joint
    publish(
        "Packed decode: one softmax over every part vs per part",
        f"Default model, {args.context}-token prompt in 512-token chunks, then "
        f"{args.rounds} rounds of {args.steps} greedy decode steps per variant on the same "
        "caches, alternating which goes first; ratio = one softmax / per part. "
        f"Machine: {machine()}.",
        command("bench.decode_parts", argv),
        lines,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
