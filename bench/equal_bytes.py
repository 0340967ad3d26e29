"""Which policy loses least in the same memory: perplexity at equal bytes per conversation.

`auto` (cache/budget.py) walks a ladder of policies by the share of --kv-budget
each conversation gets. This measures the rungs against each other where the
choice is made: for each share, every candidate gets the largest max_kv that
fits it exactly as `serve` sizes it (`max_kv_within`, layer profile included),
then autoregressive perplexity on held-out essays (tokens from `--offset`) is
compared with the full cache. `--score` runs each candidate under each score rule
(the learned gates against `mean`, issue 66), `--text-file` on other text than the
essays (e.g. a report split: `python -m bench.splits --write /tmp/splits`).

    python -m bench.equal_bytes --out docs/equal_bytes.md     # ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.report import command, machine, publish

# label -> CacheSpec fields: the rungs `auto` may pick below the whole-context ones,
# and h2o-kvarn, the most tokens per byte once its dense pools (~3 MB here) are paid
CANDIDATES: dict[str, dict] = {
    "h2o-merge": {"policy": "h2o-merge"},
    "h2o-q8": {"policy": "h2o-q8"},
    "h2o-q4": {"policy": "h2o-q4"},  # rotated, its newest 16 tokens dense
    "h2o-q4 g32": {"policy": "h2o-q4", "group_size": 32},
    "h2o-kvarn": {"policy": "h2o-kvarn"},
    "h2o-kvarn k4v4": {"policy": "h2o-kvarn", "kvarn": "k4v4"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--share", nargs="+", default=["3MB", "12MB"], help="bytes per conversation")
    p.add_argument("--cases", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument(
        "--offset", type=int, default=None, help="tokens skipped first (essays: 100000, a file: 0)"
    )
    p.add_argument("--text-file", type=Path, default=None, help="text to read (default: essays)")
    p.add_argument(
        "--score",
        nargs="+",
        default=[None],
        help="score rules, each case under each (default: its own)",
    )
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def sized(model, shares_for, share: int, fields: dict) -> dict:
    """`fields` with the max_kv (and layer shares) `serve` would give them within `share`;
    `shares_for(policy)`: the model's layer profile, as `serve` loads it (or None)."""
    from cache.budget import Budget, fit_spec
    from models.shape import kv_shape

    policy, rest = fields["policy"], {k: v for k, v in fields.items() if k != "policy"}
    spec = fit_spec(kv_shape(model), Budget(share, 1), policy, shares_for=shares_for, **rest)
    return {**fields, "max_kv": spec.max_kv, "layer_shares": spec.layer_shares}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.eval_cli import _load
    from bench.ppl import nll_autoregressive, nll_one_shot, sample_windows
    from cache.budget import parse_bytes
    from models.loading import served_model_id
    from server.engine.layer_budgets import load_layer_profile

    began = time.time()
    model, tokenizer = _load(args.model)
    profile, _ = load_layer_profile("auto", model, served_model_id(args.model))
    shares_for = None if profile is None else profile.shares
    if args.offset is None:
        args.offset = 0 if args.text_file else 100_000
    tokens = sample_windows(
        tokenizer, args.samples, args.seq_len, args.text_file, offset=args.offset
    )
    full = nll_one_shot(model, tokens).mean().exp().item()
    lines = [
        "| share per conversation | policy | max_kv | compression | perplexity | vs full | "
        "eval s |",
        "|---|---|---|---|---|---|---|",
    ]
    for share_text in args.share:
        share = parse_bytes(share_text)
        for case, rule in [(c, r) for c in args.cases for r in args.score]:
            label = case if rule is None else f"{case} {rule}"
            try:
                kwargs = sized(model, shares_for, share, CANDIDATES[case])
            except ValueError as e:  # the share is below the policy's fixed pools
                lines.append(f"| {share_text} | {label} | does not fit: {e} | | | | |")
                print(f"{share_text} {label}: {e}", flush=True)
                continue
            if rule is not None:
                kwargs["score"] = rule
            t0 = time.perf_counter()
            ppl = nll_autoregressive(model, tokens, kwargs).mean().exp().item()
            secs = time.perf_counter() - t0
            print(f"{share_text} {label} max_kv {kwargs['max_kv']}: {ppl:.3f}", flush=True)
            profiled = " (layer profile)" if kwargs["layer_shares"] else ""
            lines.append(
                f"| {share_text} | {label}{profiled} | {kwargs['max_kv']} | "
                f"{args.seq_len / kwargs['max_kv']:.1f}x | {ppl:.3f} | "
                f"{100 * (ppl / full - 1):+.1f}% | {secs:.0f} |"
            )
    lines += ["", f"Full cache: {full:.3f}. {time.time() - began:.0f} s in all."]
    publish(
        "Policies at equal bytes per conversation",
        f"Model `{args.model}`, autoregressive (32-token prefill, then one token per step), "
        f"{args.samples} samples of {args.seq_len} tokens of "
        f"{args.text_file.name if args.text_file else 'the essays'} from token {args.offset} on. "
        "Each policy gets the largest max_kv that fits the share, as `serve` sizes it "
        "(cache/budget.py, the model's layer profile where the policy has one). "
        "`eval s` is the time of the whole perplexity run on this machine (packed caches "
        f"decode slower on CPU: docs/quantized.md). Machine: {machine()}.",
        command("bench.equal_bytes", argv),
        lines,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
