"""Peak memory of one conversation by context length: full, rotating, h2o and h2o-q8.

Each case runs in a fresh process (so its RSS peak is its own): load the default
model, build the cache, prefill `context` essay tokens in `--chunk`-token forward
passes (as the server does), decode `--decode` tokens, then report MLX's peak
memory (`mx.get_peak_memory`: every array alive at once, weights included), the
process's peak RSS, and the cache's own bytes. Bounded policies use max_kv 512.
Goal (issue 10): h2o's peak at or below the full cache's at every context >= 1k,
and flat in context: peak(8k) - peak(1k) under 10% of the full cache's growth.

    python -m bench.memory --out docs/memory.md
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.report import command, machine, publish

POLICIES = ("full", "rotating", "h2o", "h2o-q8")
MIB = 2**20


def measure(policy: str, context: int, max_kv: int, chunk: int, decode: int) -> dict:
    """One case, in this process."""
    import mlx.core as mx

    from bench.text import essay_token_ids
    from cache import cache_usage, make_cache
    from models.loading import load_model

    model, tokenizer = load_model("default")
    ids = essay_token_ids(tokenizer, context + decode)
    caches = (
        make_cache(model, policy, max_kv=max_kv) if policy != "full" else make_cache(model, "full")
    )
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for start in range(0, context, chunk):
        model(mx.array(ids[start : min(context, start + chunk)])[None], cache=caches)
        mx.eval([c.state for c in caches])
    prefill_s = time.perf_counter() - t0
    for t in ids[context : context + decode]:
        mx.eval(model(mx.array([[t]]), cache=caches))
    _, stored, nbytes = cache_usage(caches)
    return {
        "policy": policy,
        "context": context,
        "mlx_peak": mx.get_peak_memory(),
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cache_bytes": nbytes,
        "stored_tokens": stored,
        "prefill_tok_s": context / prefill_s,
    }


def run_case(policy: str, context: int, args) -> dict:
    """`measure` in a fresh interpreter; its JSON line back."""
    flags = ["--max-kv", args.max_kv, "--chunk", args.chunk, "--decode", args.decode]
    cmd = [sys.executable, "-m", "bench.memory", "--case", policy, str(context), *map(str, flags)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(records: list[dict], contexts: list[int]) -> list[str]:
    rows = [
        "| policy | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
        "|---|" + "---|" * len(contexts),
    ]
    for policy in POLICIES:
        cells = []
        for c in contexts:
            r = next(r for r in records if r["policy"] == policy and r["context"] == c)
            mib = [r[k] / MIB for k in ("mlx_peak", "rss_peak", "cache_bytes")]
            cells.append(" / ".join(f"{x:.0f}" for x in mib))
        rows.append(f"| {policy} | " + " | ".join(cells) + " |")
    return rows


def verdict(records: list[dict], contexts: list[int]) -> list[str]:
    def peak(policy: str, c: int) -> int:
        return next(r["mlx_peak"] for r in records if r["policy"] == policy and r["context"] == c)

    lines = []
    at_or_below = [c for c in contexts if c >= 1024 and peak("h2o", c) <= peak("full", c)]
    lines.append(
        f"- h2o's MLX peak at or below full's at {len(at_or_below)} of "
        f"{sum(c >= 1024 for c in contexts)} contexts >= 1k "
        + ", ".join(f"{c}: {peak('h2o', c) / peak('full', c):.2f}x" for c in contexts if c >= 1024)
    )
    lo, hi = min(contexts), max(contexts)
    growth_full = peak("full", hi) - peak("full", lo)
    growth_h2o = peak("h2o", hi) - peak("h2o", lo)
    lines.append(
        f"- growth from {lo} to {hi} tokens: full {growth_full / MIB:+.0f} MiB, h2o "
        f"{growth_h2o / MIB:+.0f} MiB = {growth_h2o / growth_full:.1%} of full's (goal < 10%)"
    )
    return lines


def plot(records: list[dict], path: Path) -> Path:
    from bench.plots import _save, plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in POLICIES:
        points = sorted(
            (r["context"], r["mlx_peak"] / MIB) for r in records if r["policy"] == policy
        )
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_title("MLX peak memory, one conversation (max_kv 512)")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("MiB")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--max-kv", type=int, default=512)
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per forward pass")
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--case", nargs=2, metavar=("POLICY", "CONTEXT"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.case:
        policy, context = args.case
        print(json.dumps(measure(policy, int(context), args.max_kv, args.chunk, args.decode)))
        return 0
    began = time.perf_counter()
    records = [run_case(policy, c, args) for c in args.contexts for policy in POLICIES]
    png = plot(records, (args.out or Path("docs/memory.md")).with_suffix(".png"))
    body = [
        f"Machine: {machine()}. {time.perf_counter() - began:.0f} s in all. Float32 weights of "
        "the default model: 513 MiB.",
        "",
        "Each cell: MLX peak / process peak RSS / cache bytes, in MiB.",
        "",
        *table(records, args.contexts),
        "",
        *verdict(records, args.contexts),
        "",
        f"![MLX peak memory by context]({png.name})",
    ]
    publish("Peak memory by context", __doc__.split("\n\n")[1], command("bench.memory", argv), body,
            args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
