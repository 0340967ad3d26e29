"""How a scored layer attends: the one place that picks the path and the kernel backend.

A scored cache hands its stored K/V to attention as one or more parts, each with a
`KVFormat` (`kv_segments`): dense arrays, or mx.quantize's packed (words, scales,
biases) at some key/value width, either possibly Hadamard-rotated (the query is
rotated in and the output back once), or KVarN storage (kernels/kvarn.py, reference
only). `ScoredAttention` runs each part through a kernel
from kernels/ (`sdpa_with_scores` for dense parts; for packed parts the fused
`quantized_sdpa_with_scores`, or mx.dequantize and the dense kernel when the
`dequantize` path is chosen) on the backend it was configured with, and merges
parts by log-sum-exp. One instance, `ATTENTION`, serves the router; `configure`
sets its backend (from `--kernel` or H2O_KERNEL, read once) and quantized path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from kernels import AUTO, check_backend, quantized_sdpa_with_scores, sdpa_with_scores
from kernels.hadamard import rotate
from kernels.kvarn import TileFormat, kvarn_sdpa_with_scores
from kernels.reference import expand_mask

QUANTIZED_PATHS = ("fused", "dequantize")
BACKEND_ENV = "H2O_KERNEL"


@dataclass(frozen=True)
class KVFormat:
    """How one part of a cache's K/V is stored: dense, or packed at these widths."""

    key_bits: int | None = None  # None: dense arrays
    value_bits: int | None = None
    group_size: int = 64
    rotated: bool = False  # stored Hadamard-rotated along the head dim (kernels/hadamard.py)
    tile: int | None = None  # KVarN storage [front, tiles, tail] (kernels/kvarn.py)

    @property
    def packed(self) -> bool:
        return self.key_bits is not None


DENSE = KVFormat()


def unrotated(fmt: KVFormat) -> KVFormat:
    return KVFormat(fmt.key_bits, fmt.value_bits, fmt.group_size)


class ScoredAttention:
    """(out, float32 pre-softmax logits [B, n_q, L_q, L_k]) for a layer whose cache scores keys."""

    def __init__(self, backend: str = AUTO, quantized_path: str = "fused"):
        self.backend = AUTO
        self.quantized_path = "fused"
        self.configure(backend, quantized_path)

    def configure(self, backend: str | None = None, quantized_path: str | None = None) -> None:
        """Set the kernel backend (auto, reference, metal, cuda) and the quantized path."""
        if backend is not None:
            self.backend = check_backend(backend)  # raises for one this machine lacks
        if quantized_path is not None:
            if quantized_path not in QUANTIZED_PATHS:
                raise ValueError(
                    f"quantized attention path {quantized_path!r}: choose from {QUANTIZED_PATHS}"
                )
            self.quantized_path = quantized_path

    def __call__(self, queries: mx.array, keys, values, cache, scale: float, mask=None):
        parts = cache.kv_segments(keys, values)
        if len(parts) == 1:
            k, v, fmt = parts[0]
            return self.attend(queries, k, v, fmt, scale, mask)
        full = expand_mask(mask, queries.shape[2], sum(seq_length(k) for k, _, _ in parts))
        results, start = [], 0
        for k, v, fmt in parts:
            n = seq_length(k)
            m = None if full is None else full[..., start : start + n]
            results.append(self.attend(queries, k, v, fmt, scale, m))
            start += n
        return merge_parts(results, queries.dtype)

    def attend(self, queries, keys, values, fmt: KVFormat, scale: float, mask=None):
        """One part: dense or packed K/V in `fmt`."""
        if fmt.tile is not None:  # KVarN: rotates the query in and the output back itself
            tiles = TileFormat(fmt.tile, fmt.key_bits, fmt.value_bits, fmt.group_size)
            dequantize = self.quantized_path == "dequantize"
            return kvarn_sdpa_with_scores(queries, keys, values, scale, mask, tiles, dequantize)
        if fmt.rotated:  # any backend's kernel on rotated storage: rotate in, rotate out once
            out, scores = self.attend(rotate(queries), keys, values, unrotated(fmt), scale, mask)
            return rotate(out), scores
        if not fmt.packed:
            return sdpa_with_scores(queries, keys, values, scale, mask, backend=self.backend)
        gs, k_bits, v_bits = fmt.group_size, fmt.key_bits, fmt.value_bits or fmt.key_bits
        if self.quantized_path == "dequantize":
            k = mx.dequantize(*keys, group_size=gs, bits=k_bits)
            v = mx.dequantize(*values, group_size=gs, bits=v_bits)
            return self.attend(queries, k, v, DENSE, scale, mask)
        return quantized_sdpa_with_scores(
            queries, keys, values, scale, mask, gs, k_bits, value_bits=v_bits, backend=self.backend
        )


def backend_from_env() -> str:
    return os.environ.get(BACKEND_ENV, AUTO)


ATTENTION = ScoredAttention(backend_from_env())


def configure(backend: str | None = None, quantized_path: str | None = None) -> None:
    """Configure the attention every scored layer uses (see ScoredAttention.configure)."""
    ATTENTION.configure(backend, quantized_path)


def seq_length(x) -> int:
    """Sequence length of dense keys or packed key parts (0 for None)."""
    if x is None:
        return 0
    return (x[0] if isinstance(x, (list, tuple)) else x).shape[2]


def merge_parts(parts: list[tuple[mx.array, mx.array]], dtype: mx.Dtype):
    """Combine attention over disjoint key sets: weight each by its share of the softmax mass."""
    lses = [mx.logsumexp(scores, axis=-1, keepdims=True) for _, scores in parts]
    total = lses[0]
    for lse in lses[1:]:
        total = mx.logaddexp(total, lse)
    out = None
    for (o, _), lse in zip(parts, lses, strict=True):
        w = mx.exp(lse - total)
        # A row that sees no key of a part has w = 0 and a NaN output there.
        term = mx.where(w > 0, w * o.astype(mx.float32), 0.0)
        out = term if out is None else out + term
    return out.astype(dtype), mx.concatenate([scores for _, scores in parts], axis=-1)
