"""Decode variants, A/B on the same caches: one softmax over every part vs a softmax per
part merged by log-sum-exp (`--compare parts`), 8-/4-bit keys read as bytes vs
mx.quantized_matmul (`--compare bytes`), and each step's scores computed with it vs left
lazy until an eviction reads them (`--compare scores`).

Packed H2O caches attend in parts (the dense sink pool, the packed rest; a mixed
cache's two widths). cache/attention.py takes one softmax over all parts' logits
for a decode query on the reference backend (`_joint_decode`); the alternative is
each part on its own, merged by log-sum-exp. On the CPU the reference reads 8-bit
keys of one group per row as bytes in a dense matmul, and 4-bit ones as nibbles from a
few sessions on (kernels/reference.py, `_byte_matmul_t`); the alternative is MLX's
quantized_matmul. Both variants run on the SAME caches after one prompt, alternating
every round (A, B, B, A, ...), wall and process CPU time. `--rows N`: N sessions (each
its own passage) decoding together in one H2O slab, as the server batches them.

    python -m bench.decode_parts --out docs/decode_parts.md     # ~4 min on 2 cores
    python -m bench.decode_parts --compare bytes --out docs/decode_bytes.md
    python -m bench.decode_parts --compare bytes --rows 8 --context 300 \
        --out docs/decode_bytes_slab.md
    python -m bench.decode_parts --compare scores --context 2100 --steps 64 --rounds 4 \
        --out docs/score_chain.md

Each round also records how far the process's MLX memory (`mx.get_active_memory`) grew
over its steps: what a variant holds beyond the caches themselves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from bench.report import command, machine, publish

CASES = {  # label -> make_cache kwargs
    "h2o-q8, max_kv 256": {"policy": "h2o-q8", "max_kv": 256},
    "h2o-q8, max_kv 861": {"policy": "h2o-q8", "max_kv": 861},
    "h2o-q4 rotated, group 32, max_kv 256": {"policy": "h2o-q4", "max_kv": 256, "group_size": 32},
}
BYTE_CASES = {  # caches with 8- or 4-bit keys of one group per row (head dim 64, group 64)
    "h2o-q8, max_kv 256": {"policy": "h2o-q8", "max_kv": 256},
    "h2o-q8, max_kv 861": {"policy": "h2o-q8", "max_kv": 861},
    "h2o-mixed k8v4, max_kv 256": {"policy": "h2o-mixed", "max_kv": 256},
    "h2o-q4 (rotated, dense tail), max_kv 256": {"policy": "h2o-q4", "max_kv": 256},
}
SCORE_CASES = {  # an eviction every 16 (max_kv 256), 128 (2048) or 64 (h2o-kvarn) steps
    "h2o, max_kv 256": {"policy": "h2o", "max_kv": 256},
    "h2o, max_kv 2048": {"policy": "h2o", "max_kv": 2048},
    "h2o-q4, max_kv 256": {"policy": "h2o-q4", "max_kv": 256},
    "h2o-kvarn, max_kv 256": {"policy": "h2o-kvarn", "max_kv": 256},
}
# --compare -> (title, variant A, variant B, cases); the ratio is A / B
COMPARISONS = {
    "parts": ("Packed decode: one softmax over every part vs per part", "one softmax",
              "per part", CASES),
    "bytes": ("8- and 4-bit keys: read as bytes vs mx.quantized_matmul", "bytes",
              "quantized_matmul", BYTE_CASES),
    "scores": ("A decode step's scores: computed with it vs left lazy", "eager", "lazy",
               SCORE_CASES),
}  # fmt: skip


def timed(model, caches, y, steps: int) -> tuple[float, float, float, object]:
    """(tok/s wall, tok/s of process CPU time, MB the active memory grew, last tokens) over
    `steps` greedy steps; `caches()` gives each step's caches (a slab's are built per pass,
    as the server's)."""
    import mlx.core as mx

    wall, cpu = time.perf_counter(), time.process_time()
    start = most = mx.get_active_memory()
    for _ in range(steps):
        y = mx.argmax(model(y, cache=caches())[:, -1], axis=-1)[:, None]
        mx.eval(y)
        most = max(most, mx.get_active_memory())
    # What the steps left lazy (scores no output needed) is this variant's work too.
    mx.eval([c.scores for c in caches() if getattr(c, "scores", None) is not None])
    rows = y.shape[0]
    return (
        rows * steps / (time.perf_counter() - wall),
        rows * steps / (time.process_time() - cpu),
        (most - start) / 1e6,
        y,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--compare", choices=list(COMPARISONS), default="parts")
    p.add_argument("--rows", type=int, default=1, help="sessions decoding in one H2O slab")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    title, name_a, name_b, cases = COMPARISONS[args.compare]

    import mlx.core as mx

    from bench.text import essay_token_ids
    from cache import make_cache
    from cache.attention import ATTENTION, ScoredAttention
    from cache.batching.batch import batch_caches
    from cache.batching.h2o_slab import H2OSlab, slab_key
    from kernels import reference
    from models.loading import load_model

    model, tokenizer = load_model("default")
    ids = essay_token_ids(tokenizer, args.context * args.rows)

    def prefilled(kwargs: dict):
        """(each step's caches, the next tokens) of args.rows sessions after their prompts
        (a passage each, 512-token chunks), in one H2O slab when several."""
        sessions, lasts = [], []
        for r in range(args.rows):
            caches = make_cache(model, **kwargs)
            prompt = mx.array(ids[r * args.context : (r + 1) * args.context])[None]
            for start in range(0, args.context, 512):
                logits = model(prompt[:, start : start + 512], cache=caches)
                mx.eval(logits)
            sessions.append(caches)
            lasts.append(logits[:, -1])
        y = mx.argmax(mx.concatenate(lasts), axis=-1)[:, None]
        if args.rows == 1:
            return (lambda: sessions[0]), y
        slab = H2OSlab(slab_key(sessions[0]))
        slab.join(list(enumerate(sessions)))
        return partial(batch_caches, [], slab), y

    joint, as_bytes = ScoredAttention._joint_softmax, reference._byte_matmul_t
    nibbles_from = reference.NIBBLE_KEYS_FROM_BATCH

    def per_part(self, queries, parts) -> bool:
        return False

    def quantized_matmul(x, packed, bits):
        return mx.quantized_matmul(x, *packed, transpose=True, group_size=x.shape[-1], bits=bits)

    def use(name: str) -> None:
        ScoredAttention._joint_softmax = per_part if name == "per part" else joint
        reference._byte_matmul_t = quantized_matmul if name == "quantized_matmul" else as_bytes
        # "bytes" reads 4-bit keys as nibbles at any batch (the server: from a few rows on)
        reference.NIBBLE_KEYS_FROM_BATCH = 1 if name == "bytes" else nibbles_from
        ATTENTION.eager_scores = name != "lazy"

    lines = [
        f"| cache | {name_a} tok/s | {name_b} tok/s | ratio (median) | per-round ratios "
        f"| CPU-time ratio (median) | memory growth per round, MB ({name_a} / {name_b}) |",
        "|---|---|---|---|---|---|---|",
    ]
    try:
        for label, kwargs in cases.items():
            caches, y = prefilled(kwargs)
            got: dict[str, list[tuple[float, float, float]]] = {name_a: [], name_b: []}
            for r in range(args.rounds):
                for name in (name_a, name_b) if r % 2 == 0 else (name_b, name_a):
                    use(name)
                    wall, cpu, grew, y = timed(model, caches, y, args.steps)
                    got[name].append((wall, cpu, grew))
            ratios = [a[0] / b[0] for a, b in zip(got[name_a], got[name_b], strict=True)]
            cpu = [a[1] / b[1] for a, b in zip(got[name_a], got[name_b], strict=True)]
            lines.append(
                f"| {label} | {statistics.median(w for w, *_ in got[name_a]):.2f} | "
                f"{statistics.median(w for w, *_ in got[name_b]):.2f} | "
                f"{statistics.median(ratios):.3f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                f"{statistics.median(cpu):.3f} | "
                f"{max(g for *_, g in got[name_a]):.1f} / {max(g for *_, g in got[name_b]):.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        ScoredAttention._joint_softmax, reference._byte_matmul_t = joint, as_bytes
        reference.NIBBLE_KEYS_FROM_BATCH = nibbles_from
        ATTENTION.eager_scores = True
    publish(
        title,
        f"Default model, {args.rows} session(s) in one H2O slab, a {args.context}-token "
        "prompt each in 512-token chunks, then "
        f"{args.rounds} rounds of {args.steps} greedy decode steps per variant on the same "
        f"caches, alternating which goes first; ratio = {name_a} / {name_b}. "
        f"Machine: {machine()}.",
        command("bench.decode_parts", argv),
        lines,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
