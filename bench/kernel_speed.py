"""Decode attention time per kernel backend: dense, fused quantized, dequantize-then-attend.

One decode step of one layer (L_q = 1, GQA 9:3 query:KV heads, head dim 64: the
default model's shape) at a few cache lengths, for every backend available here.
"fused" reads the packed K/V directly; "dequantize + attend" first rebuilds float K/V
with `mx.dequantize` and then runs the dense kernel, as a quantized cache would without
a fused kernel. Cases interleave within a round; the median over rounds is reported.

    python -m bench.kernel_speed --out docs/kernel_speed.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from bench.report import command, machine, publish
from kernels import available_backends
from kernels.dispatch import get_backend

N_Q_HEADS, N_KV_HEADS, HEAD_DIM, GROUP_SIZE = 9, 3, 64, 64


def make_cases(backend: str, L_k: int, dtype: mx.Dtype) -> dict[str, Callable[[], object]]:
    """label -> a thunk running one decode attention call (unevaluated)."""
    impl = get_backend(backend)
    q = mx.random.normal((1, N_Q_HEADS, 1, HEAD_DIM)).astype(dtype)
    k = mx.random.normal((1, N_KV_HEADS, L_k, HEAD_DIM)).astype(dtype)
    v = mx.random.normal((1, N_KV_HEADS, L_k, HEAD_DIM)).astype(dtype)
    scale = HEAD_DIM**-0.5
    cases: dict[str, Callable[[], object]] = {
        "dense": lambda: impl.dense(q, k, v, scale, None),
    }
    for bits in (8, 4):
        k_q = mx.quantize(k, group_size=GROUP_SIZE, bits=bits)
        v_q = mx.quantize(v, group_size=GROUP_SIZE, bits=bits)
        mx.eval(k_q, v_q)

        def fused(k_q=k_q, v_q=v_q, bits=bits):
            return impl.quantized(q, k_q, v_q, scale, None, GROUP_SIZE, bits)

        def dequantize_then_attend(k_q=k_q, v_q=v_q, bits=bits):
            kd = mx.dequantize(*k_q, group_size=GROUP_SIZE, bits=bits)
            vd = mx.dequantize(*v_q, group_size=GROUP_SIZE, bits=bits)
            return impl.dense(q, kd, vd, scale, None)

        cases[f"q{bits} fused"] = fused
        cases[f"q{bits} dequantize + attend"] = dequantize_then_attend
    mx.eval(q, k, v)
    return cases


def time_ms(run: Callable[[], object], iters: int) -> float:
    mx.eval(run())  # warm-up: compiles kernels, allocates buffers
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(run())
    return (time.perf_counter() - start) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=None, help="default: all available")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16"],
        default=None,
        help="default: float32 on CPU, float16 on a GPU",
    )
    p.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = p.parse_args(argv)

    backends = args.backends or available_backends()
    gpu = any(b != "reference" for b in backends)
    dtype = getattr(mx, args.dtype or ("float16" if gpu else "float32"))
    results: dict[tuple[str, int, str], list[float]] = {}
    for backend in backends:
        for L_k in args.lengths:
            cases = make_cases(backend, L_k, dtype)
            for r in range(args.rounds):
                for label, run in cases.items():
                    ms = time_ms(run, args.iters)
                    results.setdefault((backend, L_k, label), []).append(ms)
                    print(
                        f"{backend} L_k={L_k} round {r + 1}: {label}: {ms:.3f} ms", file=sys.stderr
                    )

    dtype_name = str(dtype).removeprefix("mlx.core.")
    rows = [
        "| backend | L_k | case | ms per call (median) | vs dense |",
        "|---|---|---|---|---|",
    ]
    for (backend, L_k, label), times in results.items():
        ms = statistics.median(times)
        dense = statistics.median(results[(backend, L_k, "dense")])
        rows.append(f"| {backend} | {L_k} | {label} | {ms:.3f} | {ms / dense:.2f}x |")
    publish(
        "Decode attention time per kernel backend",
        f"Machine: {machine()}, {dtype_name}; one layer, L_q 1, "
        f"{N_Q_HEADS}:{N_KV_HEADS} heads, head dim {HEAD_DIM}, group size {GROUP_SIZE}; "
        f"median of {args.rounds} rounds of {args.iters} calls.",
        command("bench.kernel_speed", argv),
        rows,
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
