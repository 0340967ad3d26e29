"""Recall through the server, enough trials for a confidence interval: which cache keeps a fact.

Short documents grown a turn at a time (bench/recall.py, `--document`): a
secret number in turn 1, essay passages as the next turns, then the question;
each turn goes through the real server's session, which evicts as it would for
any client (SmolLM2-135M fails the chat form even with a full cache). The goal of the
issue: the best rule at max_kv 128 keeps >= 80% of the full cache's hits. Caches:
full, rotating, h2o under each rule, h2o-recall, and h2o again at the max_kv that
costs what h2o-recall costs (its archive full), so memory is compared with memory.

    python -m bench.recall_grid --out docs/recall.md
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from bench.report import command, machine, publish


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a hit rate."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def run(args: argparse.Namespace) -> list[dict]:
    from bench.eval_cli import eval_records
    from server.cli import build_parser

    common = [
        "eval", "recall", "--document", "--samples", str(args.trials),
        "--turns", str(args.turns), "--filler-tokens", str(args.filler_tokens),
    ]  # fmt: skip
    # full and rotating do not score: once each, not once per rule; h2o once more at the
    # max_kv whose bytes match h2o-recall's (its archive full), memory for memory
    same_bytes = [str(equal_memory_max_kv(k)) for k in args.max_kv]
    groups = [
        (["full", "rotating"], ["mean"], args.max_kv),
        (["h2o"], args.rules, args.max_kv),
        (["h2o-recall"], ["mean"], args.max_kv),
        (["h2o"], ["mean"], same_bytes),
    ]
    rows = []
    for policies, rules, sizes in groups:
        argv = [*common, "--max-kv", *map(str, sizes), "--policy", *policies, "--score", *rules]
        rows += eval_records(build_parser().parse_args(argv))
    return rows


def default_shape():
    from bench.eval_cli import _load
    from cache.budget import ModelShape

    return ModelShape.of(_load("default")[0], element_bytes=4)


def equal_memory_max_kv(max_kv: int) -> int:
    """The h2o max_kv whose session bytes are h2o-recall's at `max_kv` (default model)."""
    from cache.budget import max_kv_within, session_bytes

    shape = default_shape()
    return max_kv_within(int(session_bytes(shape, "h2o-recall", max_kv)), shape, "h2o")


def kv_bytes(row: dict) -> float:
    """The session's KV bytes at its largest (cache/budget.py, as allocated), default model:
    full holds the conversation; the others their bound whatever its length."""
    from cache.budget import session_bytes

    shape = default_shape()
    if row["policy"] == "full":
        return session_bytes(shape, "full", row["conversation_tokens"])
    return session_bytes(shape, row["policy"], row["max_kv"])


def table(rows: list[dict]) -> list[str]:
    full = next(r for r in rows if r["policy"] == "full")
    lines = [
        "| cache | max_kv | hits | recall (95% CI) | vs full's hits | KV MiB (bound) "
        "| conversation tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in rows:
        scored = r["policy"].startswith("h2o")
        name = f"{r['policy']} {r['score']}" if scored else r["policy"]
        kv = "" if r["policy"] == "full" else r["max_kv"]
        if (name, kv) in seen:
            continue
        seen.add((name, kv))
        lo, hi = wilson(r["hits"], r["samples"])
        share = r["hits"] / full["hits"] if full["hits"] else float("nan")
        lines.append(
            f"| {name} | {kv} | {r['hits']}/{r['samples']} | {r['recall']:.2f} "
            f"({lo:.2f}-{hi:.2f}) | {share:.2f} | {kv_bytes(r) / 2**20:.1f} "
            f"| {r['conversation_tokens']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--turns", type=int, default=3, help="essay passages between fact and question")
    p.add_argument("--filler-tokens", type=int, default=120)
    p.add_argument("--max-kv", type=int, nargs="+", default=[64, 128])
    p.add_argument("--rules", nargs="+", default=["mean", "attn"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = run(args)
    publish(
        "Recall through the server",
        f"Default model, greedy; {args.trials} trials per cache, each a document grown over "
        f"{args.turns + 2} requests to /v1/completions (a note, {args.turns} essay passages of "
        f"{args.filler_tokens} tokens, the question; bench/recall.py `--document`); a hit: "
        "the answer contains the number. "
        f"Machine: {machine()}.",
        command("bench.recall_grid", argv),
        table(rows),
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
