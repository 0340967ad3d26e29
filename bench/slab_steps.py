"""Where an H2O slab's decode step goes, against stock mlx-lm's one KVCache.

bench/batch_scaling.py gives whole-step rates; this splits them: every step timed on
its own (an eviction step shows as a slow one), the Python time that builds a step's
graph (a GPU waits on it when its kernels are short), and the ops a slab layer adds,
each at the slab's shapes. The slab runs both ways of writing a step's tokens
(H2OSlab.select_writes: scatter, the CPU's default, and select, the GPU's).

    python -m bench.slab_steps --synthetic llama-1b --dtype bfloat16 --rows 16   # GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial


def main(argv: list[str] | None = None) -> int:
    from bench.decode_speed import SHAPES, synthetic_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic", choices=SHAPES, default="llama-1b")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=48, help="three eviction cycles of 16")
    p.add_argument("--policy", default="h2o")
    p.add_argument(
        "--stagger",
        type=int,
        default=1,
        help="row r's prompt is r x this shorter: rows evict "
        "on different steps, as sessions of a server do (0: all in the same step)",
    )
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from cache import install_router, make_cache, uninstall_router
    from cache.batching.batch import batch_caches
    from cache.batching.h2o_slab import H2OSlab, slab_key
    from cache.compiled_decode import scatter_write, select_write
    from kernels.dispatch import sdpa_with_scores

    model = synthetic_model(args.synthetic, getattr(mx, args.dtype))
    vocab = SHAPES[args.synthetic][-1]
    ids = mx.random.randint(0, vocab, (args.rows, args.context), key=mx.random.key(0))

    def stock():
        uninstall_router(model)
        caches = make_prompt_cache(model)
        return (lambda: caches), model(ids, cache=caches)

    def slab(select_writes: bool):
        install_router(model)
        sessions = [make_cache(model, args.policy, max_kv=256) for _ in range(args.rows)]
        last = mx.concatenate(
            [
                model(ids[r : r + 1, : args.context - r * args.stagger], cache=c)[:, -1:]
                for r, c in enumerate(sessions)
            ]
        )
        s = H2OSlab(slab_key(sessions[0]))
        s.select_writes = select_writes
        s.join(list(enumerate(sessions)))
        return partial(batch_caches, [], s), last

    print(
        f"{args.synthetic} {args.dtype}, {args.rows} rows of {args.context} tokens, "
        f"device {mx.default_device()}"
    )
    variants = [
        ("stock", stock),
        ("slab, scatter writes", partial(slab, False)),
        ("slab, select writes", partial(slab, True)),
    ]
    for name, make in variants + variants[::-1]:
        caches, logits = make()
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(token)
        builds, walls = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            token = mx.argmax(model(token, cache=caches())[:, -1], axis=-1)[:, None]
            t1 = time.perf_counter()
            mx.eval(token)
            builds.append(t1 - t0)
            walls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(args.steps):  # pipelined, as served
            following = mx.argmax(model(token, cache=caches())[:, -1], axis=-1)[:, None]
            mx.async_eval(following)
            mx.eval(token)
            token = following
        mx.eval(token)
        piped = (time.perf_counter() - t0) / args.steps
        ms = sorted(w * 1e3 for w in walls[1:])
        print(
            f"{name}: synced step median {statistics.median(ms):.2f} ms, slowest 3 "
            f"{', '.join(f'{w:.1f}' for w in ms[-3:])}; graph build median "
            f"{statistics.median(builds) * 1e3:.2f} ms, max {max(builds) * 1e3:.1f}; "
            f"pipelined {piped * 1e3:.2f} ms = {args.rows / piped:.0f} tok/s"
        )

    # One layer's ops at the slab's shapes.
    hidden, _, heads, kv_heads, _, _ = SHAPES[args.synthetic]
    B, D, S, dt = args.rows, hidden // heads, 257, getattr(mx, args.dtype)
    q = mx.random.normal((B, heads, 1, D)).astype(dt)
    k, v = (mx.random.normal((B, kv_heads, S, D)).astype(dt) for _ in range(2))
    held = mx.arange(S)[None] < mx.array([200 + r for r in range(B)])[:, None]
    mask = held[:, None, None]
    at = mx.array([200 + r for r in range(B)])
    scores = mx.random.uniform(shape=(B, kv_heads, S))
    rule = make_cache(model, args.policy, max_kv=256)[0].score_rule
    _, logits = sdpa_with_scores(q, k, v, D**-0.5, mask)
    mx.eval(q, k, v, mask, scores, logits)

    taken = mx.arange(S)[None, None] == at.reshape(B, 1, 1)
    new = q[:, :kv_heads]

    ops = {
        "mx.fast sdpa, bool mask": lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=D**-0.5, mask=mask
        ),
        "sdpa_with_scores (dispatcher), mask": lambda: sdpa_with_scores(q, k, v, D**-0.5, mask),
        "scatter write, one K buffer": lambda: scatter_write(
            mx.broadcast_to(at.reshape(B, 1, 1), (B, kv_heads, 1)), k, new
        ),
        "select write, one K buffer": lambda: select_write(taken, k, new),
        "score accumulate + where": lambda: mx.where(
            held[:, None], rule.accumulate(scores, logits, kv_heads), 0.0
        ),
        "argmax of a free-slot mask": lambda: mx.argmax(~held, axis=-1),
        "argpartition [B, H, 257]": lambda: mx.argpartition(-scores, kth=240, axis=-1),
    }
    n = 64
    for name, op in ops.items():
        for _ in range(3):
            mx.eval(op())
        t0 = time.perf_counter()
        mx.eval([op() for _ in range(n)])
        print(f"op {name}: {(time.perf_counter() - t0) / n * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
