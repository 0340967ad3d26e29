"""What the worker serves: the model, its tokenizer, the budget and the session store."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cache import ATTENTION, configure, make_cache
from cache.budget import Budget, ModelShape, fit_spec, parse_bytes, session_bytes
from cache.factory import unbound_rule_notices, window_fallback
from cache.kernel_check import check_kernels
from config.cache_spec import CacheSpec
from config.settings import ServerSettings
from models.loading import load_model, parameter_bytes, served_model_id
from models.shape import kv_shape, layer_windows, text_args
from server.api.common import CacheOptions
from server.api.tool_formats import ToolFormat, format_for
from server.engine.draft_model import DraftModel, DraftModelError
from server.engine.grammar import Grammars
from server.engine.layer_budgets import load_layer_profile
from server.sessions.prefixes import PrefixStore
from server.sessions.spill import model_identity
from server.sessions.store import SessionStore

log = logging.getLogger("h2o_server.engine")

AUTO_BUDGET_FRACTION = 0.25  # of physical memory, for --kv-budget auto
AUTO_BUDGET_CAP = 8 * 2**30


AUTO_MEMORY_FRACTION = 0.75  # of physical memory, for --memory-budget auto (what Metal
# lets the GPU wire by default on most Macs)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


def auto_kv_budget() -> int:
    """A quarter of physical memory, at most 8 GiB."""
    return min(int(physical_memory() * AUTO_BUDGET_FRACTION), AUTO_BUDGET_CAP)


def auto_memory_budget() -> int:
    """Three quarters of physical memory: every loaded model's weights and KV share."""
    return int(physical_memory() * AUTO_MEMORY_FRACTION)


def kv_budget_bytes(text: str) -> int:
    """--kv-budget in bytes: `auto` (auto_kv_budget), or a size such as 1GiB."""
    return auto_kv_budget() if text == "auto" else parse_bytes(text)


def memory_budget_bytes(text: str) -> int:
    """--memory-budget in bytes: `auto` (auto_memory_budget), a size, or 0 / "" for none."""
    return auto_memory_budget() if text == "auto" else parse_bytes(text) if text else 0


def startup_notices(shape: ModelShape, spec: CacheSpec, windows: list[int | None]) -> list[str]:
    """What start-up chose for the user without being told: logged, and in /health."""
    notices = []
    if not shape.context_stated:
        notices.append(
            f"the model states no context length (max_position_embeddings): assuming "
            f"{shape.context} tokens; set --context to its real one"
        )
    if fallback := window_fallback(spec.info, windows, spec.max_kv):
        notices.append(fallback)
    return notices


