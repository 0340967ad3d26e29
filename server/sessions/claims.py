"""Which replica owns a session, when several servers share one spill folder.

A replica owns a session while it holds the session's cache in memory: it holds
an advisory lock (`flock`) on `.claims/<name>.lock` from the moment it takes
the session (new, or restored from the folder) until it spills or forgets it.
The kernel drops the lock when the process dies, so a killed replica never
leaves a session owned. A spilled session is owned by nobody: the next replica
that claims it restores it and removes the file. So two replicas never hold
one conversation's cache at once.

A replica that needs a session someone else holds leaves a `.want` marker;
the holder hands the session over (spills it) within a fraction of a second
once it is idle. Each process writes into its own `.partial/<id>/` folder, so a
replica starting never removes another replica's write in progress.

`flock` works on local disks and Linux NFSv4 clients (emulated with byte-range
locks); it does not work on NFSv3 without lockd or on most FUSE filesystems.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger("h2o_server.spill")

CLAIMS = ".claims"
PARTIAL = ".partial"  # writes in progress, one folder per process
ALIVE = ".alive"  # locked by the process writing into a .partial/ folder


class Claim:
    """A held lock: this process owns the session until `release`."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        # Unlink while still holding the lock: a replica that opened the old file
        # finds, once it gets the lock, that the name points elsewhere, and retries.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path` (created if missing); None if someone holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)  # released and removed between our open and our lock: try again


class Claims:
    """Claims and wants for the session files of one spill folder."""

    def __init__(self, folder: Path):
        self.dir = folder / CLAIMS
        self.dir.mkdir(exist_ok=True)

    def claim(self, name: str) -> Claim | None:
        """Own session `name` (a spill file's stem), or None while another process owns it."""
        path = self.dir / f"{name}.lock"
        fd = try_lock(path)
        if fd is None:
            return None
        (self.dir / f"{name}.want").unlink(missing_ok=True)
        return Claim(path, fd)

    def want(self, name: str) -> None:
        """Ask the process that owns `name` to spill it."""
        (self.dir / f"{name}.want").touch()

    def wanted(self, name: str) -> bool:
        return (self.dir / f"{name}.want").exists()


def private_partial(folder: Path) -> tuple[Path, int]:
    """This process's own `.partial/<id>/` (and the fd that marks it alive); removes dead ones."""
    root = folder / PARTIAL
    root.mkdir(exist_ok=True)
    for entry in root.iterdir():
        if entry.name.endswith(".new"):
            continue  # a process starting right now (see below)
        if entry.is_dir():
            fd = try_lock(entry / ALIVE)
            if fd is None:
                continue  # a live process is writing there
            os.close(fd)
            left = [p for p in entry.iterdir() if p.name != ALIVE]
        else:
            left = [entry]
        if left:
            log.warning("removing %d spill(s) cut short by a crash in %s", len(left), root)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    # Locked before it gets a name other starters clean up; the lock follows the rename.
    name = uuid.uuid4().hex[:12]
    (root / f"{name}.new").mkdir()
    fd = try_lock(root / f"{name}.new" / ALIVE)
    assert fd is not None  # a fresh folder nobody else knows
    os.rename(root / f"{name}.new", root / name)
    return root / name, fd
