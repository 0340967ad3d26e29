"""The worker thread clears its own MLX streams before it ends.

MLX 0.32 keeps streams per thread; left for the thread's exit to free, they can drop
Python references while the interpreter finalizes and abort the process ("terminate
called without an active exception", seen at the end of `eval recall --score learned`).
"""

import threading

import pytest

from config.settings import ServerSettings
from server.engine import worker as worker_module


def test_the_worker_thread_clears_its_streams_when_it_ends(monkeypatch):
    cleared = []
    real = worker_module.mx.clear_streams

    def clear() -> None:
        cleared.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(worker_module.mx, "clear_streams", clear)

    def load_engine(settings):
        raise RuntimeError("no model here")

    worker = worker_module.Worker(ServerSettings(), load_engine)
    with pytest.raises(RuntimeError, match="no model here"):
        worker.start()
    worker._thread.join(timeout=10)
    assert not worker._thread.is_alive()
    assert cleared == ["mlx-worker"]
