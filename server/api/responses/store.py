"""Stored responses: each a turn of a conversation, kept apart from its KV cache.

A stored response keeps its own input items and output items, the Response object GET
returns, and the session key of its chain; the conversation a later turn continues is
the chain of stored responses back to its start (`history`). Items are small; the KV
cache (large) is the session store's (server/sessions/store.py), found by that key (the
id of the session that served the response: a client's prompt_cache_key, or the one
the session store found by the prompt), so a
turn with `previous_response_id` prefills only its new input while its session lives,
and a chain whose session was dropped is rebuilt from its history, never lost.

Limits (--responses-max-stored, --responses-max-bytes, --responses-max-age-seconds):
past any, the oldest response goes out. A response that leaves hands its history to the
responses that continue it (their `base`), so a chain never breaks because its start
expired: it only stops being retrievable by the old ids.

With --spill-dir each record is also a JSON file in `<spill-dir>/responses/`, read back
at start, so a restart continues every chain; another replica sharing the folder reads
a record it does not know from the file, and a record whose file is gone was deleted
(or expired) elsewhere. Only the event loop calls in (the handlers): no locks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("h2o_server.responses")

ID_PATTERN = re.compile(r"resp_[0-9a-f]{32}")  # ours only: an id is also a file name
FOLDER = "responses"  # inside --spill-dir


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    id: str
    owner: str  # who may read it (server/api/auth.py); "" = everyone
    created_at: float
    session_key: str  # the session that served it, whose cache the next turn reuses
    parent: str | None  # the stored response it continues; None: a start, or see `base`
    input: list[dict]
    response: dict  # the Response object, as GET returns it (its output items too)
    base: list[dict] = field(default_factory=list)  # the history of a parent gone since
    nbytes: int = 0

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def encoded(self) -> str:
        return json.dumps({**asdict(self), "nbytes": 0}, ensure_ascii=False)


class HistoryGone(Exception):
    """A response's chain lost a link (removed by another replica)."""


