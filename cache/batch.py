"""Several sessions' caches of one layer, seen by an mlx-lm model as one batch.

The worker advances every decoding session in one forward pass per round, so
the weights (most of a decode step's memory traffic) are read once for all of
them. Each row keeps its own cache: any policy, its own length, eviction state
and RoPE offset. `update_and_fetch` hands row i's new key/value to cache i and
returns the rows' results as lists; the router (cache/router.py) then attends
row by row, each row against its own cache, so a batched step computes exactly
what the rows would alone. A decode step brings one token per row; a prefill
pass brings a chunk per row, causal within each row (rows of unequal chunks are
right-padded by the caller, server/batcher.py, and trimmed back after).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


class BatchedCache:
    def __init__(self, caches: list):
        self.caches = caches

    @property
    def offset(self) -> mx.array:
        """Per-row positions: RoPE takes an array of offsets, one per batch row."""
        return mx.array([c.offset for c in self.caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[list, list]:
        rows = [
            c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            for i, c in enumerate(self.caches)
        ]
        return [k for k, _ in rows], [v for _, v in rows]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if return_array or window_size is not None:
            raise ValueError("batched sessions attend row by row: no shared mask array")
        # One new token sees every key its row holds; a chunk is causal within its row.
        return None if N == 1 else "causal"

    def attend(self, queries: mx.array, keys: list, values: list, attend_row: Callable):
        """attend_row(q, k, v, cache) per row, stacked back into the batch."""
        rows = [
            attend_row(queries[i : i + 1], keys[i], values[i], c) for i, c in enumerate(self.caches)
        ]
        return mx.concatenate(rows, axis=0)


def batch_caches(sessions: list[list]) -> list[BatchedCache]:
    """Per-layer BatchedCaches over several sessions' per-layer cache lists."""
    return [BatchedCache(list(layer)) for layer in zip(*sessions, strict=True)]
