"""KVarN tile encoding: Sinkhorn variance normalization, then round-to-nearest packing.

A tile is `tile` consecutive stored tokens of one KV head, already Hadamard-rotated.
Sinkhorn balancing (KVarN, Muller et al. 2026) alternates dividing the tile's columns
and rows by their standard deviations, in log space, for a few iterations; the
factors that gave the lowest imbalance (max/min std over rows plus over columns) are
kept, so balancing never makes a tile worse. The balanced tile is quantized with
mx.quantize (affine round-to-nearest) and one of the two factors is folded into its
scales and biases; the other stays as one float16 vector per tile (layout:
kernels/kvarn.py):
- keys: channels x tokens, one group per channel across the tile's tokens (outlier
  channels get their own step), token factor kept apart;
- values: tokens x channels, `group_size` channels per group, channel factor kept apart.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.kvarn import TileFormat

SINKHORN_ITERS = 4
SCALE_DTYPE = mx.float16
_MIN_STD = 1e-6  # an all-equal row or column keeps a finite factor


def imbalance(x: mx.array) -> mx.array:
    """Per tile [..., R, C]: max/min of the row stds plus max/min of the column stds."""
    rows = mx.maximum(mx.std(x, axis=-1), _MIN_STD)
    cols = mx.maximum(mx.std(x, axis=-2), _MIN_STD)
    return rows.max(-1) / rows.min(-1) + cols.max(-1) / cols.min(-1)


def sinkhorn(x: mx.array, iters: int = SINKHORN_ITERS) -> tuple[mx.array, mx.array]:
    """Row factors [..., R, 1] and column factors [..., 1, C] with x / r / c balanced."""
    x = x.astype(mx.float32)
    # Factors are updated in log space, but exp runs on the factor vectors only: on
    # this CPU an elementwise exp over a whole tile costs as much as the rest together.
    log_r = mx.zeros((*x.shape[:-1], 1))
    log_c = mx.zeros((*x.shape[:-2], 1, x.shape[-1]))
    best_r, best_c, best = log_r, log_c, imbalance(x)
    for _ in range(iters):
        cur = x * mx.exp(-log_r) * mx.exp(-log_c)
        log_c = log_c + mx.log(mx.maximum(mx.std(cur, axis=-2, keepdims=True), _MIN_STD))
        cur = x * mx.exp(-log_r) * mx.exp(-log_c)
        log_r = log_r + mx.log(mx.maximum(mx.std(cur, axis=-1, keepdims=True), _MIN_STD))
        score = imbalance(x * mx.exp(-log_r) * mx.exp(-log_c))
        better = (score < best)[..., None, None]
        best_r, best_c = mx.where(better, log_r, best_r), mx.where(better, log_c, best_c)
        best = mx.minimum(score, best)
    return mx.exp(best_r), mx.exp(best_c)


def encode_keys(k: mx.array, fmt: TileFormat, iters: int = SINKHORN_ITERS) -> list[mx.array]:
    """Key tiles [B, H, n, tile, D] (rotated) -> [words, scales, biases, token_scale]."""
    x = k.astype(mx.float32).swapaxes(-1, -2)  # channels x tokens
    channel, token = sinkhorn(x, iters)
    words, scales, biases = mx.quantize(x / channel / token, group_size=fmt.tile, bits=fmt.key_bits)
    return [
        words,
        (scales * channel).astype(SCALE_DTYPE),
        (biases * channel).astype(SCALE_DTYPE),
        token[..., 0, :].astype(SCALE_DTYPE),
    ]


def encode_values(v: mx.array, fmt: TileFormat, iters: int = SINKHORN_ITERS) -> list[mx.array]:
    """Value tiles [B, H, n, tile, D] (rotated) -> [words, scales, biases, channel_scale]."""
    x = v.astype(mx.float32)  # tokens x channels
    token, channel = sinkhorn(x, iters)
    words, scales, biases = mx.quantize(
        x / token / channel, group_size=fmt.group_size, bits=fmt.value_bits
    )
    return [
        words,
        (scales * token).astype(SCALE_DTYPE),
        (biases * token).astype(SCALE_DTYPE),
        channel[..., 0, :].astype(SCALE_DTYPE),
    ]
