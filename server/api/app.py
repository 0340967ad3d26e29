"""FastAPI app factory: the worker, CORS, the API key, error handlers and the routes.

Handlers validate, tokenize (the tokenizer is not MLX) and submit a Job
(server/api/routes.py); the worker thread does everything that touches MLX. Every
error leaves in OpenAI's shape (server/api/errors.py).

`create_app` is an entry point (also `uvicorn --factory server.api.app:create_app`,
configured by H2O_* variables): it loads OpenBLAS before anything imports MLX,
so this module imports nothing that does.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from config.blas import preload_openblas
from config.settings import ServerSettings
from server.api.auth import APIKeyMiddleware, parse_keys
from server.api.chat.routes import router as chat_router
from server.api.errors import install_error_handlers
from server.api.messages.routes import router as messages_router
from server.api.responses.routes import router as responses_router
from server.api.routes import page_router, router
from server.api.ui import STATIC, ui_enabled


def create_app(settings: ServerSettings | None = None, load_engine=None) -> FastAPI:
    """The server app; `load_engine(settings)` builds what the worker serves (tests inject one)."""
    preload_openblas()
    from server.engine.worker import Worker  # imports MLX: after the preload

    if load_engine is None:
        from server.engine.engine import Engine

        load_engine = Engine.load
    settings = settings or ServerSettings()
    worker = Worker(settings, load_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(worker.start)
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="h2o-server", lifespan=lifespan)
    app.state.worker = worker
    install_error_handlers(app)
    # Starlette runs the middleware added last first: CORS answers preflights (which
    # carry no credentials) before the key is checked, and decorates the 401s too.
    app.add_middleware(APIKeyMiddleware, keys=parse_keys(settings.api_key))
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Session-ID", "Retry-After"],
        )
    app.include_router(router)
    app.include_router(chat_router)
    app.include_router(responses_router)
    app.include_router(messages_router)
    if ui_enabled(settings):  # the chat page: its files and the choices it offers
        app.mount("/static", StaticFiles(directory=STATIC), name="static")
        app.include_router(page_router)
    return app
