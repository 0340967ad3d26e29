"""One conversation as the session store holds it: caches, tokens, owner, claim, stats.

Plain data and pure helpers; the store (server/sessions/store.py) decides what happens to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from cache import cache_usage
from cache.contract import trimmable_tokens
from config.cache_spec import CacheSpec
from server.sessions.claims import Claim
from server.sessions.spill import SpilledSession


@dataclass
class Session:
    id: str
    spec: CacheSpec
    keyed: bool  # found by key, never by prefix
    caches: list | None = None  # None while spilled
    tokens: list[int] = field(default_factory=list)  # what the caches hold, in order
    prompt_len: int = 0  # the last request's prompt length
    last_used: float = field(default_factory=time.time)
    busy: bool = False
    spill_path: Path | None = None
    owner: str = ""  # who may see it (server/api/auth.py); "" = everyone
    evictions: int = 0  # as of the last spill (a spilled session's caches cannot tell)
    claim: Claim | None = None  # held while the caches are in memory (shared spill folder)
    borrowed: bool = False  # a throwaway for one turn: another replica owns the session
    # Its caches serve one request and are dropped after: a borrowed session, a request's
    # extra choices (n > 1), the prompts of a batched completion.
    throwaway: bool = False
    prefix_tokens: int = 0  # tokens its cache started from, forked from the prefix store
    stats: dict = field(default_factory=dict)
    turns: list[dict] = field(default_factory=list)  # per answered request: usage and figures

    def refresh_stats(self) -> None:
        """Publish plain numbers for handlers (called by the worker).

        logical_tokens: tokens the conversation has seen; stored_tokens: tokens its
        largest layer cache holds (fewer after eviction).
        """
        if self.caches:
            seen, stored, nbytes = cache_usage(self.caches)
            self.evictions = seen - stored
        else:
            seen, stored, nbytes = len(self.tokens), 0, 0
        self.stats = {
            "id": self.id,
            "policy": self.spec.policy,
            "max_kv": self.spec.max_kv,
            "layer_max_kv": self.spec.layer_sizes() or None,
            "preset": self.spec.preset,
            "score": self.spec.score,
            "kvarn": self.spec.kvarn if "kvarn" in self.spec.info.knobs else None,
            "dense_until": self.spec.dense_until or None,
            "logical_tokens": seen,
            "stored_tokens": stored,
            "bytes": nbytes,
            "evictions": self.evictions,
            "spilled": self.caches is None,
            "busy": self.busy,
            "last_used": int(self.last_used),
            "prefix_tokens": self.prefix_tokens,
        }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def rewindable(caches: list, n: int) -> bool:
    """Whether every layer can drop its n newest tokens (H2O: none of them evicted)."""
    return n == 0 or all(trimmable_tokens(c) >= n for c in caches)


def rewind(caches: list, n: int) -> None:
    """Drop the n newest tokens from every layer (rewindable said they can)."""
    if n:
        for c in caches:
            c.trim(n)


def spilled_session(f: SpilledSession) -> Session:
    session = Session(
        id=f.id,
        spec=f.spec,
        keyed=f.keyed,
        tokens=f.tokens,
        prompt_len=f.prompt_len,
        last_used=f.mtime,
        spill_path=f.path,
        owner=f.owner,
        evictions=f.evictions,
    )
    session.refresh_stats()
    return session
