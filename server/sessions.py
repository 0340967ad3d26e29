"""Conversations and their KV caches, kept across turns inside the memory budget.

Only the worker thread calls into a SessionStore (it creates, trims, saves and
loads MLX caches); handlers read the plain `snapshot()` dicts it publishes.

A request finds its session by key (`prompt_cache_key` or `X-Session-ID`), or
else by the longest stored token prefix: an anonymous session is reused only
when the new prompt extends the previous request's whole prompt (so two chats
sharing a system prompt never take over each other's cache). The cache is
rewound to the last token where the stored history and the new prompt agree;
when that point lies before an eviction the conversation is rebuilt from the
prompt instead (an evicted cache cannot be rewound).

At most `max_sessions` caches live in memory (each is sized so that they all
fit the budget). Past that, the least recently used idle session is spilled
to `spill_dir` as safetensors and restored on its next turn, or, with no spill
folder, dropped; either way it is counted and logged, and the client's next
turn (which carries the whole history) rebuilds it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from cache import cache_usage
from config.cache_spec import CacheSpec
from server.jobs import Finished, SessionBusy
from server.protocol import Usage

log = logging.getLogger("h2o_server.sessions")
SPILLED_PER_RESIDENT = 16  # spilled sessions kept on disk per in-memory slot
TURNS_KEPT = 256  # per-turn figures kept per session (the cache view's history)
TURN_FIGURES = ("logical_tokens", "stored_tokens", "bytes", "evictions")


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
    stats: dict = field(default_factory=dict)
    turns: list[dict] = field(default_factory=list)  # per answered request: usage and figures

    def refresh_stats(self) -> None:
        """Publish plain numbers for handlers (called by the worker).

        logical_tokens: tokens the conversation has seen; stored_tokens: tokens its
        cache holds per layer (fewer after eviction).
        """
        seen, stored, nbytes = cache_usage(self.caches) if self.caches else (len(self.tokens), 0, 0)
        self.stats = {
            "id": self.id,
            "policy": self.spec.policy,
            "max_kv": self.spec.max_kv,
            "preset": self.spec.preset,
            "score": self.spec.score,
            "logical_tokens": seen,
            "stored_tokens": stored,
            "bytes": nbytes,
            "evictions": seen - stored if self.caches else 0,
            "spilled": self.caches is None,
            "busy": self.busy,
            "last_used": int(self.last_used),
        }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def rewind(caches: list, n: int) -> bool:
    """Drop the n newest tokens from every layer; False when some layer cannot."""
    if n == 0:
        return True
    if not all(c.is_trimmable() for c in caches):
        return False
    return all(c.trim(n) == n for c in caches)


class SessionStore:
    def __init__(
        self,
        make_caches: Callable[[CacheSpec], list],
        max_sessions: int,
        spill_dir: str | Path | None = None,
    ):
        self.make_caches = make_caches
        self.max_sessions = max_sessions
        self.spill_dir = Path(spill_dir) if spill_dir else None
        if self.spill_dir:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.counts: Counter[str] = Counter()  # spilled, dropped, restored, rebuilt
        self.sessions: dict[str, Session] = {}

    # ------------------------------------------------------------------ lookup

    def acquire(self, key: str | None, prompt: list[int], spec: CacheSpec) -> tuple[Session, int]:
        """The session for this prompt, rewound so it holds a prefix of it; marks it busy.

        Returns (session, reused tokens). At least the prompt's last token is left
        to prefill, since its logits start the reply.
        """
        session = self._find(key, prompt)
        if session is None:
            session = Session(id=key or f"anon-{uuid.uuid4().hex[:16]}", spec=spec, keyed=bool(key))
            self.sessions[session.id] = session
        session.busy = True
        try:
            self._make_room(keep=session)
            if session.caches is None and session.spill_path is not None:
                self._restore(session)
            if session.spec != spec or session.caches is None:
                self._reset(session, spec)
            match = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
            if not rewind(session.caches, len(session.tokens) - match):
                self.counts["rebuilt"] += 1
                self._reset(session, spec)
                match = 0
            del session.tokens[match:]
        except BaseException:
            session.busy = False
            raise
        session.prompt_len = len(prompt)
        session.last_used = time.time()
        return session, match

    def _find(self, key: str | None, prompt: list[int]) -> Session | None:
        if key:
            session = self.sessions.get(key)
            if session is not None and session.busy:
                raise SessionBusy(key)
            return session
        best, best_len = None, 0
        for s in self.sessions.values():
            if s.keyed or s.busy or not s.prompt_len:
                continue
            n = common_prefix(s.tokens, prompt)
            if n >= s.prompt_len and n > best_len:
                best, best_len = s, n
        return best

    def release(self, session: Session, broken: bool = False, turn: Finished | None = None) -> None:
        """The request is over. A request that failed midway leaves no cache behind.

        `turn` (what the request used) is recorded with the cache's figures after it.
        """
        if broken:
            session.caches, session.tokens = None, []
        session.busy = False
        session.last_used = time.time()
        session.refresh_stats()
        if turn is not None:
            usage = Usage.of(turn.prompt_tokens, turn.completion_tokens, turn.cached_tokens)
            figures = {name: session.stats[name] for name in TURN_FIGURES}
            record = {"usage": usage.model_dump(), **figures}
            session.turns = [*session.turns[-(TURNS_KEPT - 1) :], record]

    def delete(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        if session is None:
            return False
        if session.busy:
            raise SessionBusy(session_id)
        self._forget(session)
        return True

    def snapshot(self) -> list[dict]:
        for s in self.sessions.values():
            if not s.stats:
                s.refresh_stats()
        return [dict(s.stats) for s in self.sessions.values()]

    def in_memory(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.caches is not None]

    # ------------------------------------------------------------------ memory

    def _make_room(self, keep: Session) -> None:
        """Spill or drop least recently used idle sessions until `keep` fits."""
        resident = [s for s in self.in_memory() if s is not keep]
        excess = len(resident) + 1 - self.max_sessions
        idle = sorted((s for s in resident if not s.busy), key=lambda s: s.last_used)
        for victim in idle[: max(0, excess)]:
            if self.spill_dir:
                self._spill(victim)
            else:
                self._drop(victim, "no --spill-dir")
        # Disk is bounded too: the oldest spilled sessions go first.
        spilled = sorted(
            (s for s in self.sessions.values() if s.spill_path is not None),
            key=lambda s: s.last_used,
        )
        for victim in spilled[: max(0, len(spilled) - SPILLED_PER_RESIDENT * self.max_sessions)]:
            self._drop(victim, "too many spilled sessions")

    def _drop(self, session: Session, why: str) -> None:
        log.info("session %s dropped (%s); its next turn rebuilds it", session.id, why)
        self.counts["dropped"] += 1
        self._forget(session)

    def _spill(self, session: Session) -> None:
        path = self.spill_dir / f"{session.id}.safetensors"
        save_prompt_cache(str(path), session.caches, {"tokens": json.dumps(session.tokens)})
        session.refresh_stats()  # its evictions, while the caches can still tell them
        session.stats.update(spilled=True, stored_tokens=0, bytes=0)
        session.caches, session.spill_path = None, path
        log.info("session %s spilled to %s", session.id, path)
        self.counts["spilled"] += 1

    def _restore(self, session: Session) -> None:
        caches, meta = load_prompt_cache(str(session.spill_path), return_metadata=True)
        session.caches = caches
        session.tokens = json.loads(meta["tokens"])
        session.spill_path.unlink(missing_ok=True)
        session.spill_path = None
        log.info("session %s restored", session.id)
        self.counts["restored"] += 1

    def _reset(self, session: Session, spec: CacheSpec) -> None:
        session.spec, session.caches, session.tokens = spec, self.make_caches(spec), []

    def _forget(self, session: Session) -> None:
        if session.spill_path is not None:
            session.spill_path.unlink(missing_ok=True)
        self.sessions.pop(session.id, None)
