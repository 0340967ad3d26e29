"""KVarN tile encoding: Sinkhorn variance normalization, then round-to-nearest packing.

A tile is `tile` consecutive stored tokens of one KV head, already Hadamard-rotated.
Sinkhorn balancing (KVarN, Muller et al. 2026) alternates dividing the tile's columns
and rows by their standard deviations, in log space, for a few iterations; a tile
keeps the factors if they lower its imbalance (max/min std over rows plus over
columns), so balancing never makes a tile worse. The balanced tile is quantized affine
round-to-nearest on a grid fitted per group (`fit_quantize`; mx.quantize's packed
layout) and one of the two factors is folded into its scales and biases; the other
stays as one float16 vector per tile (layout: kernels/kvarn.py):
- keys: channels x tokens, one group per channel across the tile's tokens (outlier
  channels get their own step), token factor kept apart;
- values: tokens x channels, `group_size` channels per group, channel factor kept apart.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from kernels.kvarn import TileFormat

SINKHORN_ITERS = 4
FIT_ITERS = 3
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
    if iters == 0:  # unbalanced: unit factors
        return mx.ones((*x.shape[:-1], 1)), mx.ones((*x.shape[:-2], 1, x.shape[-1]))
    # Factors are updated in log space, but exp runs on the factor vectors only: on
    # this CPU an elementwise exp over a whole tile costs as much as the rest together.
    log_r = mx.zeros((*x.shape[:-1], 1))
    log_c = mx.zeros((*x.shape[:-2], 1, x.shape[-1]))
    cur = x  # x balanced by the current factors (each built once: ~4 small ops apiece)
    for _ in range(iters):
        log_c = log_c + mx.log(mx.maximum(mx.std(cur, axis=-2, keepdims=True), _MIN_STD))
        cur = x * mx.exp(-log_r) * mx.exp(-log_c)
        log_r = log_r + mx.log(mx.maximum(mx.std(cur, axis=-1, keepdims=True), _MIN_STD))
        cur = x * mx.exp(-log_r) * mx.exp(-log_c)
    # The last round's factors, unless they leave a tile less balanced than it was. (Keeping
    # the best round's instead picked the last on every tile of the essays, at ~20% more of
    # a tile's encoding time: an imbalance is ~24 small ops.)
    better = (imbalance(cur) < imbalance(x))[..., None, None]
    return mx.exp(mx.where(better, log_r, 0.0)), mx.exp(mx.where(better, log_c, 0.0))


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Integer codes [..., n] -> uint32 words [..., n * bits / 32], mx.quantize's layout."""
    per_word = 32 // bits
    c = codes.astype(mx.uint32).reshape(*codes.shape[:-1], -1, per_word)
    return (c << (mx.arange(per_word, dtype=mx.uint32) * bits)).sum(-1).astype(mx.uint32)


