"""Eviction rules on one grid: rule x max_kv x sequence length, against the rotating window.

Autoregressive (one token per step, eviction exactly as in generation; the full
cache is its exact one-shot equivalent). Each shorter length is the prefix of
the longest samples (the computation is causal), so one run per cache gives the
whole row. The ratio column is (rule's increase over full) / (rotating's): the
issue's goal is <= 0.4 at 16x compression, <= 0.3 at 8x, no loss at 4x.

    python -m bench.rules_grid --out docs/rules.md            # ~80 min on 2 cores
    python -m bench.rules_grid --max-kv 64 --seq-len 512 1024 --samples 3   # screening
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.eval_cli import eval_records
from bench.report import command, machine, publish

RULES = ["attn", "mean", "tova", "snap", "value", "learned"]
ADAPTIVE_RULES = ["mean"]  # h2o-ada at the rule that wins plain h2o (its cost is 3x attention)
MERGE_RULES = ["mean"]  # h2o-merge: the same choice of who leaves, leavers merged, not dropped
PROFILED = ["h2o", "h2o-merge"]  # per-layer max_kv from the model's layer profile


def run(argv: list[str]) -> list[dict]:
    from server.cli import build_parser

    return eval_records(build_parser().parse_args(["eval", "ppl", *argv]))


def grid_rows(args: argparse.Namespace) -> list[dict]:
    common = [
        "--max-kv", *map(str, args.max_kv), "--seq-len", *map(str, args.seq_len),
        "--samples", str(args.samples), "--full-one-shot",
        "--cases-per-pass", str(args.cases_per_pass), "--preset", args.preset,
        *(["--text-file", str(args.text_file)] if args.text_file else []),
        *(["--model", args.model] if args.model else []),
    ]  # fmt: skip
    rows = run(["--policy", "full", "rotating", "h2o", "--score", *args.rules, *common])
    for policy, rules in (("h2o-ada", args.adaptive_rules), ("h2o-merge", args.merge_rules)):
        if rules:
            rows += run(["--policy", policy, "--score", *rules, *common])
    for extra in args.also:  # e.g. h2o-q8=mean,learned
        policy, _, rules = extra.partition("=")
        rows += run(["--policy", policy, "--score", *rules.split(","), *common])
    for policy in args.profiled:  # under the model's layer profile (cache/layer_profiles.py)
        only_profiled = ["--layer-budgets", "auto", "--score", args.profiled_rule]
        rows += run(["--policy", policy, *only_profiled, *common])
    return rows


def table(rows: list[dict]) -> list[str]:
    full = {r["seq_len"]: r["ppl"] for r in rows if r["policy"] == "full"}
    rot = {(r["max_kv"], r["seq_len"]): r["ppl"] for r in rows if r["policy"] == "rotating"}
    cases = sorted(
        {
            (r["policy"], r["score"], r.get("layers") or "")
            for r in rows
            if r["policy"] not in ("full", "rotating")
        }
    )
    lines = [
        "| max_kv | tokens | compression | rotating vs full | "
        + " | ".join(" ".join(filter(None, case)) + " vs full (ratio)" for case in cases)
        + " |",
        "|---" * (4 + len(cases)) + "|",
    ]
    best: dict[tuple[int, int], tuple[float, str]] = {}
    for kv, seq in sorted(rot):
        base, r_inc = full[seq], rot[(kv, seq)] / full[seq] - 1
        cells = []
        for case in cases:
            hit = [r for r in rows if (r["policy"], r["score"], r.get("layers") or "",
                   r["max_kv"], r["seq_len"]) == (*case, kv, seq)]  # fmt: skip
            inc = hit[0]["ppl"] / base - 1
            ratio = inc / r_inc if r_inc > 0 else float("nan")
            cells.append(f"{100 * inc:+.1f}% ({ratio:.2f})")
            if (kv, seq) not in best or ratio < best[(kv, seq)][0]:
                best[(kv, seq)] = (ratio, " ".join(filter(None, case)))
        lines.append(
            f"| {kv} | {seq} | {seq // kv}x | {100 * r_inc:+.1f}% | " + " | ".join(cells) + " |"
        )
    lines += ["", "Best per cell (ratio to rotating's increase; goal <= 0.4 at 16x, <= 0.3 at 8x):"]
    for (kv, seq), (ratio, name) in sorted(best.items()):
        lines.append(f"- max_kv {kv}, {seq} tokens ({seq // kv}x): {name}, {ratio:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-kv", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seq-len", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--rules", nargs="+", default=RULES)
    p.add_argument("--adaptive-rules", nargs="*", default=ADAPTIVE_RULES)
    p.add_argument("--merge-rules", nargs="*", default=MERGE_RULES)
    p.add_argument(
        "--profiled",
        nargs="*",
        default=PROFILED,
        help="policies also run under the model's layer profile (--layer-budgets auto)",
    )
    p.add_argument("--profiled-rule", default="mean", help="their score rule")
    p.add_argument(
        "--also",
        nargs="*",
        default=[],
        help="more policies and their rules, POLICY=RULE[,RULE] (e.g. h2o-q8=mean,learned)",
    )
    p.add_argument(
        "--text-file",
        type=Path,
        default=None,
        help="the text (default: the essays; a split: python -m bench.splits --write DIR)",
    )
    p.add_argument("--model", default=None, help="as for eval ppl (default: the default model)")
    p.add_argument(
        "--cases-per-pass",
        type=int,
        default=8,
        help="caches run as sessions of one batched pass (eval ppl --cases-per-pass)",
    )
    p.add_argument("--preset", default="heavy", help="the H2O caches' segments (eval ppl --preset)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = grid_rows(args)
    publish(
        "Eviction rules: rule x max_kv x sequence length",
        f"Model {args.model or 'default'}, autoregressive, {args.samples} samples of "
        f"{max(args.seq_len)} tokens of {args.text_file.name if args.text_file else 'the essays'}"
        f" (shorter lengths are their prefixes), `{args.preset}` preset, perplexity increase "
        "over the full cache, and in parentheses its ratio to the rotating window's increase "
        f"at the same max_kv and length. Machine: {machine()}.",
        command("bench.rules_grid", argv),
        table(rows),
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
