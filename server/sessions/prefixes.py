"""Prompt prefixes that new conversations share: the system prompt many chats start with.

When a new conversation's prefill reaches the end of its leading system messages
(at least --prefix-min-tokens of them; server/api/shared_prefix.py finds where),
the store keeps a copy of its caches as they stand there. A later conversation
whose prompt starts with the same tokens, under the same cache spec, starts from
a copy of that copy and prefills only the rest (`cached_tokens` says how many).

A copy of the caches, not raw K/V: under h2o and the packed policies it is what
that policy holds after prefilling the prefix itself (its evictions, the scores of
the prefix's own prefill, nothing of the conversation that stored it), so a fork
evicts and replies as if it had prefilled the prefix alone. Prefills always break
at the boundary, with or without the store (server/engine/generation.py), so a
fork and a prefill take the same chunks. MLX arrays are immutable: a copy shares
its buffers until one side writes, and the writer copies.

Entries go least recently used first, to stay within `capacity` bytes (the
--prefix-share of --kv-budget). An entry belongs to its owner (server/api/auth.py)
unless `shared`: a system prompt can be a secret.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from config.cache_spec import CacheSpec

log = logging.getLogger("h2o_server.prefixes")


@dataclass
class Prefix:
    owner: str
    spec: CacheSpec
    tokens: list[int]
    layers: list[tuple[type, Any]]  # (cache class, its state) per layer
    nbytes: int
    hits: int = 0
    last_used: float = field(default_factory=time.time)


def _detached(state: Any) -> Any:
    """The same state in new objects: arrays share buffers (immutable), the rest is copied,
    so neither side's in-place updates reach the other."""
    return tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else copy.deepcopy(x), state)


def copy_caches(caches: list) -> list:
    """Independent copies of live caches, from their states (the caller gives them what a
    state cannot hold: cache/factory.py adopt). Buffers are shared until one side writes."""
    return [type(c).from_state(_detached(c.state)) for c in caches]


class PrefixStore:
    def __init__(self, capacity: int, shared: bool = False):
        self.capacity = capacity
        self.shared = shared  # owners see each other's prefixes (--share-prefixes)
        self.entries: list[Prefix] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def _scope(self, owner: str) -> str:
        return "" if self.shared else owner

    def find(self, owner: str, spec: CacheSpec, prompt: Sequence[int]) -> Prefix | None:
        """The longest stored prefix of `prompt` (shorter than it: its last token starts
        the reply) for this owner and spec."""
        scope, best = self._scope(owner), None
        for e in self.entries:
            n = len(e.tokens)
            if e.owner != scope or e.spec != spec or n >= len(prompt):
                continue
            if (best is None or n > len(best.tokens)) and list(prompt[:n]) == e.tokens:
                best = e
        return best

    def fork(self, entry: Prefix) -> list:
        """Caches holding the prefix, for a new conversation; the caller gives them what a
        state cannot hold (cache/factory.py adopt)."""
        caches = [cls.from_state(_detached(state)) for cls, state in entry.layers]
        entry.hits += 1
        entry.last_used = time.time()
        self.entries.remove(entry)
        self.entries.append(entry)
        return caches

    def keep(self, owner: str, spec: CacheSpec, tokens: list[int], caches: list) -> bool:
        """Store a copy of `caches`, which hold exactly `tokens`; False when it cannot fit."""
        scope = self._scope(owner)
        if any(e.owner == scope and e.spec == spec and e.tokens == tokens for e in self.entries):
            return False  # two conversations prefilled it at once
        nbytes = sum(c.nbytes for c in caches)
        if nbytes > self.capacity:
            log.info(
                "a %d-token prefix (%.1f MiB) is over the prefix store's %.1f MiB: not kept",
                len(tokens),
                nbytes / 2**20,
                self.capacity / 2**20,
            )
            return False
        while self.entries and self.nbytes + nbytes > self.capacity:
            gone = self.entries.pop(0)
            log.info("prefix of %d tokens dropped (least recently used)", len(gone.tokens))
        layers = [(type(c), _detached(c.state)) for c in caches]
        self.entries.append(Prefix(scope, spec, list(tokens), layers, nbytes))
        return True
