"""FullKVCache: the `full` policy, mlx-lm's KVCache speaking the cache contract."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from cache.contents import LayerContents, every_token
from cache.contract import UNBOUNDED, LayerCache, trim_spare

STEP = KVCache.step  # mlx-lm grows its buffers 256 tokens at a time


class FullKVCache(KVCache, LayerCache):
    """Every token, dense: what mlx-lm's generation keeps."""

    token_step = STEP

    @classmethod
    def from_spec(cls, spec, window: int | None = None) -> FullKVCache:
        return cls()

    @classmethod
    def layer_bytes(cls, shape, spec, window: int | None = None) -> float:
        slots = -(-spec.max_kv // STEP) * STEP
        return slots * shape.kv_heads * shape.dense_token_bytes

    def compact(self) -> None:
        trim_spare(self)

    verifies_drafts = True

    def draft_room(self) -> int:
        return UNBOUNDED  # a refused draft is trimmed back exactly (settle_draft)

    def contents(self) -> LayerContents:
        heads = 0 if self.keys is None else self.keys.shape[1]
        return every_token(self.offset, heads)


def plain(cache) -> bool:
    """Whether a layer's cache is mlx-lm's plain KVCache (the full policy's, a dense-first
    kvarn session's before it is packed, or one read back from an older spill): what a
    KVSlab holds as a BatchKVCache layer (its subclasses store otherwise)."""
    return type(cache) in (KVCache, FullKVCache)
