"""Per-layer max_kv from a layer profile vs the same tokens split evenly, on held-out text.

The profile (cache/layer_profiles.py) is measured on Python's reference documentation;
this evaluates it on essay text far from anything tuned on (tokens from `--offset`),
autoregressive, each policy uniform and profiled at the same total of cached tokens,
with the rotating window beside them. Also prints the profile itself.

    python -m bench.layer_budgets --out docs/layer_budgets.md     # ~30 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.report import command, machine, publish
from bench.rules_grid import run, table


def profile_rows(model_name: str, max_kvs: list[int]) -> list[str]:
    from bench.eval_cli import _load
    from config.cache_spec import CacheSpec
    from models.loading import served_model_id
    from server.engine.layer_budgets import load_layer_profile

    model, _ = _load(model_name)
    profile, why = load_layer_profile("auto", model, served_model_id(model_name))
    if profile is None:
        raise SystemExit(f"no layer profile for {model_name}: {why}")
    policies = list(profile.sensitivity)
    head = "| layer | " + " | ".join(
        f"{p}: NLL increase alone | share | max_kv at {', '.join(map(str, max_kvs))}"
        for p in policies
    )
    lines = [
        f"Profile: {why}; calibration {profile.calibration}.",
        "",
        head + " |",
        "|---" * (1 + 3 * len(policies)) + "|",
    ]
    sizes = {
        (p, k): CacheSpec(p, k, layer_shares=profile.shares(p)).layer_sizes()
        for p in policies
        for k in max_kvs
    }
    for layer in range(len(model.layers)):
        cells = []
        for p in policies:
            s, share = profile.sensitivity[p][layer], profile.shares(p)[layer]
            cells += [
                "" if s is None else f"{s:+.4f}",
                "" if share is None else f"{share:.2f}",
                ", ".join(str(sizes[(p, k)][layer]) for k in max_kvs),
            ]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--policies", nargs="+", default=["h2o", "h2o-merge"])
    p.add_argument("--max-kv", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-len", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--offset", type=int, default=100_000, help="essay tokens skipped first")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    common = [
        "--model", args.model, "--max-kv", *map(str, args.max_kv),
        "--seq-len", *map(str, args.seq_len), "--samples", str(args.samples),
        "--offset", str(args.offset), "--score", "mean", "--full-one-shot",
    ]  # fmt: skip
    rows = run(["--policy", "full", "rotating", *common])
    rows += run(["--policy", *args.policies, "--layer-budgets", "uniform", "auto", *common])
    publish(
        "Per-layer budgets from a layer profile, on held-out text",
        f"Model `{args.model}`, autoregressive, {args.samples} essay samples of "
        f"{max(args.seq_len)} tokens from token {args.offset} on (shorter lengths are their "
        "prefixes), `heavy` preset, `mean` scores; `profiled`: each layer's max_kv from the "
        "model's layer profile, the same tokens in all as uniform. Perplexity increase over "
        f"the full cache (ratio to the rotating window's). Machine: {machine()}.",
        command("bench.layer_budgets", argv),
        [*table(rows), "", *profile_rows(args.model, args.max_kv)],
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
