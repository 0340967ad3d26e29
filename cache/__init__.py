"""H2O KV caches, score rules, budget presets and the attention router."""

import config  # noqa: F401  (loads OpenBLAS before the first mlx import)

import mlx_lm.models.cache as _mlx_lm_cache

from cache.factory import POLICIES, cache_usage, make_cache
from cache.h2o import H2OKVCache
from cache.presets import PRESETS, H2OBudget, split_budget
from cache.quantized import MixedH2OKVCache, QuantizedH2OKVCache, set_quantized_attention
from cache.router import install_router, uninstall_router
from cache.scores import SCORE_RULES

# mlx-lm's load_prompt_cache looks cache classes up by name in its own module.
for _cls in (H2OKVCache, QuantizedH2OKVCache, MixedH2OKVCache):
    setattr(_mlx_lm_cache, _cls.__name__, _cls)

__all__ = [
    "POLICIES",
    "PRESETS",
    "SCORE_RULES",
    "H2OBudget",
    "H2OKVCache",
    "MixedH2OKVCache",
    "QuantizedH2OKVCache",
    "cache_usage",
    "install_router",
    "make_cache",
    "set_quantized_attention",
    "split_budget",
    "uninstall_router",
]
