"""The spill folder: sessions written to disk, read back, and found again after a restart.

A spilled session is one safetensors file (mlx-lm's prompt-cache layout) whose
metadata names this format, the model that made it (a fingerprint of its
weights), the session's owner, id, cache spec and tokens. On start the folder
is indexed from the file headers alone (nothing is loaded): files of another
model, corrupt files and writes cut short by a crash are refused with a log
line and removed, since a cache can always be rebuilt from the history a
client sends. Files are written into `.partial/` and renamed into place, so a
crash never leaves half a session under a real name. Several servers (replicas)
may share one folder: server/sessions/claims.py decides which of them owns a session.

`--spill-budget` covers every file in the folder, whoever wrote it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from cache.contract import compact, holds_tokens, tokens_seen
from config.cache_spec import CacheSpec
from server.sessions.claims import Claim, Claims, private_partial

log = logging.getLogger("h2o_server.spill")

FORMAT = "h2o-server-session/1"
SUFFIX = ".safetensors"
MAX_HEADER = 64 * 2**20


class SpillError(Exception):
    """A spill file that cannot be used: corrupt, truncated, or of another model."""


@dataclass
class SpilledSession:
    """What the index knows of one file, from its header."""

    path: Path
    id: str
    owner: str
    keyed: bool
    spec: CacheSpec
    tokens: list[int]
    prompt_len: int
    evictions: int
    nbytes: int
    mtime: float
    # Token counts of the state checkpoints stored after the layers (conversation.py).
    checkpoints: tuple[int, ...] = ()
    layers: int = 0  # the model's layer caches, before the checkpoints (0: all of them)


def model_identity(model) -> str:
    """A fingerprint of a model's weights: names, shapes, dtypes and a sample of values."""
    digest = hashlib.sha256()
    for name, array in tree_flatten(model.parameters()):
        sample = array.reshape(-1)[:16]
        mx.eval(sample)
        digest.update(f"{name}{array.shape}{array.dtype}".encode())
        digest.update(bytes(memoryview(sample.astype(mx.float32))))
    return digest.hexdigest()[:32]


