"""`h2o-server serve`: the app under uvicorn, with a bounded, graceful shutdown.

On the first SIGTERM or SIGINT the worker starts draining (server/engine/worker.py):
no new requests, in-flight ones get `--shutdown-timeout` seconds, then they are
cancelled (open streams end with an error event) and every session is spilled
to --spill-dir. uvicorn meanwhile stops accepting connections and waits for the
open ones, which the drain closes. A second signal exits at once.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

import uvicorn

from config.settings import ServerSettings
from server.api.app import create_app

UVICORN_MARGIN = 30.0  # uvicorn's own deadline, past ours: a safety net only


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # the second signal: the user wants out now
            name = signal.Signals(sig).name
            os.write(2, f"h2o-server: second {name}, exiting without draining\n".encode())
            os._exit(128 + sig)
        self.worker.begin_shutdown(self.worker.settings.shutdown_timeout)
        super().handle_exit(sig, frame)


def serve(settings: ServerSettings) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_timeout + UVICORN_MARGIN),
    )
    DrainingServer(config, app.state.worker).run()
