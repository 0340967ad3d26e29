"""Prefill and decode speed of each cache policy at a long context, measured side by side.

Each round prefills the same essay context into a fresh cache for every policy
(512-token forward passes, timed), then times `--steps` single-token decode
steps. "stock mlx-lm full" is mlx-lm's own cache (`make_prompt_cache`) and
attention, with this project's router uninstalled. Rounds interleave the
policies so machine noise hits them alike; ratios are taken within a round and
the median over rounds is reported, in wall time and in process CPU time.

    python -m bench.decode_speed --context 2048 --rounds 5 --out docs/decode_speed.md

`--synthetic SHAPE` times a randomly initialised llama of a named shape instead of a
real model (speed does not depend on the weights' values), for a machine where no model
file can travel (a lent GPU). `--kernel` picks the scored layers' attention backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from bench.report import command, machine, publish
from cache import configure, make_cache, uninstall_router
from config.cache_spec import CacheSpec, default_evict_batch
from kernels import BACKEND_NAMES

STOCK = "stock mlx-lm full"

# Llama shapes for --synthetic: (hidden, layers, query heads, KV heads, MLP width, vocab).
SHAPES = {
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),
}


def cases(context: int, max_kv: int) -> list[tuple[str, dict | None, str | None]]:
    """(label, make_cache kwargs (None: mlx-lm's own), label of its baseline)."""
    roomy = context + 1024  # more than prefill and decode ever store: nothing is evicted
    batch = default_evict_batch(max_kv, CacheSpec("h2o", max_kv).segments().heavy)
    h2o, rotating = f"h2o {max_kv}, evicting (batch {batch})", f"rotating {max_kv}"
    return [
        (STOCK, None, None),
        ("full", {"policy": "full"}, STOCK),
        (f"h2o, no eviction (max_kv {roomy})", {"policy": "h2o", "max_kv": roomy}, STOCK),
        (rotating, {"policy": "rotating", "max_kv": max_kv}, None),
        (h2o, {"policy": "h2o", "max_kv": max_kv}, rotating),
        # score rule learned: mean's rank times gates of the held K/V at each eviction
        (
            f"h2o {max_kv} learned, evicting",
            {"policy": "h2o", "max_kv": max_kv, "score": "learned"},
            h2o,
        ),  # fmt: skip
        (f"h2o-merge {max_kv}, evicting", {"policy": "h2o-merge", "max_kv": max_kv}, h2o),
        (f"h2o-q8 {max_kv}, evicting", {"policy": "h2o-q8", "max_kv": max_kv}, h2o),
        (
            f"h2o-q8 {max_kv} learned, evicting",
            {"policy": "h2o-q8", "max_kv": max_kv, "score": "learned"},
            f"h2o-q8 {max_kv}, evicting",
        ),  # fmt: skip
        (f"h2o-recall {max_kv}, evicting", {"policy": "h2o-recall", "max_kv": max_kv}, h2o),
        (f"h2o-q4 {max_kv}, evicting", {"policy": "h2o-q4", "max_kv": max_kv}, h2o),
        (f"h2o-kvarn {max_kv}, evicting", {"policy": "h2o-kvarn", "max_kv": max_kv}, h2o),
        (
            f"h2o {max_kv}, evicting 1 per step",
            {"policy": "h2o", "max_kv": max_kv, "evict_batch": 1},
            rotating,
        ),
    ]


def only(grid: list, policies: list[str] | None) -> list:
    """The rows of these policies and the rows they are compared with (None: all)."""
    if not policies:
        return grid
    picked = [row for row in grid if row[1] and row[1]["policy"] in policies]
    bases = {base for _, _, base in picked}
    while True:  # and the bases' own bases
        more = {b for label, _, b in grid if label in bases and b and b not in bases}
        if not more:
            break
        bases |= more
    return [row for row in grid if row in picked or row[0] in bases]


def synthetic_model(shape: str, dtype: mx.Dtype) -> llama.Model:
    """A llama of a named shape with mlx's random initialisation, cast to `dtype`."""
    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES[shape]
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=mlp,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def speeds(
    model, context: mx.array, steps: int, cache_kwargs: dict | None, pipelined: bool = False
) -> dict:
    """Prefill and decode tok/s (wall and CPU time) of one fresh cache."""
    if cache_kwargs is None:
        uninstall_router(model)  # mlx-lm exactly as it ships
        caches = make_prompt_cache(model)
    else:
        caches = make_cache(model, **cache_kwargs)
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, context.size, 512):
        model(context[None, start : start + 512], cache=caches)
        mx.eval([c.state for c in caches])
    prefill = (
        context.size / (time.perf_counter() - wall),
        context.size / (time.process_time() - cpu),
    )
    token = context[-1:].reshape(1, 1)
    logits = model(token, cache=caches)  # warm-up step, not timed
    mx.eval(logits)
    wall, cpu = time.perf_counter(), time.process_time()
    if pipelined:  # as mlx-lm's generate_step and the server: build step n+1, then wait for n
        token = mx.argmax(logits[:, -1], axis=-1).reshape(1, 1)
        for _ in range(steps):
            following = mx.argmax(model(token, cache=caches)[:, -1], axis=-1).reshape(1, 1)
            mx.async_eval(following)
            token.item()
            token = following
        token.item()
    else:
        for _ in range(steps):
            token = mx.argmax(logits[:, -1], axis=-1).reshape(1, 1)
            logits = model(token, cache=caches)
            mx.eval(logits)
    decode = (steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu))
    return {
        "prefill": prefill[0],
        "prefill_cpu": prefill[1],
        "decode": decode[0],
        "decode_cpu": decode[1],
    }