def fit_quantize(
    x: mx.array, group_size: int, bits: int, iters: int = FIT_ITERS, unit_gain: bool = False
) -> tuple[mx.array, mx.array, mx.array]:
    """Affine quantization in mx.quantize's layout, each group's grid fitted to the group.

    mx.quantize spans a group's min..max, then moves the grid so that 0 is a level: at
    2 bits a Gaussian group's levels become e.g. {-3, -1.5, 0, 1.5} sigma, one tail
    clipped and the step long. Here the grid starts at min..max and each iteration
    rounds to it, then refits step and offset by least squares of the group on its
    codes (~30% less squared error at 2 bits, ~12% at 4, on this model's tiles).

    A least-squares read of its codes is shrunk towards the group mean (gain ~0.92 at
    2 bits). For keys that is harmless, but attention sums values over many tokens,
    where rounding noise averages out and a shrink does not: `unit_gain` rescales the
    step so the reconstruction's projection on the group is the group itself. On h2o-
    kvarn k4v2 that cut the KL to dense H2O ~30% (docs/kvarn_ablation.md), where least
    squares alone, or clipping the range (less error, more shrink), did not.
    """
    top = 2**bits - 1
    g = x.reshape(*x.shape[:-1], -1, group_size)
    mean = g.mean(-1, keepdims=True)
    dev = g - mean
    lo = g.min(-1, keepdims=True)
    step = mx.maximum((g.max(-1, keepdims=True) - lo) / top, _MIN_STD)
    offset = lo
    for _ in range(iters):
        codes = mx.clip(mx.round((g - offset) / step), 0, top)
        centred = codes - codes.mean(-1, keepdims=True)
        var = (centred * centred).mean(-1, keepdims=True)
        fitted = (centred * dev).mean(-1, keepdims=True) / mx.maximum(var, 1e-12)
        step = mx.where(var > 0, mx.maximum(fitted, _MIN_STD), step)  # one code: keep it
        offset = mean - step * codes.mean(-1, keepdims=True)
    codes = mx.clip(mx.round((g - offset) / step), 0, top)
    if unit_gain:
        centred = codes - codes.mean(-1, keepdims=True)
        signal = (dev * dev).sum(-1, keepdims=True)
        gain = step * (centred * dev).sum(-1, keepdims=True) / mx.maximum(signal, 1e-12)
        # A group read back far below its own size (one or two codes) is left at most
        # doubled, not blown up.
        step = mx.where(signal > 0, step / mx.maximum(gain, 0.5), step)
        offset = mean - step * codes.mean(-1, keepdims=True)
    return pack_codes(codes.reshape(x.shape), bits), step[..., 0], offset[..., 0]


def quantize_keys(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, ...]:
    """Key grid: least squares (q.k reads each key once; error, not gain, is what counts)."""
    return fit_quantize(x, group_size, bits)


def quantize_values(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, ...]:
    """Value grid: least squares at unit gain (attention sums values; see fit_quantize)."""
    return fit_quantize(x, group_size, bits, unit_gain=True)


def encode_keys(k: mx.array, fmt: TileFormat, iters: int = SINKHORN_ITERS) -> list[mx.array]:
    """Key tiles [B, H, n, tile, D] (rotated) -> [words, scales, biases, token_scale]."""
    x = k.astype(mx.float32).swapaxes(-1, -2)  # channels x tokens
    channel, token = sinkhorn(x, iters)
    words, scales, biases = quantize_keys(
        x / channel / token, group_size=fmt.tile, bits=fmt.key_bits
    )
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
    words, scales, biases = quantize_values(
        x / token / channel, group_size=fmt.group_size, bits=fmt.value_bits
    )
    return [
        words,
        (scales * token).astype(SCALE_DTYPE),
        (biases * token).astype(SCALE_DTYPE),
        channel[..., 0, :].astype(SCALE_DTYPE),
    ]


_ENCODERS: dict[tuple[TileFormat, int], Callable] = {}


def encode_tiles(
    k: mx.array,
    v: mx.array,
    fmt: TileFormat,
    iters: int = SINKHORN_ITERS,
    compiled: bool | None = None,
) -> list[list[mx.array]]:
    """[encode_keys(k), encode_values(v)]: on a GPU as one compiled call per format and
    shape (one by one a tile's encoding is ~330 small ops, ~850 with Sinkhorn rounds, for
    the host to build and the GPU to launch; compiled, its elementwise chains fuse to a
    third of that). On the CPU op by op: there the compiled call ran 2-3x slower (one
    tile of the default model's 3 heads 6.8 vs 5.5 ms, 30 tiles 192 vs 65 ms). `compiled`:
    force one way."""
    if not (mx.default_device() == mx.gpu if compiled is None else compiled):
        return [encode_keys(k, fmt, iters), encode_values(v, fmt, iters)]
    if (fmt, iters) not in _ENCODERS:
        _ENCODERS[fmt, iters] = mx.compile(
            lambda k, v: [encode_keys(k, fmt, iters), encode_values(v, fmt, iters)]
        )
    return _ENCODERS[fmt, iters](k, v)
