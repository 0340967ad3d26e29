"""KV caches, score rules, budget math and the attention router.

The policies are records in config/policies.py; the cache contract every class here
speaks is cache/contract.py.
"""

from cache.attention import ATTENTION, ScoredAttention, configure
from cache.contract import LayerCache, ScoredCache, cache_class, tokens_seen
from cache.factory import adopt, cache_usage, make_cache
from cache.policies.adaptive import AdaptiveH2OKVCache
from cache.policies.full import FullKVCache
from cache.policies.h2o import H2OKVCache, ScoresMissing
from cache.policies.h2o_kvarn import H2OKVarNCache
from cache.policies.kvarn import KVarNCache
from cache.policies.merging import MergingH2OKVCache
from cache.policies.mixed import MixedH2OKVCache
from cache.policies.quantized import QuantizedH2OKVCache
from cache.policies.recall import RecallH2OKVCache
from cache.policies.rotating import SinkRotatingKVCache
from cache.policies.windowed import WindowedH2OKVCache
from cache.router import UnroutedAttention, install_router, uninstall_router, verify_routing
from config.policies import POLICIES

# Every record's class loaded now: importing it registers it with mlx-lm's loader
# (LayerCache.__init_subclass__), before any spilled cache is read back.
for _policy in POLICIES.values():
    cache_class(_policy)

__all__ = [
    "adopt",
    "AdaptiveH2OKVCache",
    "ATTENTION",
    "FullKVCache",
    "H2OKVCache",
    "H2OKVarNCache",
    "KVarNCache",
    "LayerCache",
    "MergingH2OKVCache",
    "MixedH2OKVCache",
    "QuantizedH2OKVCache",
    "RecallH2OKVCache",
    "ScoredAttention",
    "ScoredCache",
    "ScoresMissing",
    "SinkRotatingKVCache",
    "UnroutedAttention",
    "WindowedH2OKVCache",
    "cache_class",
    "cache_usage",
    "configure",
    "install_router",
    "make_cache",
    "tokens_seen",
    "uninstall_router",
    "verify_routing",
]