class SpillFolder:
    def __init__(self, path: str | Path, identity: str, budget: int, max_files: int):
        self.path, self.identity = Path(path), identity
        self.budget, self.max_files = budget, max_files
        self.path.mkdir(parents=True, exist_ok=True)
        self.partial, alive = private_partial(self.path)
        self._alive: int | None = alive
        self.claims = Claims(self.path)
        self._unusable: set[Path] = set()  # files `changes` skips

    def close(self) -> None:
        """This process is done with the folder (its own .partial/ folder goes)."""
        if self._alive is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
            os.close(self._alive)
            self._alive = None

    def claim(self, owner: str, session_id: str, ask: bool = True) -> Claim | None:
        """Own a session (server/sessions/claims.py); None while another server does, which, if
        `ask`, is asked to hand it over."""
        name = self.file_for(owner, session_id).stem
        claim = self.claims.claim(name)
        if claim is None and ask:
            self.claims.want(name)
        return claim

    def wanted(self, owner: str, session_id: str) -> bool:
        """Whether another server asked for this session."""
        return self.claims.wanted(self.file_for(owner, session_id).stem)

    def changes(self, known: set[Path]) -> tuple[set[Path], list[SpilledSession]]:
        """Since `known` (spill files one server tracks): the files gone, and the new ones
        (other servers' spills). Files it cannot use are skipped until the next start."""
        on_disk = set(self.path.glob(f"*{SUFFIX}"))
        found = []
        for path in on_disk - known - self._unusable:
            try:
                found.append(self._describe(path))
            except (SpillError, _NotOurs) as e:
                if not path.exists():  # taken (restored and removed) since the listing
                    continue
                why = e if isinstance(e, SpillError) else "not a session file of this server"
                # Left on disk: whoever wrote it may still read it (another model, say).
                log.warning("spill file %s skipped until the next start: %s", path.name, why)
                self._unusable.add(path)
        return known - on_disk, found

    def file_for(self, owner: str, session_id: str) -> Path:
        return self.path / (f"{owner}~{session_id}{SUFFIX}" if owner else f"{session_id}{SUFFIX}")

    def write(self, path: Path, caches: list, header: dict) -> int:
        """Write a session atomically (into .partial/, then renamed); returns its bytes."""
        for c in caches:  # buffers that grow in blocks hold spare room
            compact(c)
        meta = {"format": FORMAT, "model": self.identity, **header}
        partial = self.partial / path.name
        save_prompt_cache(str(partial), caches, {k: json.dumps(v) for k, v in meta.items()})
        os.replace(partial, path)
        return path.stat().st_size

    def read(self, path: Path, tokens: int) -> list:
        """Load a session's caches, checked against the index (each layer saw `tokens`);
        state checkpoints written after the layers come last, as they were written."""
        try:
            caches, meta = load_prompt_cache(str(path), return_metadata=True)
        except Exception as e:
            raise SpillError(f"unreadable ({type(e).__name__}: {e})") from None
        if json.loads(meta.get("model", "null")) != self.identity:
            raise SpillError("made by another model")
        offsets = {tokens_seen(c) for c in caches if holds_tokens(c)}
        if offsets != {tokens}:
            raise SpillError(f"layers hold {sorted(offsets)} tokens, the index says {tokens}")
        return caches

    def index(self) -> list[SpilledSession]:
        """Every usable session file; the rest is refused with a log line and removed."""
        found = []
        for path in sorted(self.path.glob(f"*{SUFFIX}")):
            try:
                found.append(self._describe(path))
            except SpillError as e:
                log.warning("spill file %s refused: %s; removed", path.name, e)
                path.unlink(missing_ok=True)
            except _NotOurs:
                log.warning("%s is not a session file of this server; left alone", path.name)
        return found

    def usage(self) -> tuple[int, int]:
        """(bytes of every file in the folder, session files)."""
        total = files = 0
        for root, _, names in os.walk(self.path):
            for name in names:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    continue
                files += root == str(self.path) and name.endswith(SUFFIX)
        return total, files

    def over_budget(self) -> bool:
        total, files = self.usage()
        return total > self.budget or files > self.max_files

    def describe(self, path: Path) -> SpilledSession:
        """What a session file's header says (raises SpillError, or FileNotFoundError)."""
        if not path.exists():
            raise FileNotFoundError(path)
        return self._describe(path)

    def _describe(self, path: Path) -> SpilledSession:
        meta = read_metadata(path)
        if meta.get("format") != FORMAT:
            raise _NotOurs
        if meta.get("model") != self.identity:
            raise SpillError("made by another model")
        try:
            spec = CacheSpec(**meta["spec"])
            tokens = [int(t) for t in meta["tokens"]]
            stat = path.stat()
            return SpilledSession(
                path=path,
                id=str(meta["id"]),
                owner=str(meta["owner"]),
                keyed=bool(meta["keyed"]),
                spec=spec,
                tokens=tokens,
                prompt_len=int(meta["prompt_len"]),
                evictions=int(meta.get("evictions", 0)),
                nbytes=stat.st_size,
                mtime=stat.st_mtime,
                checkpoints=tuple(int(k) for k in meta.get("checkpoints", [])),
                layers=int(meta.get("layers", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SpillError(f"bad metadata ({e})") from None


class _NotOurs(Exception):
    pass


def read_metadata(path: Path) -> dict:
    """A session file's metadata from its safetensors header, checking the file is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise SpillError("truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpillError(f"unreadable header ({type(e).__name__})") from None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:
        raise SpillError("truncated: the file is shorter or longer than its header says")
    flat = header.get("__metadata__", {})
    try:
        ours = tree_unflatten(list(flat.items()))[0]  # [metadata, classes, scalars]
        return {k: json.loads(v) for k, v in ours.items()}
    except (IndexError, KeyError, TypeError, AttributeError, json.JSONDecodeError):
        raise _NotOurs from None
