"""H2O KV caches, score rules, budget math and the attention router.

The cache vocabulary (policies, presets, score rules, CacheSpec) lives in
config/cache_spec.py; this package implements it.
"""

import mlx_lm.models.cache as _mlx_lm_cache

from cache.attention import ATTENTION, ScoredAttention, configure
from cache.factory import adopt_rope, cache_usage, make_cache, tokens_seen
from cache.h2o import H2OKVCache, ScoresMissing
from cache.h2o_kvarn import H2OKVarNCache
from cache.kvarn import KVarNCache
from cache.merging import MergingH2OKVCache
from cache.mixed import MixedH2OKVCache
from cache.quantized import QuantizedH2OKVCache
from cache.recall import RecallH2OKVCache
from cache.rotating import SinkRotatingKVCache
from cache.router import UnroutedAttention, install_router, uninstall_router, verify_routing
from cache.windowed import WINDOWED, WindowedH2OKVCache

# mlx-lm's load_prompt_cache looks cache classes up by name in its own module.
_OWN_CACHES = (
    H2OKVCache, QuantizedH2OKVCache, MixedH2OKVCache, KVarNCache, H2OKVarNCache,
    MergingH2OKVCache, RecallH2OKVCache,
)  # fmt: skip
for _cls in (*_OWN_CACHES, SinkRotatingKVCache, *WINDOWED.values()):
    setattr(_mlx_lm_cache, _cls.__name__, _cls)

__all__ = [
    "adopt_rope",
    "ATTENTION",
    "H2OKVCache",
    "H2OKVarNCache",
    "KVarNCache",
    "MergingH2OKVCache",
    "MixedH2OKVCache",
    "QuantizedH2OKVCache",
    "RecallH2OKVCache",
    "ScoredAttention",
    "ScoresMissing",
    "SinkRotatingKVCache",
    "UnroutedAttention",
    "WindowedH2OKVCache",
    "cache_usage",
    "configure",
    "install_router",
    "make_cache",
    "tokens_seen",
    "uninstall_router",
    "verify_routing",
]
