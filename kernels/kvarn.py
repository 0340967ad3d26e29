"""Attention with score export over KVarN storage (reference backend, MLX ops).

KVarN storage of one layer, in the rotated frame (kernels/hadamard.py), slot order
[front | tiles | tail]: `front` and `tail` are dense K/V [B, H, n, D] (or None), the
tiles hold `tile` tokens each, quantized after Sinkhorn balancing (cache/policies/kvarn_tiles.py).
The tile axis is axis 2 of every tile array:

keys (channels x tokens, one affine group per channel spanning the tile's tokens):
    words [B, H, n, D, tile * bits / 32] uint32, scales/biases [B, H, n, D, 1], with the
    Sinkhorn channel factor folded in, and token_scale [B, H, n, tile];
    k[t, c] = (code * scale[c] + bias[c]) * token_scale[t]
values (tokens x channels, groups of `group_size` channels per token):
    words [B, H, n, tile, D * bits / 32], scales/biases [B, H, n, tile, D / group_size]
    with the Sinkhorn token factor folded in, and channel_scale [B, H, n, D];
    v[t, c] = (code * scale[t] + bias[t]) * channel_scale[c]

So q.k is one packed matmul per tile times the token factor, and p.v is one packed
matmul per tile times the channel factor; neither K nor V is ever dequantized whole.
Scales are float16 (as in KVarN); the products run in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kernels.hadamard import rotate
from kernels.reference import Mask, _apply_mask, on_cuda, sdpa_with_probs

KVarNTiles = list[
    mx.array
]  # keys: [words, scales, biases, token_scale]; values: [.., channel_scale]


@dataclass(frozen=True)
class TileFormat:
    tile: int  # tokens per tile (the key quantization group)
    key_bits: int
    value_bits: int
    group_size: int  # value quantization group, along the head dim


def dequantize_keys(k: KVarNTiles, fmt: TileFormat) -> mx.array:
    """Key tiles as dense [B, H, n, tile, D] float32 (rotated frame)."""
    words, scales, biases, token_scale = k
    x = mx.dequantize(
        words,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=fmt.tile,
        bits=fmt.key_bits,
    )  # [B, H, n, D, tile]
    return (x * token_scale[..., None, :].astype(mx.float32)).swapaxes(-1, -2)


def dequantize_values(v: KVarNTiles, fmt: TileFormat) -> mx.array:
    """Value tiles as dense [B, H, n, tile, D] float32 (rotated frame)."""
    words, scales, biases, channel_scale = v
    x = mx.dequantize(
        words,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=fmt.group_size,
        bits=fmt.value_bits,
    )
    return x * channel_scale[..., None, :].astype(mx.float32)


def kvarn_sdpa_with_probs(
    q: mx.array,
    keys: list,
    values: list,
    scale: float,
    mask: Mask,
    fmt: TileFormat,
    dequantize: bool = False,
) -> tuple[mx.array, mx.array, mx.array]:
    """`sdpa_with_probs` over KVarN storage; q and the output in the model's frame.

    keys/values: [front, tiles, tail] with front/tail dense arrays or None and tiles a
    KVarNTiles list or None. The query is rotated once on the way in and the output once
    on the way out. `dequantize`: dequantize the tiles and call the dense kernel (the
    oracle for the packed path, and the 'dequantize' attention path).
    """
    q_rot = rotate(q.astype(mx.float32))
    if dequantize or keys[1] is None or on_cuda():  # on_cuda: see kernels.reference
        dense = dequantize_storage(keys, values, fmt)
        out, scores, probs = sdpa_with_probs(q_rot, *dense, scale, mask)
        return rotate(out).astype(q.dtype), scores, probs
    return _packed(q_rot, keys, values, scale, mask, fmt, q.dtype)


def dequantize_storage(keys: list, values: list, fmt: TileFormat) -> tuple[mx.array, mx.array]:
    """[front | tiles | tail] as dense float32 K/V [B, H, n, D], still in the rotated frame."""
    dense = []
    for (front, tiles, tail), dequantize in ((keys, dequantize_keys), (values, dequantize_values)):
        seq = [front]
        if tiles is not None:
            x = dequantize(tiles, fmt)  # [B, H, n_tiles, tile, D]
            seq.append(x.reshape(*x.shape[:2], -1, x.shape[-1]))
        seq.append(tail)
        dense.append(mx.concatenate([x.astype(mx.float32) for x in seq if x is not None], axis=2))
    return dense[0], dense[1]


def _packed(
    q_rot, keys, values, scale, mask, fmt: TileFormat, dtype
) -> tuple[mx.array, mx.array, mx.array]:
    (k_front, k_tiles, k_tail), (v_front, v_tiles, v_tail) = keys, values
    B, n_q, L_q, D = q_rot.shape
    n_kv, n_tiles, t = k_tiles[0].shape[1], k_tiles[0].shape[2], fmt.tile
    rows = n_q // n_kv * L_q
    # Query heads of one KV head stacked as rows (GQA), as in the dense reference.
    qg = (q_rot * scale).reshape(B, n_kv, rows, D)
    parts = []
    if k_front is not None:
        parts.append(qg @ k_front.astype(mx.float32).swapaxes(-1, -2))
    words, k_scales, k_biases, token_scale = k_tiles
    per_tile = mx.quantized_matmul(
        qg[:, :, None],  # broadcast over the tiles by quantized_matmul itself: no copy
        words,
        k_scales,
        k_biases,
        transpose=False,
        group_size=t,
        bits=fmt.key_bits,
    )  # [B, n_kv, n, rows, tile]
    per_tile = per_tile * token_scale[:, :, :, None, :].astype(mx.float32)
    parts.append(per_tile.swapaxes(2, 3).reshape(B, n_kv, rows, n_tiles * t))
    if k_tail is not None:
        parts.append(qg @ k_tail.astype(mx.float32).swapaxes(-1, -2))
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    L_k = scores.shape[-1]
    scores = _apply_mask(scores, mask, B, n_kv, n_q // n_kv, L_q, L_k)
    probs = mx.softmax(scores, axis=-1, precise=True)

    n_front = 0 if k_front is None else k_front.shape[2]
    a, b = n_front, n_front + n_tiles * t
    p_tiles = probs[..., a:b].reshape(B, n_kv, rows, n_tiles, t).swapaxes(2, 3)
    v_words, v_scales, v_biases, channel_scale = v_tiles
    o = mx.quantized_matmul(
        p_tiles,
        v_words,
        v_scales,
        v_biases,
        transpose=False,
        group_size=fmt.group_size,
        bits=fmt.value_bits,
    )  # [B, n_kv, n, rows, D]
    out = (o * channel_scale[:, :, :, None, :].astype(mx.float32)).sum(axis=2)
    if v_front is not None:
        out = out + probs[..., :a] @ v_front.astype(mx.float32)
    if v_tail is not None:
        out = out + probs[..., b:] @ v_tail.astype(mx.float32)
    out = rotate(out.reshape(B, n_q, L_q, D))
    shape = (B, n_q, L_q, L_k)
    return out.astype(dtype), scores.reshape(shape), probs.reshape(shape)
