"""`h2o-server serve` on a free loopback port, for benchmarks and black-box tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

_SCRIPT = Path(sys.executable).parent / "h2o-server"
SERVE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "server.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    flags: list[str],
    stdout: IO | None = None,
    timeout: float = 180,
    port: int | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, int]:
    """Start `h2o-server serve FLAGS` on `port` (else a free one), in `cwd` with `env` added
    to this process's environment; return once /health answers."""
    port = port or free_port()
    process = subprocess.Popen(
        [*SERVE, "serve", "--port", str(port), *flags],
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout else None,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    wait_healthy(process, port, timeout=timeout)
    return process, port


def wait_healthy(
    process: subprocess.Popen, port: int, path: str = "/health", timeout: float = 180
) -> None:
    """Return once GET `path` answers on loopback; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError("the server exited while starting")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2)
            return
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(f"the server did not start within {timeout:.0f} s")
        time.sleep(0.3)


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
