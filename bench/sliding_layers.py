"""What a sliding-window layer should hold under a bounded cache: the measurement behind
cache/factory.py's choice, on a model with sliding-window layers (Gemma 3).

Global layers always get H2O at max_kv (attn, heavy). The sliding-window layers get,
per variant:
- `own-window`: their own window, as the model asks (not bounded by max_kv);
- `window-max-kv`: a sliding window of max_kv tokens, no sinks (make_cache, `rotating`);
- `h2o-in-window`: H2O at max_kv inside their window (make_cache, `h2o`);
- `rotating-sinks`: a max_kv window keeping `sink` first tokens (the global layers' `rotating`);
- `h2o-unwindowed`: H2O at max_kv that never drops tokens for leaving the window.
Perplexity is autoregressive (bench.ppl), over all tokens and over the tokens past
the model's window, where the variants differ most.

    python -m bench.sliding_layers --out docs/sliding_layers.md
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.ppl import nll_one_shot, nll_stepped, sample_windows
from bench.report import command, machine, publish
from cache import H2OKVCache, SinkRotatingKVCache, WindowedH2OKVCache, make_cache
from config.cache_spec import split_segments
from models.loading import load_model
from models.shape import layer_windows

UNBOUNDED = 2**30  # a "window" no token ever leaves (int32 positions)

VARIANTS = {
    "own-window": lambda m, w: SinkRotatingKVCache(max_size=w, keep=0),
    "window-max-kv": lambda m, w: SinkRotatingKVCache(max_size=m, keep=0),
    "h2o-in-window": lambda m, w: WindowedH2OKVCache(m, window=w),
    "rotating-sinks": lambda m, w: SinkRotatingKVCache(max_size=m, keep=split_segments(m).sink),
    "h2o-unwindowed": lambda m, w: WindowedH2OKVCache(m, window=UNBOUNDED),
}


def caches_for(model, variant: str, max_kv: int) -> list:
    caches = make_cache(model, "h2o", max_kv=max_kv)  # routes attention; globals: H2O
    for i, window in enumerate(layer_windows(model)):
        if window is not None:
            caches[i] = VARIANTS[variant](max_kv, window)
    assert any(isinstance(c, H2OKVCache) for c in caches)
    return caches


def ppl(nll: mx.array, start: int = 0) -> float:
    return math.exp(mx.mean(nll[:, start:]).item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--max-kv", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    model, tokenizer = load_model(args.model)
    windows = {w for w in layer_windows(model) if w is not None}
    if len(windows) != 1:
        raise SystemExit(f"{args.model} has sliding windows {sorted(windows)}: one size needed")
    window = windows.pop()
    tokens = sample_windows(tokenizer, args.samples, args.seq_len)
    full = nll_one_shot(model, tokens)
    rows = [("full cache", "", ppl(full), ppl(full, window), 0.0)]
    for max_kv in args.max_kv:
        for variant in args.variants:
            t0 = time.time()
            nll = nll_stepped(model, tokens, caches_for(model, variant, max_kv))
            rows.append((variant, str(max_kv), ppl(nll), ppl(nll, window), time.time() - t0))
            print(f"{variant} {max_kv}: {rows[-1][2]:.3f}", file=sys.stderr)

    base, base_late = rows[0][2], rows[0][3]
    body = [
        f"| sliding layers | max_kv | perplexity | vs full | tokens past {window} | vs full | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, kv, p_all, p_late, secs in rows:
        body.append(
            f"| {name} | {kv} | {p_all:.3f} | {100 * (p_all / base - 1):+.1f}% | "
            f"{p_late:.3f} | {100 * (p_late / base_late - 1):+.1f}% | {secs:.0f} |"
        )
    intro = (
        f"Model `{args.model}` (float32; {len(layer_windows(model))} layers, "
        f"{sum(w is not None for w in layer_windows(model))} with a {window}-token window); "
        f"{machine()}. {args.samples} essay samples of {args.seq_len} tokens (each starting "
        "with BOS), autoregressive perplexity (32-token prefill, then one token per step). "
        "Global layers: H2O at max_kv (attn, heavy) in every row but the first; the first "
        "column says what the sliding-window layers hold. `own-window` is not bounded by "
        "max_kv (it was the behaviour before every layer counted against the budget).\n\n"
        + __doc__.split("\n\n")[1]
    )
    publish(
        "Sliding-window layers under a bounded cache",
        intro,
        command("bench.sliding_layers", argv),
        body,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
