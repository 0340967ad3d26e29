"""Budget math: bytes per cached token, and each session's max_kv from a memory budget.

bytes/token = layers x kv_heads x (2 x head_dim x element bytes + H2O bookkeeping)
where quantized policies store head_dim x bits / 8 bytes plus one scale and one
bias (float32 on CPU, float16 elsewhere) per `group_size` elements, and H2O
keeps a float32 score and an int32 position per KV head and token. h2o-mixed
stores keys 8-bit and values 4-bit (cache/quantized.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cache.factory import POLICIES, QUANT_BITS
from cache.presets import split_budget

H2O_BOOKKEEPING = 8  # float32 score + int32 position, per KV head and token
FULL_CACHE_STEP = 256  # mlx-lm KVCache.step
AUTO_FLOOR = 256  # `auto` switches to 8-bit below this many dense tokens
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MB', '2g', 1048576 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 2GiB or a number of bytes)")
    number, unit, binary = m.groups()
    scale = 1024 ** "_KMGT".index(unit) if binary else _UNITS[unit]
    return int(float(number) * scale)


@dataclass(frozen=True)
class ModelShape:
    layers: int  # layers holding a KV cache that grows with the conversation
    kv_heads: int
    head_dim: int
    element_bytes: int  # K/V dtype: 4 for float32 (CPU), 2 for float16/bfloat16
    context: int  # the model's trained context length

    @classmethod
    def of(cls, model, element_bytes: int) -> ModelShape:
        args = model.args
        heads = args.num_attention_heads
        kv_heads = getattr(args, "num_key_value_heads", None) or heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
        context = getattr(args, "max_position_embeddings", None) or 4096
        return cls(len(model.layers), kv_heads, head_dim, element_bytes, context)


def bytes_per_token(shape: ModelShape, policy: str, group_size: int = 64) -> float:
    """Bytes one cached token costs across all layers under `policy`."""
    dense = 2 * shape.head_dim * shape.element_bytes  # K and V

    def packed(bits: int) -> float:  # K or V: packed words, one scale and bias per group
        groups = shape.head_dim / group_size
        return shape.head_dim * bits / 8 + 2 * shape.element_bytes * groups

    if policy in ("full", "rotating"):
        per_head = dense
    elif policy == "h2o":
        per_head = dense + H2O_BOOKKEEPING
    elif policy in QUANT_BITS:
        key_bits, value_bits = QUANT_BITS[policy]
        per_head = packed(key_bits) + packed(value_bits) + H2O_BOOKKEEPING
    else:
        raise ValueError(f"unknown policy {policy!r}")
    return shape.layers * shape.kv_heads * per_head


def max_kv_within(nbytes: int, shape: ModelShape, policy: str) -> int:
    """The largest max_kv whose cache, as allocated, fits in `nbytes`.

    H2O caches hold one spare slot (the newest token before eviction); mlx-lm's
    KVCache grows 256 tokens at a time, so a full cache gets whole steps.
    """
    slots = int(nbytes // bytes_per_token(shape, policy))
    if policy == "full":
        return slots // FULL_CACHE_STEP * FULL_CACHE_STEP
    return slots - 1 if policy.startswith("h2o") else slots


@dataclass(frozen=True)
class CachePlan:
    policy: str
    max_kv: int  # tokens per layer in one session's cache
    bytes_per_token: float
    session_bytes: int  # one session's share of the budget; its cache never outgrows it


def plan_cache(
    shape: ModelShape, policy: str, kv_budget: int, max_sessions: int, preset: str = "heavy"
) -> CachePlan:
    """Split `kv_budget` evenly over `max_sessions` and size each session's cache.

    `auto`: full when the model's whole context fits, else h2o, else h2o-q8 when
    dense h2o would hold fewer than AUTO_FLOOR tokens (and 8-bit caches exist).
    """
    per_session = kv_budget // max_sessions
    if policy == "auto":
        if per_session >= shape.context * bytes_per_token(shape, "full"):
            policy = "full"
        elif per_session >= AUTO_FLOOR * bytes_per_token(shape, "h2o") or "h2o-q8" not in POLICIES:
            policy = "h2o"
        else:
            policy = "h2o-q8"
    bpt = bytes_per_token(shape, policy)
    max_kv = min(max_kv_within(per_session, shape, policy), shape.context)
    if max_kv < 16:
        raise ValueError(
            f"--kv-budget {kv_budget} B over {max_sessions} sessions leaves {max_kv} tokens "
            f"per session under {policy} ({bpt:.0f} B/token): raise the budget or lower "
            "--max-sessions"
        )
    if policy != "full":
        split_budget(max_kv, preset)  # raises when the budget is too small to split
    return CachePlan(policy, max_kv, bpt, per_session)
