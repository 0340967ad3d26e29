"""Conversations and their KV caches, kept across turns inside the memory budget.

Only the worker thread calls into a SessionStore (it creates, trims, saves and
loads MLX caches); handlers read the plain `snapshot()` dicts it publishes.

A request finds its session by key (`prompt_cache_key` or `X-Session-ID`), or
else by the longest stored token prefix: an anonymous session is reused only
when the new prompt extends the previous request's whole prompt (so two chats
sharing a system prompt never take over each other's cache). The cache is
rewound to the last token where the stored history and the new prompt agree.
An evicting cache can be rewound as long as it still holds every token after
that point (the recent window, or everything since the last eviction); when
the point lies before an evicted token the conversation is rebuilt from the
prompt instead (an evicted token cannot be restored).

At most `max_sessions` caches live in memory (each is sized so that they all
fit the budget). Past that, the least recently used idle session is spilled
to `spill_dir` (server/sessions/spill.py) and restored on its next turn, or, with no
spill folder, dropped; either way it is counted and logged, and the client's
next turn (which carries the whole history) rebuilds it. Spilled sessions
outlive the process: the folder is indexed on start.

Several replicas may share one spill folder. A replica owns the sessions it
holds in memory (a claim, server/sessions/claims.py) and finds the ones others spilled
by looking at the folder on every request; a session another replica holds is
waited for (it hands it over once idle) and, past `claim_wait`, served with a
throwaway cache rebuilt from the prompt, so two replicas never own one.
`tick()` spills sessions idle past `--spill-idle-seconds` and those another
replica asked for.

A new conversation (or one whose cache cannot serve its prompt) may start from a
prefix another conversation stored: the prefix store (server/sessions/prefixes.py)
keeps copies of caches at the end of long system prompts; `keep_prefix` is called
by the generation whose prefill reaches that point.

With sessions scoped to callers, each session has an `owner` (server/api/auth.py)
and lookups, listings and deletions see only the caller's own sessions.

A request that fails leaves no session behind: its cache is in an unknown
state, so the session is forgotten (and rebuilt from the history next turn).
After every change the store publishes plain snapshots (`published`,
`published_counts`) that handlers read without waiting for the worker.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from cache import adopt
from cache.factory import spec_as_held
from config.cache_spec import CacheSpec
from server.api.chat.protocol import Usage
from server.engine.jobs import Finished, PromptTooLong, SessionBusy, SessionClaimed
from server.sessions.conversation import (
    Session,
    checkpoint_caches,
    common_prefix,
    restore_checkpoints,
    reuse_point,
    rewind_to,
    spilled_session,
)
from server.sessions.prefixes import Prefix, PrefixStore, copy_caches
from server.sessions.spill import SpillError, SpillFolder

log = logging.getLogger("h2o_server.sessions")
SPILLED_PER_RESIDENT = 16  # spilled sessions kept on disk per in-memory slot
TURNS_KEPT = 256  # per-turn figures kept per session (the cache view's history)
TURN_FIGURES = ("logical_tokens", "stored_tokens", "bytes", "evictions")


class SessionStore:
    def __init__(
        self,
        make_caches: Callable[[CacheSpec], list],
        max_sessions: int,
        spill_dir: str | Path | None = None,
        *,
        model_identity: str = "",
        spill_budget: int = 2**62,
        prefixes: PrefixStore | None = None,
    ):
        self.make_caches = make_caches
        self.prefixes = prefixes
        self.max_sessions = max_sessions
        self.counts: Counter[str] = Counter()  # spilled, dropped, ... (server/engine/metrics.py)
        self.sessions: dict[tuple[str, str], Session] = {}  # (owner, id) -> session
        self.published: list[tuple[str, dict]] = []  # (owner, stats), for handlers
        self.published_counts: dict[str, int] = {}
        self.spill = None
        if spill_dir:
            max_files = SPILLED_PER_RESIDENT * max_sessions
            self.spill = SpillFolder(spill_dir, model_identity, spill_budget, max_files)
            self._index()
        self._publish()

    # ------------------------------------------------------------------ lookup

    def acquire(
        self,
        key: str | None,
        prompt: list[int],
        spec: CacheSpec,
        owner: str = "",
        borrow: bool = False,
        max_new: int | None = None,
        *,
        reuse: bool = True,
        keep: bool = True,
    ) -> tuple[Session, int]:
        """The session for this prompt, rewound so it holds a prefix of it; marks it busy.

        Returns (session, reused tokens). At least the prompt's last token is left
        to prefill, since its logits start the reply. If this fails, the session is
        forgotten: no half-prepared session stays behind. Raises SessionClaimed while
        another replica owns the session, unless `borrow`; PromptTooLong, before the
        session is touched, when more than `max_new` tokens would need prefilling.
        `reuse` False: the whole prompt is prefilled (its logprobs are wanted); `keep`
        False: an anonymous throwaway session that no later request finds.
        """
        self._sync()
        session = self._find(owner, key, prompt) if keep else None
        if session is None:
            session_id = key or f"anon-{uuid.uuid4().hex[:16]}"
            session = Session(
                id=session_id, spec=spec, keyed=bool(key), owner=owner, throwaway=not keep
            )
        if not session.throwaway and not self._own(session):  # nobody else finds a throwaway
            if not borrow:
                raise SessionClaimed(session.id)
            log.info("session %s is held by another replica; this turn is rebuilt", session.id)
            self.counts["borrowed"] += 1
            session = Session(
                id=session.id, spec=spec, keyed=True, owner=owner, borrowed=True, throwaway=True
            )
        elif (owner, session.id) not in self.sessions and not session.throwaway:
            self.sessions[(owner, session.id)] = session
        fresh = session.caches is None and session.spill_path is None and not session.throwaway
        if fresh and self.spill is not None:
            on_disk = self.spill.file_for(owner, session.id)  # spilled since _sync looked
            session.spill_path = on_disk if on_disk.exists() else None
        session.busy = True
        try:
            self._make_room(keep=session)
            if session.caches is None and session.spill_path is not None:
                self._restore(session)
            match, crosses = self._reuse(session, spec, prompt) if reuse else (0, False)
            prefix = self._prefix_for(owner, spec, prompt, match) if reuse else None
            kept = len(prefix.tokens) if prefix else match
            if max_new is not None and len(prompt) - kept > max_new:
                raise PromptTooLong(len(prompt) - kept)
            if prefix is not None:
                self._fork(session, spec, prefix)
                match = kept
            elif match:
                rewind_to(session, match)
            else:
                if crosses:
                    self.counts["rebuilt"] += 1
                self._reset(session, spec)
            del session.tokens[match:]
        except PromptTooLong:
            session.busy = False
            if not session.tokens:  # it held nothing: no phantom session stays
                self._forget(session)
            self._publish()
            raise
        except BaseException:
            self._forget(session)
            self._publish()
            raise
        session.prompt_len = len(prompt)
        session.last_used = time.time()
        session.refresh_stats()
        self._publish()
        return session, match

    @staticmethod
    def _reuse(session: Session, spec: CacheSpec, prompt: list[int]) -> tuple[int, bool]:
        """(prompt tokens the session's cache can keep, whether none because a rewind would
        cross an eviction); (0, False) when its cache is missing or of another spec."""
        if session.spec != spec or session.caches is None:
            return 0, False
        match = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
        point = reuse_point(session, match)
        return (0, True) if point is None else (point, False)

    def _prefix_for(
        self, owner: str, spec: CacheSpec, prompt: list[int], match: int
    ) -> Prefix | None:
        """A stored prefix of the prompt longer than what the session's own cache keeps."""
        if self.prefixes is None:
            return None
        prefix = self.prefixes.find(owner, spec, prompt)
        return prefix if prefix is not None and len(prefix.tokens) > match else None

    def _adopt(self, session: Session) -> None:
        """Give caches built from a state (a fork, a spill file) what make_cache attaches
        and a state cannot hold, from fresh caches of the kinds they hold (spec_as_held)."""
        adopt(session.caches, self.make_caches(spec_as_held(session.spec, session.caches)))

    def _fork(self, session: Session, spec: CacheSpec, prefix: Prefix) -> None:
        session.spec, session.tokens = spec, list(prefix.tokens)
        session.prefix_tokens = len(prefix.tokens)
        session.caches = self.prefixes.fork(prefix)
        session.checkpoints.clear()
        self._adopt(session)
        self.counts["prefix_hits"] += 1
        self.counts["prefix_tokens"] += len(prefix.tokens)
        log.info("session %s starts from a stored %d-token prefix", session.id, len(prefix.tokens))

    def prefix_figures(self) -> dict:
        """The prefix store's size and use, for /metrics and the cache view."""
        prefixes = self.prefixes
        return {
            "entries": len(prefixes.entries) if prefixes else 0,
            "bytes": prefixes.nbytes if prefixes else 0,
            "capacity": prefixes.capacity if prefixes else 0,
            "hits": self.counts["prefix_hits"],
            "tokens": self.counts["prefix_tokens"],
        }

    def fork(self, session: Session, count: int) -> list[Session]:
        """`count` throwaway copies of a busy session as it stands: a request's extra
        choices (n > 1), which decode from its prompt prefilled once."""
        copies = []
        for i in range(1, count + 1):
            copy = Session(
                id=f"{session.id}.{i}",
                spec=session.spec,
                keyed=False,
                owner=session.owner,
                tokens=list(session.tokens),
                busy=True,
                throwaway=True,
            )
            copy.caches = copy_caches(session.caches)
            self._adopt(copy)
            copies.append(copy)
        return copies

    def keep_prefix(self, session: Session) -> None:
        """The session's caches hold exactly a shareable prefix now: store a copy."""
        if self.prefixes is not None and not session.borrowed:
            self.prefixes.keep(session.owner, session.spec, session.tokens, session.caches)
            self._publish()

    def _find(self, owner: str, key: str | None, prompt: list[int]) -> Session | None:
        if key:
            session = self.sessions.get((owner, key))
            if session is not None and session.busy:
                raise SessionBusy(key)
            return session
        best, best_len = None, 0
        for s in self.sessions.values():
            if s.keyed or s.busy or not s.prompt_len or s.owner != owner:
                continue
            n = common_prefix(s.tokens, prompt)
            if n >= s.prompt_len and n > best_len:
                best, best_len = s, n
        return best

    def release(self, session: Session, broken: bool = False, turn: Finished | None = None) -> None:
        """The request is over. One that failed midway leaves no session behind.

        `turn` (what the request used) is recorded with the cache's figures after it.
        """
        session.busy = False
        session.last_used = time.time()
        if session.throwaway:
            session.caches, session.draft_state = None, None
            session.checkpoints.clear()
        elif broken:
            log.warning("session %s discarded: its request failed midway", session.id)
            self._forget(session)
        else:
            session.refresh_stats()
            if turn is not None:
                usage = Usage.of(turn.prompt_tokens, turn.completion_tokens, turn.cached_tokens)
                figures = {name: session.stats[name] for name in TURN_FIGURES}
                record = {"usage": usage.model_dump(), **figures}
                session.turns = [*session.turns[-(TURNS_KEPT - 1) :], record]
        self._publish()

    def delete(self, session_id: str, owner: str = "") -> bool:
        session = self.sessions.get((owner, session_id))
        if session is None:
            return False
        if session.busy:
            raise SessionBusy(session_id)
        self._forget(session)
        self._publish()
        return True

    def snapshot(self) -> list[dict]:
        return [dict(stats) for _, stats in self.published]

    def in_memory(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.caches is not None]

    def spill_all(self) -> int:
        """Write every idle session in memory to the spill folder (at shutdown); how many."""
        if self.spill is None:
            return 0
        idle = [s for s in self.in_memory() if not s.busy]
        for session in idle:
            self._spill(session)
        self._publish()
        return len(idle)

    def tick(self, idle_seconds: float | None) -> int:
        """Spill sessions idle past `idle_seconds` and those another replica wants; how many."""
        if self.spill is None:
            return 0
        now, spilled = time.time(), 0
        for session in [s for s in self.in_memory() if not s.busy]:
            wanted = self.spill.wanted(session.owner, session.id)
            idle = idle_seconds is not None and now - session.last_used >= idle_seconds
            if wanted or idle:
                why = "another replica asked for it" if wanted else "idle"
                self._spill(session, why)
                self.counts["handed_over"] += wanted
                spilled += 1
        if spilled:
            self._publish()
        return spilled

    def close(self) -> None:
        """Release the spill folder (sessions already spilled stay there for the next start)."""
        if self.spill is not None:
            for session in self.in_memory():
                self._forget(session)  # busy at exit: nobody may wait for its claim
            self.spill.close()

    def _publish(self) -> None:
        """Plain copies for handlers on other threads (one reference swap each)."""
        for s in self.sessions.values():
            if not s.stats:
                s.refresh_stats()
        self.published = [(s.owner, dict(s.stats)) for s in self.sessions.values()]
        self.published_counts = dict(self.counts)
        self.published_prefixes = self.prefix_figures()

    # ------------------------------------------------------------------ memory

    def _make_room(self, keep: Session) -> None:
        """Spill or drop least recently used idle sessions until `keep` fits."""
        resident = [s for s in self.in_memory() if s is not keep]
        excess = len(resident) + 1 - self.max_sessions
        idle = sorted((s for s in resident if not s.busy), key=lambda s: s.last_used)
        for victim in idle[: max(0, excess)]:
            if self.spill:
                self._spill(victim)
            else:
                self._drop(victim, "no --spill-dir")
        self._trim_disk()

    def _trim_disk(self) -> None:
        """Disk is bounded too (every file in the folder counts): the oldest spills go first."""
        if self.spill is None:
            return
        spilled = sorted(
            (s for s in self.sessions.values() if s.spill_path is not None),
            key=lambda s: s.last_used,
        )
        while spilled and self.spill.over_budget():
            self._drop(spilled.pop(0), "over --spill-budget")

    def _drop(self, session: Session, why: str) -> None:
        log.info("session %s dropped (%s); its next turn rebuilds it", session.id, why)
        self.counts["dropped"] += 1
        self._forget(session)

    def _spill(self, session: Session, why: str = "memory") -> None:
        path = self.spill.file_for(session.owner, session.id)
        session.refresh_stats()  # its evictions, while the caches can still tell them
        header = {
            "id": session.id,
            "owner": session.owner,
            "keyed": session.keyed,
            "spec": session.spec.as_dict(),
            "tokens": session.tokens,
            "prompt_len": session.prompt_len,
            "evictions": session.evictions,
            "layers": len(session.caches),
            "checkpoints": sorted(session.checkpoints),
        }
        try:
            nbytes = self.spill.write(path, session.caches + checkpoint_caches(session), header)
        except OSError as e:
            log.error("session %s could not be spilled (%s)", session.id, e)
            self._drop(session, "spill failed")
            return
        session.caches, session.spill_path, session.draft_state = None, path, None
        session.checkpoints.clear()  # their arrays go with the caches
        self._disown(session)  # written first: whoever claims it next finds the file
        session.refresh_stats()
        log.info("session %s spilled to %s (%s, %.1f MiB)", session.id, path, why, nbytes / 2**20)
        self.counts["spilled"] += 1

    def _restore(self, session: Session) -> None:
        """Load a spilled session; a file that cannot be used is refused and the session rebuilt.

        The header is read again: another replica may have written a newer turn since
        this one indexed the file, or taken it.
        """
        path, session.spill_path = session.spill_path, None
        try:
            header = self.spill.describe(path)
            session.tokens, session.prompt_len = header.tokens, header.prompt_len
            session.spec, session.evictions = header.spec, header.evictions
            caches = self.spill.read(path, len(session.tokens))
            layers = header.layers or len(caches)
            session.caches = caches[:layers]
            restore_checkpoints(session, header.checkpoints, caches[layers:])
            self._adopt(session)
            log.info("session %s restored", session.id)
            self.counts["restored"] += 1
        except SpillError as e:
            log.warning("session %s: spill file %s refused: %s; rebuilt", session.id, path, e)
            self.counts["refused"] += 1
            session.caches, session.tokens = None, []
        except FileNotFoundError:
            log.info("session %s: its spill file is gone (dropped elsewhere); rebuilt", session.id)
            session.caches, session.tokens = None, []
        finally:
            path.unlink(missing_ok=True)

    def _index(self) -> None:
        """Spilled sessions of an earlier run (server/sessions/spill.py indexes the folder)."""
        found = self.spill.index()
        for f in found:
            self.sessions[(f.owner, f.id)] = spilled_session(f)
        self._trim_disk()
        total, _ = self.spill.usage()
        log.info(
            "spill folder %s: %d session(s) from an earlier run, %.1f MiB on disk",
            self.spill.path,
            len(found),
            total / 2**20,
        )

    def _reset(self, session: Session, spec: CacheSpec) -> None:
        session.spec, session.caches, session.tokens = spec, self.make_caches(spec), []
        session.checkpoints.clear()
        session.draft_state = None

    def _forget(self, session: Session) -> None:
        if session.spill_path is not None and self._own(session, ask=False):
            session.spill_path.unlink(missing_ok=True)  # not while another replica restores it
        self._disown(session)
        if self.sessions.get((session.owner, session.id)) is session:
            del self.sessions[(session.owner, session.id)]

    # ------------------------------------------------------------------ ownership

    def _own(self, session: Session, ask: bool = True) -> bool:
        """Claim the session unless this replica already holds it; False if another does."""
        if self.spill is not None and session.claim is None:
            session.claim = self.spill.claim(session.owner, session.id, ask)
            return session.claim is not None
        return True

    def _disown(self, session: Session) -> None:
        if session.claim is not None:
            session.claim.release()
            session.claim = None

    def _sync(self) -> None:
        """Follow the shared folder: sessions other replicas spilled, and files they took."""
        if self.spill is None:
            return
        gone, found = self.spill.changes({s.spill_path for s in self.sessions.values()} - {None})
        for key in [k for k, s in self.sessions.items() if s.spill_path in gone]:
            del self.sessions[key]  # restored (or dropped) by another replica
        for f in found:
            held = self.sessions.get((f.owner, f.id))
            if held is None or held.caches is None:
                self.sessions[(f.owner, f.id)] = spilled_session(f)
        if gone or found:
            self._publish()
