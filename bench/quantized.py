"""Quantized and KVarN caches: decode and prefill speed, bytes, perplexity.

One run, three parts, on the same model (`--cases` picks the caches, the first is
the baseline):
1. decode tok/s at `--context` tokens with max_kv `--max-kv`, per cache. Each
   cache is prefilled once; every round then times `--steps` decode steps per
   cache with the fused quantized kernel (reads packed K/V) and `--steps` with
   dequantize + the dense kernel, in alternating order, on that cache (full and
   kvarn keep growing, the others are bounded by max_kv); caches interleave
   within a round (order reversed every other round), each also timing a fresh
   `--prefill`-token prefill, and ratios vs the baseline are medians of
   per-round ratios;
2. bytes per cached token, from the caches' `nbytes` after those steps;
3. teacher-forced perplexity on essay text (`--ppl-samples` windows of
   `--ppl-tokens`, one token per step after a `--ppl-prompt`-token prompt,
   max_kv `--ppl-max-kv` so eviction runs), and the mean per-step
   KL(dense h2o || policy) of the next-token distribution.

    python -m bench.quantized --out docs/quantized.md
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.text import essay_token_ids
from cache import ATTENTION, cache_usage, configure, make_cache
from cache.budget import (
    ModelShape,
    bytes_per_token,
    cache_bytes,
    session_bytes,
)
from config.cache_spec import DEFAULT_MIXED, POLICIES
from kernels import select_backend
from models.loading import load_model

# name -> (label, make_cache kwargs); the first is the baseline.
CASES = {
    "h2o": ("h2o (dense)", {"policy": "h2o"}),
    "q8": ("h2o-q8", {"policy": "h2o-q8"}),
    "q4": ("h2o-q4 unrotated", {"policy": "h2o-q4", "rotate": False}),
    "q4-rot": ("h2o-q4 rotated", {"policy": "h2o-q4", "rotate": True}),
    "q4-rot-g32": (
        "h2o-q4 rotated, group 32",
        {"policy": "h2o-q4", "rotate": True, "group_size": 32},
    ),
    "q4-rot-g32-notail": (
        "h2o-q4 rotated, group 32, no dense tail",
        {"policy": "h2o-q4", "rotate": True, "group_size": 32, "dense_recent": 0},
    ),
    "k8v4": ("h2o-mixed = k8v4 (keys 8-bit, values 4-bit)", {"policy": "h2o-mixed"}),
    "k8v4-rot": ("h2o-mixed k8v4 rotated", {"policy": "h2o-mixed", "rotate": True}),
    "paper": ("mixed paper (heavy 8-bit, recent 4-bit)", {"policy": "h2o-mixed", "mixed": "paper"}),
    "dense-recent": (
        "mixed dense-recent (heavy 8-bit, recent dense)",
        {"policy": "h2o-mixed", "mixed": "dense-recent"},
    ),
    "full": ("full (mlx-lm KVCache, no eviction)", {"policy": "full"}),
    "kvarn": ("kvarn k4v2 (no eviction)", {"policy": "kvarn"}),
    "kvarn-k4v4": ("kvarn k4v4 (no eviction)", {"policy": "kvarn", "kvarn": "k4v4"}),
    "h2o-kvarn": ("h2o-kvarn k4v2", {"policy": "h2o-kvarn"}),
    "h2o-kvarn-k4v4": ("h2o-kvarn k4v4", {"policy": "h2o-kvarn", "kvarn": "k4v4"}),
    "h2o-kvarn-tile": (
        "h2o-kvarn k4v2, whole-tile eviction",
        {"policy": "h2o-kvarn", "kvarn_strategy": "tile"},
    ),
}
UNBOUNDED = ("full", "kvarn")  # no max_kv: they hold the whole context
PATHS = ("fused", "dequantize")


def timed_steps(model, caches, logits: mx.array, steps: int) -> tuple[float, mx.array]:
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(logits[:, -1], axis=-1).reshape(1, 1)
        logits = model(token, cache=caches)
        mx.eval(logits)
    return steps / (time.perf_counter() - start), logits


def prefilled(model, context: mx.array, kwargs: dict) -> tuple[list, mx.array]:
    """A cache holding `context`, and the logits of one more (untimed, warm-up) step."""
    caches = make_cache(model, **kwargs)
    for start in range(0, context.size, 512):
        mx.eval(model(context[None, start : start + 512], cache=caches))
    logits = model(context[-1:].reshape(1, 1), cache=caches)
    mx.eval(logits)
    return caches, logits


def decode_round(model, caches: list, logits: mx.array, steps: int, paths: tuple[str, ...]):
    """{path: tok/s} of `steps` decode steps per path on `caches`, and the last logits."""
    tps = {}
    try:
        for path in paths:
            configure(quantized_path="fused" if path == "dense" else path)
            tps[path], logits = timed_steps(model, caches, logits, steps)
    finally:
        configure(quantized_path="fused")
    return tps, logits


def teacher_forced(model, ids: mx.array, prompt: int, kwargs: dict) -> mx.array:
    """Next-token log-probabilities [B, T - prompt, vocab] for tokens prompt..T-1, one per step."""
    caches = make_cache(model, **kwargs)
    mx.eval(model(ids[:, : prompt - 1], cache=caches))
    out = []
    for t in range(prompt - 1, ids.shape[1] - 1):
        logits = model(ids[:, t : t + 1], cache=caches)[:, -1]
        out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(out[-1])
    return mx.stack(out, axis=1)


def timed_prefill(model, context: mx.array, kwargs: dict) -> float:
    """Seconds to prefill `context` into a fresh cache (512-token chunks, caches evaluated)."""
    caches = make_cache(model, **kwargs)
    start = time.perf_counter()
    for begin in range(0, context.size, 512):
        model(context[None, begin : begin + 512], cache=caches)
        mx.eval([c.state for c in caches])
    return time.perf_counter() - start


def measure_speed(model, context, cases, args):
    """Decode tok/s per (label, path), prefill seconds per label, caches after decoding."""
    tps: dict[tuple[str, str], list[float]] = {}
    prefill: dict[str, list[float]] = {}
    sessions = {}
    for label, kwargs in cases:
        sessions[label] = prefilled(model, context, with_max_kv(kwargs, args.max_kv))
        print(f"prefilled {label}", file=sys.stderr)
    for r in range(args.rounds):
        for label, kwargs in cases if r % 2 == 0 else cases[::-1]:
            packed = kwargs["policy"] not in ("h2o", "full")
            paths = (PATHS if r % 2 == 0 else PATHS[::-1]) if packed else ("dense",)
            caches, logits = sessions[label]
            got, logits = decode_round(model, caches, logits, args.steps, paths)
            sessions[label] = caches, logits
            for path, value in got.items():
                tps.setdefault((label, path), []).append(value)
                print(f"round {r + 1}: {label} [{path}]: {value:.2f} tok/s", file=sys.stderr)
            seconds = timed_prefill(
                model, context[: args.prefill], with_max_kv(kwargs, args.max_kv)
            )
            prefill.setdefault(label, []).append(seconds)
    return tps, prefill, sessions


def with_max_kv(kwargs: dict, max_kv: int) -> dict:
    return kwargs if kwargs["policy"] in UNBOUNDED else {**kwargs, "max_kv": max_kv}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-kv", type=int, default=256)
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", type=int, default=1024, help="tokens of the timed prefills")
    p.add_argument("--ppl-tokens", type=int, default=256)
    p.add_argument("--ppl-samples", type=int, default=2)
    p.add_argument("--ppl-prompt", type=int, default=32)
    p.add_argument("--ppl-max-kv", type=int, default=128)
    p.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, first = baseline: {list(CASES)}"
    )
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    began = time.perf_counter()
    cases = [CASES[name] for name in args.cases.split(",")]

    model, tokenizer = load_model(args.model)
    context = mx.array(essay_token_ids(tokenizer, args.context))

    # 1. decode and prefill speed, interleaved; 2. bytes per cached token of the same caches
    tps, prefill, sessions = measure_speed(model, context, cases, args)
    shape = ModelShape.of(model, element_bytes=4)
    held = {label: cache_usage(caches) for label, (caches, _) in sessions.items()}
    del sessions

    # 3. perplexity and KL vs dense h2o, teacher-forced
    n = args.ppl_tokens
    ids = essay_token_ids(tokenizer, args.context + n * args.ppl_samples)[args.context :]
    ids = mx.array(ids).reshape(args.ppl_samples, n)
    targets = ids[:, args.ppl_prompt :]
    ppl_cases = (
        cases
        if any(k["policy"] == "full" for _, k in cases)
        else [
            CASES["full"],
            *cases,
        ]
    )
    ppl, kl = {}, {}
    for label, kwargs in ppl_cases:
        logprobs = teacher_forced(model, ids, args.ppl_prompt, with_max_kv(kwargs, args.ppl_max_kv))
        nll = -mx.take_along_axis(logprobs, targets[..., None], axis=-1).mean()
        ppl[label] = math.exp(nll.item())
        if label == cases[0][0]:
            dense = logprobs
        if kwargs["policy"] != "full":
            kl[label] = (mx.exp(dense) * (dense - logprobs)).sum(-1).mean().item()
        print(f"ppl {label}: {ppl[label]:.3f}", file=sys.stderr)

    report = render(args, argv, began, cases, ppl_cases, tps, prefill, held, ppl, kl, shape)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


def render(args, argv, began, cases, ppl_cases, tps, prefill, held, ppl, kl, shape) -> str:
    base = cases[0][0]
    full_label = CASES["full"][0]
    rows = [
        "| cache | attention | decode tok/s (median) | vs dense h2o |",
        "|---|---|---|---|",
    ]
    for (label, path), values in tps.items():
        ratios = [a / b for a, b in zip(values, tps[(base, "dense")], strict=True)]
        rows.append(
            f"| {label} | {path} | {statistics.median(values):.2f} | "
            f"{statistics.median(ratios):.3f} |"
        )
    pre = [
        f"| cache | prefill of {args.prefill} tokens, s (median) | vs dense h2o |",
        "|---|---|---|",
    ]
    for label, values in prefill.items():
        ratios = [b / a for a, b in zip(values, prefill[base], strict=True)]
        pre.append(
            f"| {label} | {statistics.median(values):.2f} | {statistics.median(ratios):.3f} |"
        )
    float32_token = bytes_per_token(shape, "full")
    mem = [
        "| cache | tokens held | bytes per held token (all layers) | vs float32 K/V | "
        "vs dense h2o | cache/budget.py |",
        "|---|---|---|---|---|---|",
    ]
    # H2O caches are priced per slot: max_kv + 1 (the spare holds the newest token).
    base_per_token = held[base][2] / (args.max_kv + 1)
    for label, kwargs in cases:
        _, stored, nbytes = held[label]
        per_token = nbytes / (stored if kwargs["policy"] in UNBOUNDED else args.max_kv + 1)
        formula = budget_formula(shape, kwargs, stored, args.max_kv)
        mem.append(
            f"| {label} | {stored} | {per_token:.0f} | {per_token / float32_token:.3f} | "
            f"{per_token / base_per_token:.3f} | {'' if formula is None else f'{formula:.0f}'} |"
        )
    quality = [
        "| cache | perplexity | vs full | vs dense h2o | mean KL(dense h2o ‖ cache), nats/token |",
        "|---|---|---|---|---|",
    ]
    for label, _ in ppl_cases:
        quality.append(
            f"| {label} | {ppl[label]:.3f} | {ppl[label] / ppl[full_label] - 1:+.2%} | "
            f"{ppl[label] / ppl[base] - 1:+.2%} | "
            f"{'' if label not in kl else f'{kl[label]:.5f}'} |"
        )
    q = mx.zeros((1, 9, 1, 64))
    packed = mx.zeros((1, 3, args.max_kv, 16), dtype=mx.uint32)
    backend = select_backend(ATTENTION.backend, q, packed, None, group_size=64, bits=8)
    command = "python -m bench.quantized " + " ".join(argv if argv is not None else sys.argv[1:])
    return "\n".join(
        [
            "# Quantized and KVarN caches: speed, memory, perplexity",
            "",
            f"Command: `{command.strip()}` ({time.perf_counter() - began:.0f} s).",
            f"Model `{args.model}` (float32), machine {platform.machine()} {platform.system()}, "
            f"MLX {mx.__version__}, device {mx.default_device()}, quantized kernel backend "
            f"`{backend}` (KVarN tiles too). h2o-q*: mx.quantize, affine, group 64, "
            "scales float32; KVarN: float16 scales and Sinkhorn factors.",
            "",
            f"## Decode speed: {args.context} tokens of context, max_kv {args.max_kv}",
            "",
            f"{args.steps} timed steps per path, {args.rounds} interleaved rounds (order "
            "reversed every other round); `fused` = the quantized kernel reads packed K/V, "
            "`dequantize` = dequantize then the dense kernel. full and kvarn hold the whole "
            "context (no eviction). Ratio = median of per-round ratios to dense h2o.",
            "",
            *rows,
            "",
            "## Prefill speed",
            "",
            f"A fresh cache per round, {args.prefill} tokens in 512-token chunks, timed in "
            "the same rounds as decode. Ratio = dense h2o's time / the cache's (higher is faster).",
            "",
            *pre,
            "",
            "## Bytes per cached token",
            "",
            "From `nbytes` of the decode caches above, all buffers included (packed words, "
            "scales, biases, Sinkhorn factors, dense sink and tail pools, H2O scores and "
            "positions): H2O caches over their max_kv + 1 slots, full and kvarn over the "
            "tokens they hold (mlx-lm's KVCache allocates 256 tokens at a time). `vs float32 "
            "K/V` = against 2 x head_dim x 4 bytes per layer and KV head; the last column is "
            "cache/budget.py's price for the same cache (h2o-kvarn: at its peak, the most "
            "tiles, which it holds just before an eviction).",
            "",
            *mem,
            "",
            "## Perplexity",
            "",
            f"{args.ppl_samples} essay windows of {args.ppl_tokens} tokens (after the speed "
            "context), "
            f"{args.ppl_prompt}-token prompt, then teacher-forced one token per step; "
            f"max_kv {args.ppl_max_kv} for the evicting caches, heavy preset, `attn` scores.",
            "",
            *quality,
            "",
        ]
    )


def budget_formula(shape, kwargs: dict, stored: int, max_kv: int) -> float | None:
    """cache/budget.py's bytes per token for this cache (None: it prices another scheme).

    h2o-kvarn: its peak (max_kv + 1 tokens, most tiles) over max_kv + 1 slots, an upper
    bound of what it holds between evictions.
    """
    policy = kwargs["policy"]
    if kwargs.get("mixed", DEFAULT_MIXED) != DEFAULT_MIXED:
        return None
    if "kvarn" in POLICIES[policy].knobs:
        if kwargs.get("kvarn", "k4v2") != "k4v2":
            return None
        if not POLICIES[policy].bounded:
            return cache_bytes(shape, policy, stored) / stored
        return cache_bytes(shape, policy, max_kv) / (max_kv + 1)
    group_size = kwargs.get("group_size", 64)
    if POLICIES[policy].scored:  # per layer too: a packed cache's key centre, dense pools
        priced = session_bytes(
            shape, policy, max_kv, group_size=group_size, dense_recent=kwargs.get("dense_recent")
        )
        return priced / (max_kv + 1)
    return bytes_per_token(shape, policy, group_size=group_size)


if __name__ == "__main__":
    sys.exit(main())