class ResponseStore:
    def __init__(
        self,
        max_count: int,
        max_bytes: int,
        max_age: float,
        folder: str | Path | None = None,
    ):
        self.max_count, self.max_bytes, self.max_age = max_count, max_bytes, max_age
        self.folder = Path(folder) if folder else None
        self.records: dict[str, StoredResponse] = {}  # oldest first (insertion order)
        self.children: dict[str, set[str]] = {}
        self.heads: dict[str, str] = {}  # session key -> the newest response of its chain
        self.nbytes = 0
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._index()

    # ------------------------------------------------------------------ reading

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The caller's stored response, or None (unknown, expired, deleted, another's)."""
        record = self._find(response_id)
        if record is None or record.owner != owner:
            return None
        return record

    def history(self, record: StoredResponse) -> list[dict]:
        """The items a turn continuing `record` follows: every input and output of its
        chain, oldest first, ending with its own output."""
        return [*self.before(record), *record.input, *record.output]

    def before(self, record: StoredResponse) -> list[dict]:
        """The items of its chain before its own input."""
        chain, at = [], record
        while at.parent is not None:
            parent = self._find(at.parent)
            if parent is None:
                raise HistoryGone(at.parent)
            chain.append(parent)
            at = parent
        items = list(at.base)
        for r in reversed(chain):
            items += r.input + r.output
        return items

    def session_key(self, previous: StoredResponse | None) -> str | None:
        """The session a response continuing `previous` uses: the chain's own when it
        continues the newest response (the cache holds just that); None (a session found
        by its prompt, or a new one) when it branches off an older one, whose cache the
        chain's newest turn keeps, or starts a chain."""
        if previous is not None and self.heads.get(previous.session_key) == previous.id:
            return previous.session_key
        return None

    # ------------------------------------------------------------------ writing

    def put(self, record: StoredResponse) -> None:
        """Keep a finished response; then the limits, oldest out."""
        self._add(record)
        self.heads[record.session_key] = record.id
        self._write(record)
        self._enforce(time.time())

    def delete(self, response_id: str, owner: str) -> bool:
        record = self.get(response_id, owner)
        if record is None:
            return False
        self._remove(record, "deleted")
        return True

    # ------------------------------------------------------------------ internals

    def _find(self, response_id: str) -> StoredResponse | None:
        if not ID_PATTERN.fullmatch(response_id):
            return None
        record = self.records.get(response_id)
        if self.folder is not None:
            path = self._path(response_id)
            if not path.exists():  # deleted or expired by another replica, if we had it
                if record is not None:
                    self._drop(record)
                return None
            if record is None:  # written by another replica
                record = self._read(path)
                if record is None:
                    return None
                self._add(record)
        if record is not None and time.time() - record.created_at > self.max_age:
            self._remove(record, "expired")
            return None
        return record

    def _add(self, record: StoredResponse) -> None:
        record.nbytes = len(record.encoded().encode())
        self.records[record.id] = record
        self.nbytes += record.nbytes
        if record.parent is not None:
            self.children.setdefault(record.parent, set()).add(record.id)
        head = self.records.get(self.heads.get(record.session_key, ""))
        if head is None or head.created_at <= record.created_at:
            self.heads[record.session_key] = record.id

    def _enforce(self, now: float) -> None:
        for record in list(self._oldest()):
            over = len(self.records) > self.max_count or self.nbytes > self.max_bytes
            expired = now - record.created_at > self.max_age
            if not (over or expired):
                break
            self._remove(record, "expired" if expired else "over the stored responses' limits")

    def _oldest(self) -> Iterator[StoredResponse]:
        return iter(sorted(self.records.values(), key=lambda r: r.created_at))

    def _remove(self, record: StoredResponse, why: str) -> None:
        """Take a response out; the responses that continue it keep its history."""
        try:
            history = self.history(record)
        except HistoryGone:
            history = None
        for child_id in self.children.pop(record.id, set()):
            child = self.records.get(child_id)
            if child is None:
                continue
            if history is None:  # its chain is broken anyway: the child keeps what it can
                history = [*record.input, *record.output]
            self.nbytes -= child.nbytes
            child.parent, child.base = None, history
            child.nbytes = len(child.encoded().encode())
            self.nbytes += child.nbytes
            self._write(child)
        self._drop(record)
        if self.folder is not None:
            self._path(record.id).unlink(missing_ok=True)
        log.info("response %s %s", record.id, why)

    def _drop(self, record: StoredResponse) -> None:
        """Forget a record in memory (its file is gone or going)."""
        if self.records.pop(record.id, None) is not None:
            self.nbytes -= record.nbytes
        if record.parent is not None:
            self.children.get(record.parent, set()).discard(record.id)
        if self.heads.get(record.session_key) == record.id:
            del self.heads[record.session_key]

    def _path(self, response_id: str) -> Path:
        return self.folder / f"{response_id}.json"

    def _write(self, record: StoredResponse) -> None:
        if self.folder is None:
            return
        path = self._path(record.id)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        try:
            partial.write_text(record.encoded())
            partial.replace(path)  # whole or not at all: a reader never sees half a record
        except OSError as e:
            log.error("response %s could not be written to %s: %s", record.id, path, e)
            partial.unlink(missing_ok=True)

    def _read(self, path: Path) -> StoredResponse | None:
        try:
            data = json.loads(path.read_text())
            return StoredResponse(**data)
        except (OSError, ValueError, TypeError) as e:
            log.warning("stored response %s is unreadable (%s): skipped", path, e)
            return None

    def _index(self) -> None:
        found = [r for p in self.folder.glob("resp_*.json") if (r := self._read(p)) is not None]
        for record in sorted(found, key=lambda r: r.created_at):
            self._add(record)
        if found:
            log.info("%d stored response(s) in %s", len(found), self.folder)
        self._enforce(time.time())
