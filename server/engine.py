"""What the worker serves: the model, its tokenizer, the cache plan and the session store."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from config.settings import ServerSettings

from cache import POLICIES, install_router, make_cache, split_budget
from cache.budget import CachePlan, ModelShape, max_kv_within, parse_bytes, plan_cache
from kernels import force_backend
from server.models import DEFAULT_MODEL, load_model, on_cpu
from server.protocol import CacheOptions
from server.sessions import CacheSpec, SessionStore

log = logging.getLogger("h2o_server.engine")

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
AUTO_BUDGET_FRACTION = 0.25  # of physical memory, for --kv-budget auto
AUTO_BUDGET_CAP = 8 * 2**30


def auto_kv_budget() -> int:
    """A quarter of physical memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * 2**30
    return min(int(total * AUTO_BUDGET_FRACTION), AUTO_BUDGET_CAP)


@dataclass
class Engine:
    model: object
    tokenizer: object
    model_id: str
    shape: ModelShape
    budget: int
    plan: CachePlan
    settings: ServerSettings
    store: SessionStore
    spec: CacheSpec  # the cache of a conversation that asks for nothing else

    @classmethod
    def load(cls, settings: ServerSettings) -> Engine:
        budget = (
            auto_kv_budget() if settings.kv_budget == "auto" else parse_bytes(settings.kv_budget)
        )
        force_backend(settings.kernel)  # raises on a backend this machine lacks
        model, tokenizer = load_model(settings.model)
        shape = ModelShape.of(model, element_bytes=4 if on_cpu() else 2)
        plan = plan_cache(shape, settings.policy, budget, settings.max_sessions, settings.preset)
        install_router(model)  # idempotent; only layers with H2O caches take its path
        model_id = DEFAULT_MODEL_ID if settings.model == DEFAULT_MODEL else settings.model
        spec = CacheSpec(plan.policy, plan.max_kv, settings.preset, settings.score)
        engine = cls(model, tokenizer, model_id, shape, budget, plan, settings, None, spec)
        engine.store = SessionStore(engine.make_caches, settings.max_sessions, settings.spill_dir)
        engine.make_caches(spec)  # fails now, not on the first request, if the policy is missing
        log.info(
            "model %s; KV budget %.1f MiB over %d sessions: policy %s, max_kv %d "
            "(%.0f bytes/token)",
            model_id,
            budget / 2**20,
            settings.max_sessions,
            plan.policy,
            plan.max_kv,
            plan.bytes_per_token,
        )
        return engine

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name (rows of the embedding)."""
        return self.model.args.vocab_size

    def model_names(self) -> set[str]:
        """Names a request may use for this model."""
        return {self.model_id, self.settings.model, DEFAULT_MODEL}

    def spec_for(self, options: CacheOptions | None) -> CacheSpec:
        """The cache a request asks for (the `kv_cache` extension), kept within the budget."""
        if options is None or not options.model_fields_set:
            return self.spec
        policy = options.policy or self.spec.policy
        if policy not in POLICIES:
            raise ValueError(f"kv_cache.policy {policy!r} is not available; choose from {POLICIES}")
        limit = min(max_kv_within(self.plan.session_bytes, self.shape, policy), self.shape.context)
        max_kv = options.max_kv or limit
        if max_kv > limit:
            raise ValueError(
                f"kv_cache.max_kv {max_kv} exceeds the per-session budget: at most {limit} "
                f"tokens under {policy}"
            )
        spec = CacheSpec(
            policy, max_kv, options.preset or self.spec.preset, options.score or self.spec.score
        )
        if policy != "full":
            split_budget(spec.max_kv, spec.preset)
        return spec

    def context_limit(self, spec: CacheSpec) -> int | None:
        """Most tokens (prompt + reply) a conversation may reach; None when the cache is bounded."""
        return spec.max_kv if spec.policy == "full" else None

    def make_caches(self, spec: CacheSpec) -> list:
        return make_cache(
            self.model, spec.policy, max_kv=spec.max_kv, preset=spec.preset, score=spec.score
        )
