"""The server's own routes: health, models, metrics, sessions and their caches, the page.

The APIs' doors are their own routers (server/api/chat, server/api/responses,
server/api/messages). Handlers never touch MLX: the worker thread does (`worker.call`
for anything that reads caches). The app factory (server/api/app.py) mounts them all.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from server.api.cache_view import cache_report, read_contents
from server.api.errors import APIError
from server.api.messages.replies import model_info, model_list
from server.api.session_protocol import PageOptions, SessionCache
from server.api.turns import check_model, check_session_id, owner_of
from server.api.ui import PAGE_HEADERS, STATIC, page_options
from server.engine.jobs import SessionBusy

if TYPE_CHECKING:  # both import MLX
    from server.engine.engine import Engine
    from server.engine.worker import Worker

router = APIRouter()
page_router = APIRouter(include_in_schema=False)  # the chat page (server/api/ui.py), when on


def _worker(request: Request) -> Worker:
    return request.app.state.worker


@router.get("/health")
async def health(request: Request):
    """Answered on the event loop, never by the worker; 503 while draining after SIGTERM."""
    worker = _worker(request)
    if worker.draining:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    # What the server chose for the user at start-up without being told (also logged).
    return {"status": "ok", "model": worker.engine.model_id, "notices": worker.engine.notices}


@router.get("/v1/models")
async def models(request: Request):
    """The served model, under each --served-model-name when given (in Anthropic's shape
    for its clients, which send `anthropic-version`)."""
    engine = _worker(request).engine
    names = engine.settings.served_model_name or [engine.model_id]
    if "anthropic-version" in request.headers:
        return model_list(names)
    return {"object": "list", "data": [{**_model_card(engine), "id": name} for name in names]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    """One model (`client.models.retrieve`): any name requests may use for it."""
    engine = _worker(request).engine
    check_model(engine, model)
    if "anthropic-version" in request.headers:
        return model_info(model).model_dump()
    return {**_model_card(engine), "id": model}


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "h2o-server"}


# /metrics and /v1/sessions read what the session store last published: they answer
# at once, even while the worker is inside a long forward pass.


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    worker = _worker(request)
    store = worker.engine.store
    sessions = [stats for _, stats in store.published]
    return worker.metrics.render(
        store.published_counts,
        sessions,
        worker.queue_depth,
        worker.active,
        worker.engine.kv_budget,
        store.published_prefixes,
    )


@router.get("/v1/sessions")
async def list_sessions(request: Request, user: str | None = None):
    """The caller's sessions (everyone's unless --session-scope caller)."""
    worker = _worker(request)
    owner = owner_of(request, user)
    mine = [stats for who, stats in worker.engine.store.published if who == owner]
    return {"object": "list", "data": mine}


@router.get("/v1/sessions/{session_id}/cache", response_model=SessionCache)
async def session_cache(session_id: str, request: Request, user: str | None = None):
    """What the session's cache holds, per layer and KV head (server/api/cache_view.py)."""
    check_session_id(session_id)
    worker = _worker(request)
    store, owner = worker.engine.store, owner_of(request, user)
    contents = await asyncio.wrap_future(
        worker.call(lambda: read_contents(store, session_id, owner))
    )
    if contents is None:
        raise APIError(404, f"no session {session_id!r}", "session_not_found")
    # Built and serialized in the thread pool: a long conversation's report is large.
    report = await run_in_threadpool(
        lambda: cache_report(contents, worker.engine.tokenizer).model_dump_json()
    )
    return Response(report, media_type="application/json")


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request, user: str | None = None):
    check_session_id(session_id)
    worker = _worker(request)
    owner = owner_of(request, user)
    try:
        found = await asyncio.wrap_future(
            worker.call(lambda: worker.engine.store.delete(session_id, owner))
        )
    except SessionBusy:
        raise APIError(409, f"session {session_id} is answering a request") from None
    if not found:
        raise APIError(404, f"no session {session_id!r}", "session_not_found")
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@page_router.get("/")
async def page():
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


@page_router.get("/ui/options", response_model=PageOptions)
async def ui_options(request: Request):
    worker = _worker(request)
    return page_options(worker.engine, worker.settings)


# ---------------------------------------------------------------------- helpers
