"""Prefill and decode speed, memory and cache bytes against context length, per policy.

Each case walks one essay stream through a fresh cache: at every context
checkpoint L it prefills the tokens that bring the context to L (in chunks of
`prefill_step`, evaluating the caches but not the logits, as the server's
generation and mlx-lm's generate do) and times them, then runs one
untimed and `steps` timed single-token decode steps (the essay's next tokens,
teacher-forced). So `prefill_tps` at L is the marginal prefill speed of the
chunk(s) just before L, and `decode_tps` the decode speed at context L.

All cases run in one process and rounds interleave them (odd rounds in reverse
order) so machine noise hits them alike; `full` is always measured, and ratios
to it are the median of per-round ratios. Memory per checkpoint: MLX's peak
(reset when the checkpoint starts; it includes the model weights), the
process RSS after it, and the bytes the caches hold (sum of `nbytes`).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.ppl import CacheCase
from bench.text import essay_token_ids
from cache import make_cache

PREFILL_STEP = 512


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), else the peak from getrusage."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def walk_contexts(
    model,
    ids: mx.array,
    case: CacheCase,
    contexts: list[int],
    steps: int,
    prefill_step: int = PREFILL_STEP,
    tick: Callable[[int], Any] | None = None,
) -> list[dict[str, Any]]:
    """Measurements at each context checkpoint for one fresh cache (see module doc)."""
    caches = make_cache(model, **case.cache_kwargs())
    pos, out = 0, []
    for context in contexts:
        if context < pos + 1:
            raise ValueError(f"contexts must be more than {steps + 1} tokens apart")
        mx.clear_cache()
        mx.reset_peak_memory()
        start = time.perf_counter()
        prefilled = context - pos
        while pos < context:
            # As the server and mlx-lm prefill: evaluate the caches, not the chunk's logits.
            end = min(pos + prefill_step, context)
            model(ids[None, pos:end], cache=caches)
            mx.eval([c.state for c in caches])
            pos = end
        prefill_s = time.perf_counter() - start
        mx.eval(model(ids[None, pos : pos + 1], cache=caches))  # warm-up, not timed
        pos += 1
        start = time.perf_counter()
        for _ in range(steps):
            mx.eval(model(ids[None, pos : pos + 1], cache=caches))
            pos += 1
        decode_s = time.perf_counter() - start
        out.append(
            {
                "context": context,
                "prefill_tps": prefilled / prefill_s,
                "decode_tps": steps / decode_s,
                "peak_mem_bytes": mx.get_peak_memory(),
                "rss_bytes": rss_bytes(),
                "cache_bytes": sum(c.nbytes for c in caches),
            }
        )
        if tick:
            tick(prefilled + steps + 1)
    return out


def run_throughput_grid(
    model,
    tokenizer,
    cases: list[CacheCase],
    contexts: list[int],
    steps: int = 16,
    rounds: int = 2,
    prefill_step: int = PREFILL_STEP,
    progress: Callable[[int, str | None], Any] | None = None,
) -> list[dict[str, Any]]:
    """One record per case x context: medians over rounds, ratios to the full cache."""
    contexts = sorted(set(contexts))
    if CacheCase("full") not in cases:
        cases = [CacheCase("full"), *cases]
    ids = mx.array(essay_token_ids(tokenizer, contexts[-1] + len(contexts) * (steps + 1)))
    if progress:
        progress(rounds * len(cases) * int(ids.size), None)
    runs: dict[CacheCase, list[list[dict[str, Any]]]] = {c: [] for c in cases}
    for r in range(rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            desc = f"round {r + 1}: " + " ".join(
                str(v) for v in case.fields().values() if v is not None
            )
            tick = (lambda n, d=desc: progress(n, d)) if progress else None
            runs[case].append(walk_contexts(model, ids, case, contexts, steps, prefill_step, tick))

    evict_batch = {case: case.resolved_evict_batch(model) for case in cases}
    records = []
    for case in cases:
        for i, context in enumerate(contexts):
            mine = [run[i] for run in runs[case]]
            full = [run[i] for run in runs[CacheCase("full")]]

            def median(key: str, rows: list[dict[str, Any]] = mine) -> float:
                return statistics.median(row[key] for row in rows)

            def ratio(key: str, mine: list = mine, full: list = full) -> float:
                return statistics.median(a[key] / b[key] for a, b in zip(mine, full, strict=True))

            records.append(
                {
                    **case.fields(),
                    "evict_batch": evict_batch[case],
                    "context": context,
                    "rounds": rounds,
                    "steps": steps,
                    "prefill_tps": median("prefill_tps"),
                    "decode_tps": median("decode_tps"),
                    "prefill_ratio": ratio("prefill_tps"),
                    "decode_ratio": ratio("decode_tps"),
                    "peak_mem_bytes": int(median("peak_mem_bytes")),
                    "rss_bytes": int(median("rss_bytes")),
                    "cache_bytes": int(median("cache_bytes")),
                }
            )
    return records