@dataclass
class Engine:
    model: object
    tokenizer: object
    model_id: str
    shape: ModelShape
    budget: Budget  # the sessions' share of --kv-budget
    settings: ServerSettings
    spec: CacheSpec  # the cache of a conversation that asks for nothing else
    store: SessionStore
    shares_for: Callable[[str], tuple | None] | None  # a policy's layer shares (profile)
    # What start-up chose without being told (logged, and shown by /health).
    notices: list[str] = field(default_factory=list)
    grammars: Grammars = field(init=False)  # constrained decoding (server/engine/grammar.py)
    # How the model writes tool calls, read from its template (server/api/tool_formats).
    tool_format: ToolFormat = field(init=False)
    name: str = ""  # its catalog name (server/engine/catalog.py), set by the registry
    draft: DraftModel | None = None  # --draft-model, where it shares this model's tokenizer
    weight_bytes: int = field(init=False)  # its parameters' bytes as loaded

    def __post_init__(self):
        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        self.tool_format = format_for(self.tokenizer)
        self.weight_bytes = parameter_bytes(self.model)

    @classmethod
    def load(cls, settings: ServerSettings) -> Engine:
        total = kv_budget_bytes(settings.kv_budget)
        prefix_bytes = int(total * settings.prefix_share)
        budget = Budget(total - prefix_bytes, settings.max_sessions)
        configure(backend=settings.kernel)  # raises on a backend this machine lacks
        # Each GPU kernel it will use, run once against the reference: a failing one is
        # withdrawn (its calls take the reference) with a notice.
        kernel_notices = check_kernels(ATTENTION.backend)
        for notice in kernel_notices:
            log.warning("%s", notice)
        model, tokenizer = load_model(settings.model)
        shape = kv_shape(model)
        if settings.context:
            shape = replace(shape, context=settings.context, context_stated=True)
        if (
            settings.prefill_step > shape.context // 4
        ):  # cache/policies/h2o.py re-indexes 1/4 before
            log.warning(
                "--prefill-step %d is over a quarter of the context (%d): a prompt chunk may "
                "take RoPE positions past the context before H2O re-indexes them",
                settings.prefill_step,
                shape.context,
            )
        model_id = (settings.served_model_name or [served_model_id(settings.model)])[0]
        profile, layer_budgets = load_layer_profile(
            settings.layer_budgets, model, served_model_id(settings.model)
        )
        shares_for = profile.shares if profile else None
        spec = fit_spec(
            shape,
            budget,
            settings.policy,
            shares_for=shares_for,
            preset=settings.preset,
            score=settings.score,
            rotate=settings.kv_rotate,
            group_size=settings.kv_group_size,
            dense_recent=settings.kv_dense_recent,
            kvarn=settings.kvarn,
        )
        # fails now, not on the first request, if the policy cannot run
        caches = make_cache(model, spec)
        notices = startup_notices(shape, spec, layer_windows(model))
        for notice in notices:
            log.warning("%s", notice)
        notices = kernel_notices + notices
        notices += unbound_rule_notices(caches)  # make_cache logged it
        spill_budget = (
            2 * total if settings.spill_budget == "auto" else parse_bytes(settings.spill_budget)
        )
        store = SessionStore(
            # The batcher evaluates every step's scores with its tokens (one evaluation per
            # step, not one per layer: server/engine/batcher.py).
            lambda s: make_cache(model, s, context=shape.context, scores_with_step=True),
            settings.max_sessions,
            settings.spill_dir,
            model_identity=model_identity(model) if settings.spill_dir else "",
            spill_budget=spill_budget,
            prefixes=PrefixStore(prefix_bytes, settings.share_prefixes) if prefix_bytes else None,
        )
        sizes = spec.layer_sizes()
        log.info(
            "model %s; KV budget %.1f MiB: %.1f MiB for shared prefixes, the rest over %d "
            "sessions: policy %s%s, max_kv %d (%.1f MiB per session, %d of %d layers "
            "sliding-window); layer budgets %s%s",
            model_id,
            total / 2**20,
            prefix_bytes / 2**20,
            settings.max_sessions,
            spec.policy,
            f" (dense until {spec.dense_until} tokens)" if spec.dense_until else "",
            spec.max_kv,
            session_bytes(shape, spec) / 2**20,
            len(shape.windows),
            shape.layers,
            layer_budgets,
            f": max_kv {min(sizes)}-{max(sizes)} per layer" if sizes else "",
        )
        engine = cls(
            model, tokenizer, model_id, shape, budget, settings, spec, store, shares_for, notices
        )
        if settings.draft_model:
            engine.draft = load_draft_model(
                settings.draft_model, engine.weight_bytes, tokenizer, notices
            )
        fmt = engine.tool_format
        log.info(
            "tool calls: %s format%s; reasoning: %s",
            fmt.name,
            "" if fmt.native else " (the template has no tools: described in a system message)",
            "Harmony channels"
            if fmt.name == "harmony"
            else (
                f"{tokenizer.think_start}...{tokenizer.think_end}"
                if getattr(tokenizer, "has_thinking", False)
                else "none"
            ),
        )
        return engine

    @property
    def kv_budget(self) -> int:
        """All of --kv-budget: the sessions' and the prefix store's."""
        capacity = self.store.prefixes.capacity if self.store.prefixes else 0
        return self.budget.total + capacity

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name (rows of the embedding)."""
        return text_args(self.model).vocab_size

    def spec_for(self, options: CacheOptions | None) -> CacheSpec:
        """The cache a request asks for (the `kv_cache` extension), kept within the budget."""
        if options is None or not options.model_fields_set:
            return self.spec
        # Without a policy of its own, the server's starts dense as the server's spec does
        # (`auto`'s kvarn); a policy asked for by name is that policy from the first token.
        starts = {"dense_until": self.spec.dense_until} if options.policy is None else {}
        return fit_spec(
            self.shape,
            self.budget,
            options.policy or self.spec.policy,
            max_kv=options.max_kv,
            shares_for=self.shares_for,
            preset=options.preset or self.spec.preset,
            score=options.score or self.spec.score,
            rotate=self.spec.rotate,
            group_size=self.spec.group_size,
            dense_recent=self.spec.dense_recent,
            kvarn=options.kvarn or self.spec.kvarn,
            **starts,
        )

    def prompt_limit(self, spec: CacheSpec) -> int | None:
        """Longest prompt a request may send: the context, or --max-prompt-tokens.

        Only a cache that evicts can hold a conversation past the context, so the flag
        raises the limit for those policies alone. None (any length) for policies whose
        conversations outgrow the context: the worker limits the part of the prompt
        their session does not hold yet instead (new_token_limit).
        """
        if spec.info.reindexes:
            return None
        context = self.shape.context
        wanted = self.settings.max_prompt_tokens or context
        return wanted if spec.info.bounded else min(wanted, context)

    def new_token_limit(self) -> int:
        """Most prompt tokens one request may prefill: a conversation past the context
        grows by a turn at a time, never by a document that would hold a slot for hours."""
        return self.settings.max_prompt_tokens or self.shape.context

    def context_limit(self, spec: CacheSpec) -> int | None:
        """Most tokens (prompt + reply) a conversation may reach; None when the cache is bounded."""
        return None if spec.info.bounded else spec.max_kv


def load_draft_model(
    source: str, target_bytes: int, target_tokenizer, notices: list[str]
) -> DraftModel | None:
    """--draft-model for a target of `target_bytes` of weights, or None with a notice where
    it cannot serve it (a server of several models uses it for those that share its
    tokenizer)."""
    model, tokenizer = load_model(source)
    try:
        draft = DraftModel(
            model, tokenizer, target_tokenizer, cost=parameter_bytes(model) / target_bytes
        )
    except DraftModelError as e:
        notices.append(f"--draft-model {source} not used: {e}")
        log.warning("%s", notices[-1])
        return None
    log.info("draft model %s: a pass costs %.2f of the model's", source, draft.cost)
    return draft
