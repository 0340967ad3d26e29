"""Anthropic's message threads (beta `message-threads-2026-08-12`), which the anthropic
SDK's tool runner uses by default: the first request carries the whole conversation,
`system` and `tools` with `thread: {"type": "create"}`; each later one only the messages
since the previous reply, with `{"type": "continue", "previous_message_id": ID}` and no
`system` or `tools`. The server rebuilds the conversation before serving it.

Here a thread is the conversation as the request held it plus each reply, kept in
memory under the reply's id for THREAD_TTL seconds after its last use, and one session
key for the whole thread, so every turn continues the same KV cache. The error codes are
Anthropic's, which the SDK recovers from by replaying the whole history under a new
thread: `thread_not_found` (unknown, expired, another caller's), `thread_already_continued`
(a reply is continued once), `thread_continue_in_flight`. Plain Python.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.api.errors import APIError

THREAD_TTL = 300.0  # seconds after its last request (Anthropic's)
MAX_THREADS = 1024  # replies held at most; the least recently used go first


@dataclass
class ThreadTurn:
    """A reply a thread may continue from: the conversation up to and including it."""

    system: Any
    tools: Any
    messages: list[dict]  # as the request's `messages` take them
    owner: str
    session: str
    used: float
    state: str = "open"  # open | in_flight | continued


@dataclass
class ThreadStore:
    ttl: float = THREAD_TTL
    capacity: int = MAX_THREADS
    clock: Any = time.monotonic
    _turns: dict[str, ThreadTurn] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def resume(self, previous_id: str, owner: str) -> ThreadTurn:
        """The reply `previous_id` continues, marked in flight until `keep` or `release`."""
        with self._lock:
            self._expire()
            turn = self._turns.get(previous_id)
            said = f"the thread's reply {previous_id!r}"
            if turn is None or turn.owner != owner:
                why = f"no thread holds {said} (unknown or expired: send the whole conversation)"
                raise _thread_error(404, "thread_not_found", why)
            if turn.state == "continued":
                raise _thread_error(409, "thread_already_continued", f"{said} was continued")
            if turn.state == "in_flight":
                raise _thread_error(409, "thread_continue_in_flight", f"{said} is being continued")
            turn.state, turn.used = "in_flight", self.clock()
            return turn

    def release(self, previous_id: str | None) -> None:
        """A continue that failed: the reply may be continued again."""
        with self._lock:
            turn = self._turns.get(previous_id or "")
            if turn is not None and turn.state == "in_flight":
                turn.state = "open"

    def keep(self, reply_id: str, turn: ThreadTurn, previous_id: str | None) -> None:
        """The conversation up to reply `reply_id`, which the next request may continue."""
        with self._lock:
            if previous_id in self._turns:
                self._turns[previous_id].state = "continued"
            turn.used = self.clock()
            self._turns[reply_id] = turn
            while len(self._turns) > self.capacity:
                self._turns.pop(min(self._turns, key=lambda k: self._turns[k].used))

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, t in self._turns.items() if now - t.used > self.ttl]:
            del self._turns[key]


def new_session() -> str:
    """The session key of a thread that named none (X-Session-ID)."""
    return f"thread_{uuid.uuid4().hex[:24]}"


def _thread_error(status: int, code: str, message: str) -> APIError:
    return APIError(status, message, code, details={"error_code": code})
