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
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask = None
) -> tuple[mx.array, mx.array]:
    """softmax(scale * q k^T + mask) v, and the pre-softmax logits.

    q: [B, n_q_heads, L_q, D]; k, v: [B, n_kv_heads, L_k, D] (GQA when fewer KV heads).
    Returns out [B, n_q_heads, L_q, D] in q's dtype and scores, float32
    [B, n_q_heads, L_q, L_k], with masked positions at -inf.
    """
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    # Query heads of one KV head stacked as rows: one plain matmul per KV head.
    qg = (_f32(q) * scale).reshape(B, n_kv, rep * L_q, D)
    scores = qg @ _f32(k).swapaxes(-1, -2)  # [B, n_kv, rep * L_q, L_k]

    m = expand_mask(mask, L_q, L_k)
    if m is not None:
        scores = scores.reshape(B, n_kv, rep, L_q, L_k)
        if m.ndim == 4:  # [B, 1 or n_q, L_q, L_k]
            m = m.reshape(m.shape[0], n_kv, rep, L_q, L_k) if m.shape[1] == n_q else m[:, :, None]
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, -mx.inf)
        else:
            scores = scores + m.astype(mx.float32)
        scores = scores.reshape(B, n_kv, rep * L_q, L_k)

    probs = mx.softmax(scores, axis=-1, precise=True)
    out = ((probs if v.dtype == mx.float32 else probs.astype(v.dtype)) @ v).reshape(
        B, n_q, L_q, v.shape[-1]
    )
    if out.dtype != q.dtype:
        out = out.astype(q.dtype)
    return out, scores.reshape(B, n_q, L_q, L_k)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)
