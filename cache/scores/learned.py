"""`learned`: `mean`'s rank times a per-head retention gate of the token's key and value.

TRIM-KV and KVzap showed that a tiny function of what a token is, trained against the
frozen model, predicts whether later queries will need it better than its attention so
far. Here the gate g (cache/retention/__init__.py: linear, per layer and KV head, in the
RoPE-invariant parts of the key, its direction before RoPE, and the value) multiplies
`mean`'s rank by exp(g) at each eviction: attention per query still says what was used,
the gate what will be (trained with the budget in the loop: cache/retention/training.py).
It reads the held keys and values the cache hands it (`kv`, dense) and their positions,
so it adds nothing to a decode step and nothing per slot; h2o-ada's pool of every head's
slots gates each slot under its own head's weights, and a cache that cannot hand them
over (h2o-kvarn's tiles) ranks by `mean`. Unbound (no weights for the model: `signature`
empty) it is `mean`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import mlx.core as mx

from cache.retention import G_CLIP, age_term, find_retention, gate
from cache.scores.mean import MeanAttnScore


@functools.cache
def _weights(signature: str, layer: int):
    retention = find_retention(signature)
    if retention is None or not 0 <= layer < retention.w.shape[0]:
        return None
    return (
        retention.layer(layer), retention.rope, retention.layer_age(layer),
        retention.layer_turn(layer),
    )  # fmt: skip


@dataclass(frozen=True)
class LearnedScore(MeanAttnScore):
    name = "learned"
    reads_kv = True
    kv_per_slot = True  # a slot's gate reads its own key and value
    binds_model = True  # make_cache binds each layer's rule to the model's gates
    signature: str = ""  # cache/retention.signature of the model; "": unbound (mean)
    layer: int = -1
    max_kv: int = 0  # the layer's cache size (the age terms' scale)

    def bound(self, signature: str, layer: int, max_kv: int = 0) -> LearnedScore:
        return replace(self, signature=signature, layer=layer, max_kv=max_kv)

    @functools.cached_property
    def accumulation(self) -> LearnedScore:
        # Every layer accumulates as `mean` does: one compiled decode step for all of them,
        # not one per layer (a slower host step: docs/retention.md, Cost); made once, as a
        # dataclass `replace` every layer and step costs host time too.
        return replace(self, signature="", layer=-1, max_kv=0)

    @property
    def gated(self) -> bool:
        """Whether gates exist for this rule's model and layer."""
        return bool(self.signature) and _weights(self.signature, self.layer) is not None

    def rank(self, importance: mx.array, positions: mx.array, offset, kv=None) -> mx.array:
        value = super().rank(importance, positions, offset)
        found = _weights(self.signature, self.layer) if kv is not None and self.signature else None
        if found is None:
            return value
        (keys, values), ((w, b), rope, age, turn) = kv, found
        g = gate(keys, values, w, b, rope, positions, turn)
        if age is not None and self.max_kv:
            g = mx.clip(g + age_term(age, positions, offset, self.max_kv), -G_CLIP, G_CLIP)
        return value * mx.exp(g)


def forget_weights() -> None:
    """Read the gates again on next use (cache/retention.forget)."""
    _weights.cache_clear()