def ratio(tps: dict, label: str, base: str, key: str) -> str:
    per_round = [a[key] / b[key] for a, b in zip(tps[label], tps[base], strict=True)]
    return f"{statistics.median(per_round):.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--synthetic", choices=SHAPES, help="random weights of this shape, no --model")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--kernel", default="auto", choices=BACKEND_NAMES, help="scored attention")
    p.add_argument("--context", type=int, default=2048, help="tokens in the cache before decoding")
    p.add_argument("--max-kv", type=int, default=256, help="bounded caches' size")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    p.add_argument("--policies", nargs="+", help="only these policies' rows (and their bases)")
    p.add_argument(
        "--pipelined",
        action="store_true",
        help="decode as generate_step and the server do: the next step is queued "
        "(mx.async_eval) before waiting for this one, so host work overlaps the device's",
    )
    args = p.parse_args(argv)

    configure(backend=args.kernel)
    if args.synthetic:
        model = synthetic_model(args.synthetic, getattr(mx, args.dtype))
        context = mx.random.randint(
            0, SHAPES[args.synthetic][-1], (args.context,), key=mx.random.key(0)
        )
        what = f"Synthetic `{args.synthetic}` (random weights, {args.dtype})"
    else:
        from bench.text import essay_token_ids
        from models.loading import load_model

        model, tokenizer = load_model(args.model)
        context = mx.array(essay_token_ids(tokenizer, args.context))
        what = f"Model `{args.model}`"
    grid = only(cases(args.context, args.max_kv), args.policies)
    tps: dict[str, list[dict]] = {label: [] for label, _, _ in grid}
    for r in range(args.rounds):
        for label, kwargs, _ in grid:
            tps[label].append(speeds(model, context, args.steps, kwargs, args.pipelined))
            print(f"round {r + 1}: {label}: {tps[label][-1]}", file=sys.stderr)

    rows = [
        "| cache | prefill tok/s | ratio (wall / CPU) | decode tok/s | ratio (wall / CPU) | vs |",
        "|---|---|---|---|---|---|",
    ]
    for label, _, base in grid:
        med = {k: statistics.median(x[k] for x in tps[label]) for k in ("prefill", "decode")}
        pre = dec = ""
        if base:
            pre = f"{ratio(tps, label, base, 'prefill')} / {ratio(tps, label, base, 'prefill_cpu')}"
            dec = f"{ratio(tps, label, base, 'decode')} / {ratio(tps, label, base, 'decode_cpu')}"
        speeds_ = f"{med['prefill']:.0f} | {pre} | {med['decode']:.2f} | {dec}"
        rows.append(f"| {label} | {speeds_} | {base or ''} |")
    publish(
        "Prefill and decode speed by cache policy",
        f"{what}, {args.context} tokens of context (prefilled in 512-token passes), "
        f"{args.steps} timed decode steps{' (pipelined)' if args.pipelined else ''}, "
        f"{args.rounds} interleaved rounds, scored attention "
        f"on kernel backend `{args.kernel}`; ratio = median of per-round ratios. "
        f"Machine: {machine()}.",
        command("bench.decode_speed", argv),
        rows,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
