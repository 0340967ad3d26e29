"""One conversation as the session store holds it: caches, tokens, owner, claim, stats.

Plain data and pure helpers; the store (server/sessions/store.py) decides what happens to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_lm.models.cache import ArraysCache

from cache import cache_usage
from cache.budget import STATE_CHECKPOINTS
from cache.contract import is_state, trimmable_tokens
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
    # Recurrent state layers (linear attention, SSM) cannot drop tokens: their arrays as
    # they stood when the caches held this many tokens, at each prompt's end (the points
    # an edited or re-rendered history rewinds to). Never spilled: a restored session
    # rewinds only as far as its attention layers allow and its state is exact.
    checkpoints: dict[int, list[list]] = field(default_factory=dict)
    # --draft-model's cache for this conversation (server/engine/draft_model.py DraftState):
    # never spilled, rebuilt from the tokens when needed.
    draft_state: object | None = None

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


def keep_checkpoint(session: Session) -> None:
    """Remember the state layers as they stand now (they hold len(session.tokens) tokens).
    The arrays are referenced, not copied: a layer stores new arrays, never writes these."""
    states = [c for c in session.caches or [] if is_state(c)]
    if not states:
        return
    session.checkpoints[len(session.tokens)] = [list(c.cache) for c in states]
    while len(session.checkpoints) > STATE_CHECKPOINTS:  # what the budget prices
        del session.checkpoints[min(session.checkpoints)]


def checkpoint_caches(session: Session) -> list:
    """The checkpoints as caches a spill file holds after the layers: per checkpoint (in
    token order) one ArraysCache per state layer."""
    out = []
    for point in sorted(session.checkpoints):
        for arrays in session.checkpoints[point]:
            cache = ArraysCache(len(arrays))
            cache.cache = list(arrays)
            out.append(cache)
    return out


def restore_checkpoints(session: Session, points: tuple[int, ...], caches: list) -> None:
    """The checkpoints read back from a spill file (checkpoint_caches' order)."""
    session.checkpoints.clear()
    per_point = len(caches) // len(points) if points else 0
    for i, point in enumerate(points):
        chunk = caches[i * per_point : (i + 1) * per_point]
        session.checkpoints[point] = [list(c.cache) for c in chunk]


def reuse_point(session: Session, match: int) -> int | None:
    """How many tokens the session's caches can keep of a prompt sharing `match` with
    them: `match` where every layer can drop the rest; with state layers, the newest
    checkpoint (or what they hold now) at or before it that the other layers can rewind
    to. None: nothing (a rewind would cross an eviction or precede every checkpoint)."""
    caches, held = session.caches, len(session.tokens)
    others = [c for c in caches if not is_state(c)]
    if len(others) == len(caches):
        return match if rewindable(caches, held - match) else None
    points = [k for k in session.checkpoints if k <= match] + [held] * (held <= match)
    for point in sorted(points, reverse=True):
        if rewindable(others, held - point):
            return point
    return None


def rewind_to(session: Session, point: int) -> None:
    """Rewind the caches to hold the first `point` tokens (reuse_point chose it): state
    layers from that checkpoint, the others trimmed; later checkpoints are dropped."""
    held = len(session.tokens)
    if point < held:
        states = [c for c in session.caches if is_state(c)]
        if states:
            for cache, arrays in zip(states, session.checkpoints[point], strict=True):
                cache.cache = list(arrays)
        rewind([c for c in session.caches if not is_state(c)], held - point)
    for k in [k for k in session.checkpoints if k > point]:
        del session.checkpoints[k]


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
