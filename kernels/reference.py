"""Reference attention with score export, in plain MLX ops.

Runs on every device and is the oracle for the Metal and CUDA kernels.
"""

from __future__ import annotations

import mlx.core as mx

Mask = mx.array | str | None


def expand_mask(mask: Mask, L_q: int, L_k: int) -> mx.array | None:
    """Turn mlx-lm's mask forms into an array broadcastable to [..., L_q, L_k].

    "causal" is aligned bottom-right, as in mx.fast.scaled_dot_product_attention:
    query i sees every key up to L_k - L_q + i.
    """
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        q_pos = mx.arange(L_k - L_q, L_k)[:, None]
        return q_pos >= mx.arange(L_k)[None]
    return mask


def sdpa_with_scores(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: Mask = None,
    bias: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """softmax(scale * q k^T + bias + mask) v, and the pre-softmax logits.

    q: [B, n_q_heads, L_q, D]; k, v: [B, n_kv_heads, L_k, D] (GQA when fewer KV heads).
    bias: optional float32 [B, n_kv_heads, L_k], added to every query's logit of a key
    (a merged slot's log(count), cache/policies/merging.py).
    Returns out [B, n_q_heads, L_q, D] in q's dtype and scores, float32
    [B, n_q_heads, L_q, L_k], with masked positions at -inf.
    """
    out, scores, _ = sdpa_with_probs(q, k, v, scale, mask, bias)
    return out, scores


def sdpa_with_probs(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: Mask = None,
    bias: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """`sdpa_with_scores` plus the softmax probabilities it attended with, [B, n_q, L_q, L_k].

    Score rules that need probabilities take these instead of a second softmax.
    """
    B, n_q, L_q, _ = q.shape
    scores, probs = _grouped_probs(q, k, scale, mask, bias)
    out = ((probs if v.dtype == mx.float32 else probs.astype(v.dtype)) @ v).reshape(
        B, n_q, L_q, v.shape[-1]
    )
    if out.dtype != q.dtype:
        out = out.astype(q.dtype)
    shape = (B, n_q, L_q, k.shape[2])
    return out, scores.reshape(shape), probs.reshape(shape)


def logits_and_probs(
    q: mx.array, k: mx.array, scale: float, mask: Mask = None, bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """`sdpa_with_probs`'s logits and probabilities without the output: the score pass of
    a prompt whose output a fused attention call computes (cache/attention.py)."""
    B, n_q, L_q, _ = q.shape
    scores, probs = _grouped_probs(q, k, scale, mask, bias)
    shape = (B, n_q, L_q, k.shape[2])
    return scores.reshape(shape), probs.reshape(shape)


def prompt_weights(q: mx.array, k: mx.array, scale: float, mask: Mask, held: mx.array) -> mx.array:
    """`held` [B, n_kv, n >= L_k] plus each key's softmax weight summed over q's rows and
    the query heads of its KV head: the `attn` rule's update over a prompt block, which
    the GPU kernels compute without the logits (kernels/src/prompt_weights.body)."""
    _, probs = _grouped_probs(q, k, scale, mask, None)
    return _held_plus(held, probs.sum(axis=2))  # sums [B, n_kv, L_k]


def decode_weights(scores: mx.array, held: mx.array) -> mx.array:
    """`held` [B, n_kv, n >= L_k] plus each key's softmax weight summed over the query rows
    of its KV head, from a decode's logits `scores` [B, n_q, L_q, L_k] (masked -inf): the
    `attn` rule's update, which the GPU kernels take from the decode kernel's logits in
    one launch (kernels/src/decode_weights.body)."""
    B, n_q, L_q, L_k = scores.shape
    n_kv = held.shape[1]
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True)
    return _held_plus(held, probs.reshape(B, n_kv, (n_q // n_kv) * L_q, L_k).sum(axis=2))


def _held_plus(held: mx.array, sums: mx.array) -> mx.array:
    """`held` [B, n_kv, n >= L_k] with `sums` [B, n_kv, L_k] added to its first L_k slots."""
    L_k = sums.shape[-1]
    if held.shape[-1] == L_k:
        return held + sums
    return mx.concatenate([held[..., :L_k] + sums, held[..., L_k:]], axis=-1)


def _grouped_probs(q, k, scale: float, mask: Mask, bias) -> tuple[mx.array, mx.array]:
    """float32 logits and softmax laid out [B, n_kv, rep * L_q, L_k]."""
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    # Query heads of one KV head stacked as rows: one plain matmul per KV head.
    qg = (_f32(q) * scale).reshape(B, n_kv, rep * L_q, D)
    scores = qg @ _f32(k).swapaxes(-1, -2)  # [B, n_kv, rep * L_q, L_k]
    if bias is not None:  # broadcast over query rows: never [L_q, L_k] per head
        scores = scores + bias[:, :, None, :]
    scores = _apply_mask(scores, mask, B, n_kv, rep, L_q, L_k)
    return scores, mx.softmax(scores, axis=-1, precise=True)


def _apply_mask(
    scores: mx.array, mask: Mask, B: int, n_kv: int, rep: int, L_q: int, L_k: int
) -> mx.array:
    """Mask scores laid out [B, n_kv, rep * L_q, L_k]: boolean keeps, additive adds."""
    m = expand_mask(mask, L_q, L_k)
    if m is None:
        return scores
    decode = L_q == 1  # laid out [B, n_kv, rep, L_k] already: only the mask is reshaped
    if not decode:
        scores = scores.reshape(B, n_kv, rep, L_q, L_k)
    if m.ndim >= 3:  # [(B or 1,) n_q or 1, L_q or 1, L_k or 1]: numpy broadcasting
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        if m.shape[1] > 1:
            m = m.reshape(m.shape[0], n_kv, rep, *m.shape[2 + decode :])
        elif not decode:
            m = m[:, :, None]
    if m.dtype == mx.bool_:
        scores = mx.where(m, scores, -mx.inf)
    else:
        scores = scores + m.astype(mx.float32)
    return scores if decode else scores.reshape(B, n_kv, rep * L_q, L_k)


def bias_as_mask(mask: Mask, bias: mx.array, n_q: int, L_q: int, L_k: int) -> mx.array:
    """`mask` with a per-key `bias` [B, n_kv, L_k] folded in, as one additive array
    [B, n_q, L_q or 1, L_k], for kernels that take a mask but no bias."""
    added = mx.repeat(bias[:, :, None, :], n_q // bias.shape[1], axis=1)
    m = expand_mask(mask, L_q, L_k)
    if m is None:
        return added
    if m.dtype == mx.bool_:
        return mx.where(m, added, -mx.inf)
    return added + m.astype(mx.float32)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


QuantizedTensor = tuple[mx.array, mx.array, mx.array]
# 4-bit keys are read as nibbles (_byte_matmul_t) from this many batch rows (an H2O slab of
# sessions) on: h2o-q4 decode, default model, A/B on the same caches: 1 session 0.99x,
# a slab of 4 1.03x, of 8 1.11x quantized_matmul's step rate.
NIBBLE_KEYS_FROM_BATCH = 4


def packed_matmul(
    x: mx.array, packed: QuantizedTensor, transpose: bool, group_size: int, bits: int
) -> mx.array:
    """x times mx.quantize's (weights, scales, biases), with float32 scales and biases
    (the oracle stays in float32 whatever the cache dtype)."""
    w, scales, biases = packed
    if on_cuda():
        # MLX 0.32.4's CUDA quantized_matmul returned all zeros for these batched packed
        # K/V (an H100, 2026-11-25); dequantized, the same attention matched the CUDA kernel.
        dense = mx.dequantize(w, _f32(scales), _f32(biases), group_size=group_size, bits=bits)
        return x @ (dense.swapaxes(-1, -2) if transpose else dense)
    as_bytes = bits == 8 or (bits == 4 and x.shape[0] >= NIBBLE_KEYS_FROM_BATCH)
    if transpose and as_bytes and scales.shape[-1] == 1 and mx.default_device() == mx.cpu:
        return _byte_matmul_t(x, packed, bits)
    return mx.quantized_matmul(
        x, w, _f32(scales), _f32(biases), transpose=transpose, group_size=group_size, bits=bits
    )


def _byte_matmul_t(x: mx.array, packed: QuantizedTensor, bits: int) -> mx.array:
    """x @ dequantize(packed)^T for 8- or 4-bit rows of one group each, without MLX's
    CPU quantized_matmul, which takes 4-5x a dense product for a decode query's few rows
    (3 rows x 272 keys x 3 heads: 84 vs 21 us; 8 sessions: 640 vs 125): the words read as
    bytes (mx.quantize's element order: 4-bit element 2j in byte j's low nibble, 2j + 1
    in its high one) in dense matmuls, scale and bias folded in after, as
    x . (s c + b) = s (x . c) + b sum(x). 8 sessions' 4-bit keys: 255 us (more ops, less
    work each: they pay from a few sessions on, NIBBLE_KEYS_FROM_BATCH). Several groups
    per row cost more ops than they save, so those keep quantized_matmul."""
    words, scales, biases = packed
    x32 = _f32(x)
    codes = words.view(mx.uint8)  # [..., N, K]
    if bits == 8:
        dots = x32 @ codes.astype(mx.float32).swapaxes(-1, -2)
    else:
        low, high = (c.astype(mx.float32).swapaxes(-1, -2) for c in (codes & 15, codes >> 4))
        dots = x32[..., 0::2] @ low + x32[..., 1::2] @ high
    s, b = (_f32(a).swapaxes(-1, -2) for a in (scales, biases))  # [..., 1, N]
    out = dots * s + x32.sum(-1, keepdims=True) * b
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def on_cuda() -> bool:
    """Whether MLX computes on its CUDA backend here (never raises on CPU-only builds).

    There, packed attention avoids mx.quantized_matmul on batched packed K/V (see
    packed_matmul); kernels/kvarn.py reads its tiles dequantized for the same reason.
    """
    if mx.default_device() != mx.gpu:
        return False
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:  # builds without the CUDA backend
        return False


def quantized_sdpa_with_scores(
    q: mx.array,
    k_q: QuantizedTensor,
    v_q: QuantizedTensor,
    scale: float,
    mask: Mask = None,
    group_size: int = 64,
    bits: int = 8,
    value_bits: int | None = None,
) -> tuple[mx.array, mx.array]:
    """`sdpa_with_scores` over K/V packed by `mx.quantize(x, group_size, bits)`.

    k_q, v_q: (weights, scales, biases) of keys/values [B, n_kv_heads, L_k, D], packed
    along D; values at `value_bits` when given (e.g. keys 8-bit, values 4-bit). Same
    outputs as `sdpa_with_scores` on the dequantized K/V.
    """
    out, scores, _ = quantized_sdpa_with_probs(
        q, k_q, v_q, scale, mask, group_size, bits, value_bits
    )
    return out, scores


def quantized_sdpa_with_probs(
    q: mx.array,
    k_q: QuantizedTensor,
    v_q: QuantizedTensor,
    scale: float,
    mask: Mask = None,
    group_size: int = 64,
    bits: int = 8,
    value_bits: int | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """`quantized_sdpa_with_scores` plus the softmax probabilities (see sdpa_with_probs)."""
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k_q[0].shape[1], k_q[0].shape[2]
    rep = n_q // n_kv
    qg = (_f32(q) * scale).reshape(B, n_kv, rep * L_q, D)
    scores = packed_matmul(qg, k_q, True, group_size, bits)
    scores = _apply_mask(scores, mask, B, n_kv, rep, L_q, L_k)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = packed_matmul(probs, v_q, False, group_size, value_bits or bits)
    out = out.reshape(B, n_q, L_q, D)
    if out.dtype != q.dtype:
        out = out.astype(q.dtype)
    shape = (B, n_q, L_q, L_k)
    return out, scores.reshape(shape), probs.reshape(shape)
