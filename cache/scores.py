"""Score rules: how one attention call's logits add to each key's importance.

Both rules take the kernel's pre-softmax logits [B, n_q_heads, L_q, L_k]
(masked keys at -inf) and return per-KV-head importance [B, n_kv_heads, L_k].
GQA: query heads are averaged per KV head (kept as their sum, which ranks
keys identically and saves an op per layer per step).

- `attn` (original H2O): accumulate the softmax probability each key received.
- `ema` (the MLX H2O paper): C = a*C + (1-a)*|s| on pre-softmax scores, one
  step per query row, so a chunk of L_q rows equals L_q single steps.
"""

from __future__ import annotations

import mlx.core as mx

SCORE_RULES = ("attn", "ema")
EMA_ALPHA = 0.95


def _per_kv_head(x: mx.array, n_kv_heads: int) -> mx.array:
    """[B, n_q, L_q, L_k] -> [B, n_kv, L_k], summing the query rows and the heads of a group."""
    B, n_q, L_q, L_k = x.shape
    return x.reshape(B, n_kv_heads, (n_q // n_kv_heads) * L_q, L_k).sum(axis=2)


def attn_increment(scores: mx.array, n_kv_heads: int) -> mx.array:
    """Sum over query rows of softmax probabilities."""
    probs = mx.softmax(scores, axis=-1, precise=True)
    return _per_kv_head(probs, n_kv_heads)


def ema_increment(scores: mx.array, n_kv_heads: int, alpha: float) -> tuple[float, mx.array]:
    """(decay, increment) with C_new = decay * C_old + increment.

    Row i of L rows is weighted (1-a) * a^(L-1-i); masked logits count as 0.
    """
    L = scores.shape[2]
    # A single decode row sees every key (no -inf); chunk rows carry the causal mask.
    magnitude = mx.abs(scores) if L == 1 else mx.where(mx.isinf(scores), 0.0, mx.abs(scores))
    if L == 1:
        weighted = magnitude * (1.0 - alpha)
    else:
        weights = (1.0 - alpha) * alpha ** mx.arange(L - 1, -1, -1, dtype=mx.float32)
        weighted = magnitude * weights[:, None]
    return alpha**L, _per_kv_head(weighted, n_kv_heads)
