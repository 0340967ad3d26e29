"""H2O KV caches, score rules, budget presets and the attention router."""

import config  # noqa: F401  (loads OpenBLAS before the first mlx import)

import mlx_lm.models.cache as _mlx_lm_cache

from cache.factory import POLICIES, cache_usage, make_cache
from cache.h2o import H2OKVCache
from cache.presets import PRESETS, H2OBudget, split_budget
from cache.router import install_router, uninstall_router
from cache.scores import SCORE_RULES

# mlx-lm's load_prompt_cache looks cache classes up by name in its own module.
setattr(_mlx_lm_cache, H2OKVCache.__name__, H2OKVCache)

__all__ = [
    "POLICIES",
    "PRESETS",
    "SCORE_RULES",
    "H2OBudget",
    "H2OKVCache",
    "cache_usage",
    "install_router",
    "make_cache",
    "split_budget",
    "uninstall_router",
]
