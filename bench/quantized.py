"""Quantized H2O caches: decode speed (fused vs dequantize-then-attend), bytes, perplexity.

One run, three parts, on the same model:
1. decode tok/s at `--context` tokens with max_kv `--max-kv`, per policy. Each
   policy's cache is prefilled once; every round then times `--steps` decode
   steps per policy with the fused quantized kernel (reads packed K/V) and
   `--steps` with mx.dequantize + the dense kernel, in alternating order, on
   that cache (bounded by max_kv, so later rounds cost the same); policies
   interleave within a round and ratios vs dense h2o are medians of per-round
   ratios;
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
from cache import ATTENTION, configure, make_cache
from cache.budget import ModelShape, bytes_per_token
from config.cache_spec import DEFAULT_MIXED, MIXED_SCHEMES, POLICIES
from kernels import select_backend
from server.models import load_model


def quantized_cases() -> list[tuple[str, dict]]:
    """(label, make_cache kwargs): dense h2o first (the baseline), then every quantized
    policy, then h2o-mixed's other layouts."""
    cases = [("h2o (dense)", {"policy": "h2o"})]
    for name, info in POLICIES.items():
        if not info.quantized:
            continue
        cases.append((f"{name} ({info.help})", {"policy": name}))
        if info.cache == "mixed":
            for scheme, what in MIXED_SCHEMES.items():
                if scheme != DEFAULT_MIXED:
                    cases.append((f"{name} {scheme} ({what})", {"policy": name, "mixed": scheme}))
    return cases


CASES = quantized_cases()
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-kv", type=int, default=256)
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ppl-tokens", type=int, default=256)
    p.add_argument("--ppl-samples", type=int, default=2)
    p.add_argument("--ppl-prompt", type=int, default=32)
    p.add_argument("--ppl-max-kv", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)
    began = time.perf_counter()

    model, tokenizer = load_model(args.model)
    context = mx.array(essay_token_ids(tokenizer, args.context))

    # 1. decode speed, interleaved; 2. bytes per cached token of the same caches
    tps: dict[tuple[str, str], list[float]] = {}
    sessions = {}
    for label, kwargs in CASES:
        sessions[label] = prefilled(model, context, {**kwargs, "max_kv": args.max_kv})
        print(f"prefilled {label}", file=sys.stderr)
    for r in range(args.rounds):
        for label, kwargs in CASES:
            quantized = kwargs["policy"] != "h2o"
            paths = (PATHS if r % 2 == 0 else PATHS[::-1]) if quantized else ("dense",)
            caches, logits = sessions[label]
            got, logits = decode_round(model, caches, logits, args.steps, paths)
            sessions[label] = caches, logits
            for path, value in got.items():
                tps.setdefault((label, path), []).append(value)
                print(f"round {r + 1}: {label} [{path}]: {value:.2f} tok/s", file=sys.stderr)
    # Per token slot: max_kv + 1 (the spare holds the newest token before eviction).
    per_token = {
        label: sum(c.nbytes for c in caches) / (args.max_kv + 1)
        for label, (caches, _) in sessions.items()
    }
    del sessions

    # 3. perplexity and KL vs dense h2o, teacher-forced
    n = args.ppl_tokens
    ids = essay_token_ids(tokenizer, args.context + n * args.ppl_samples)[args.context :]
    ids = mx.array(ids).reshape(args.ppl_samples, n)
    targets = ids[:, args.ppl_prompt :]
    ppl_cases = [("full", {"policy": "full"}), *CASES]
    ppl, kl = {}, {}
    for label, kwargs in ppl_cases:
        max_kv = {} if kwargs["policy"] == "full" else {"max_kv": args.ppl_max_kv}
        logprobs = teacher_forced(model, ids, args.ppl_prompt, {**kwargs, **max_kv})
        nll = -mx.take_along_axis(logprobs, targets[..., None], axis=-1).mean()
        ppl[label] = math.exp(nll.item())
        if label == CASES[0][0]:
            dense = logprobs
        if label != "full":
            kl[label] = (mx.exp(dense) * (dense - logprobs)).sum(-1).mean().item()
        print(f"ppl {label}: {ppl[label]:.3f}", file=sys.stderr)

    base = CASES[0][0]
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
    shape = ModelShape.of(model, element_bytes=4)
    mem = [
        "| cache | bytes per cached token (all layers) | vs dense h2o | cache/budget.py formula |",
        "|---|---|---|---|",
    ]
    for label, kwargs in CASES:
        # The formula describes h2o-mixed's default scheme only.
        own = kwargs.get("mixed", DEFAULT_MIXED) == DEFAULT_MIXED
        formula = bytes_per_token(shape, kwargs["policy"]) if own else None
        mem.append(
            f"| {label} | {per_token[label]:.0f} | {per_token[label] / per_token[base]:.3f} | "
            f"{'' if formula is None else f'{formula:.0f}'} |"
        )
    quality = [
        "| cache | perplexity | vs dense h2o | mean KL(dense h2o ‖ cache), nats/token |",
        "|---|---|---|---|",
    ]
    for label, _ in ppl_cases:
        quality.append(
            f"| {label} | {ppl[label]:.3f} | {ppl[label] / ppl[base] - 1:+.2%} | "
            f"{'' if label not in kl else f'{kl[label]:.5f}'} |"
        )
    q = mx.zeros((1, 9, 1, 64))
    packed = mx.zeros((1, 3, args.max_kv, 16), dtype=mx.uint32)
    backend = select_backend(ATTENTION.backend, q, packed, None, group_size=64, bits=8)
    command = "python -m bench.quantized " + " ".join(argv if argv is not None else sys.argv[1:])
    report = "\n".join(
        [
            "# Quantized H2O caches: speed, memory, perplexity",
            "",
            f"Command: `{command.strip()}` ({time.perf_counter() - began:.0f} s).",
            f"Model `{args.model}` (float32), machine {platform.machine()} {platform.system()}, "
            f"MLX {mx.__version__}, device {mx.default_device()}, quantized kernel backend "
            f"`{backend}`. Quantization: mx.quantize, affine, group 64, scales float32.",
            "",
            f"## Decode speed: {args.context} tokens of context, max_kv {args.max_kv}",
            "",
            f"{args.steps} timed steps per path, {args.rounds} interleaved rounds; `fused` = "
            "the quantized kernel reads packed K/V, `dequantize` = mx.dequantize then the "
            "dense kernel. Ratio = median of per-round ratios to dense h2o.",
            "",
            *rows,
            "",
            "## Bytes per cached token",
            "",
            f"From `nbytes` of the max_kv {args.max_kv} caches above (packed words, scales, "
            f"biases, H2O scores and positions), over their {args.max_kv + 1} token slots "
            "(the spare holds the newest token until eviction).",
            "",
            *mem,
            "",
            "## Perplexity",
            "",
            f"{args.ppl_samples} essay windows of {n} tokens (after the speed context), "
            f"{args.ppl_prompt}-token prompt, then teacher-forced one token per step; "
            f"max_kv {args.ppl_max_kv}, heavy preset, `attn` scores.",
            "",
            *quality,
            "",
        ]
    )
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
