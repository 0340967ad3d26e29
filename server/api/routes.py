"""The server's own routes: health, models, metrics, sessions and their caches, the page.

The APIs' doors are their own routers (server/api/chat, server/api/responses,
server/api/messages). Handlers never touch MLX: the worker thread does (`worker.call`
for anything that reads caches). The app factory (server/api/app.py) mounts them all.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from server.api.cache_view import cache_report, read_contents
from server.api.errors import APIError
from server.api.messages.replies import model_info, model_list
from server.api.session_protocol import ModelAction, PageOptions, SessionCache
from server.api.turns import check_session_id, engine_for, model_entry, owner_of
from server.api.ui import PAGE_HEADERS, STATIC, page_options
from server.engine.jobs import SessionBusy

if TYPE_CHECKING:  # both import MLX
    from server.engine.registry import ModelRegistry
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
    engine = worker.engine  # None while no model is loaded
    if engine is None:
        return {"status": "ok", "model": worker.models.default, "notices": []}
    return {"status": "ok", "model": engine.model_id, "notices": engine.notices}


@router.get("/v1/models")
async def models(request: Request):
    """Every model served here, loaded or not, with its state (in Anthropic's shape for its
    clients, which send `anthropic-version`); the default model's every
    --served-model-name."""
    registry = _worker(request).models
    cards = [
        _model_card(registry, entry.name, name)
        for entry in registry.entries
        for name in (
            registry.settings.served_model_name
            if entry.name == registry.default and registry.settings.served_model_name
            else [entry.name]
        )
    ]
    if "anthropic-version" in request.headers:
        return model_list([card["id"] for card in cards])
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    """One model (`client.models.retrieve`): any name requests may use for it."""
    worker = _worker(request)
    entry = model_entry(worker, model)
    if "anthropic-version" in request.headers:
        return model_info(model).model_dump()
    return _model_card(worker.models, entry.name, model)


@router.post("/v1/models/load")
async def load_model(body: ModelAction, request: Request):
    """Load a model now (an operator warming it), kept `keep_alive` seconds once idle."""
    worker = _worker(request)
    entry = model_entry(worker, body.model)
    await engine_for(worker, body.model, body.keep_alive)
    return _model_card(worker.models, entry.name, entry.name)


@router.post("/v1/models/unload")
async def unload_model(body: ModelAction, request: Request):
    """Unload a model now: its sessions spilled to --spill-dir (else dropped); a 409 while
    it answers requests."""
    worker = _worker(request)
    entry = model_entry(worker, body.model)

    def unload() -> bool:
        if entry.name in worker.busy_models():
            raise SessionBusy
        return worker.models.unload(entry.name)

    try:
        await asyncio.wrap_future(worker.call(unload))
    except SessionBusy:
        raise APIError(409, f"model {entry.name!r} is answering requests") from None
    return _model_card(worker.models, entry.name, entry.name)


def _model_card(registry: ModelRegistry, name: str, shown: str) -> dict:
    """OpenAI's Model, with this server's `state` (loaded | unloaded), `pinned` and, once it
    has been loaded, its `weight_bytes`."""
    return {
        "id": shown,
        "object": "model",
        "created": 0,
        "owned_by": "h2o-server",
        "state": registry.state(name),
        "pinned": registry.pinned(name),
        "weight_bytes": registry.weight_bytes(name),
    }


# /metrics and /v1/sessions read what the session stores last published: they answer
# at once, even while the worker is inside a long forward pass.


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    worker = _worker(request)
    engines = worker.engines()
    counts = Counter(worker.models.retired_counts)
    prefixes: Counter = Counter()
    for engine in engines:
        counts.update(engine.store.published_counts)
        prefixes.update(engine.store.published_prefixes)
    per_model = {}
    for entry in worker.models.entries:
        engine = worker.models.engine(entry.name)
        resident = [s for _, s in engine.store.published if not s["spilled"]] if engine else []
        per_model[entry.name] = {
            "loaded": engine is not None,
            "weight_bytes": engine.weight_bytes if engine else 0,
            "cache_bytes": sum(s["bytes"] for s in resident),
            "sessions": len(resident),
        }
    return worker.metrics.render(
        counts,
        [stats for engine in engines for _, stats in engine.store.published],
        worker.queue_depth,
        worker.active,
        sum(engine.kv_budget for engine in engines),
        prefixes,
        worker.active_memory(),
        per_model,
        (worker.models.memory_budget, worker.models.memory_in_use()),
    )


@router.get("/v1/sessions")
async def list_sessions(request: Request, user: str | None = None):
    """The caller's sessions (everyone's unless --session-scope caller), of every loaded
    model."""
    worker = _worker(request)
    owner = owner_of(request, user)
    mine = [
        {**stats, "model": engine.model_id}
        for engine in worker.engines()
        for who, stats in engine.store.published
        if who == owner
    ]
    return {"object": "list", "data": mine}


@router.get("/v1/sessions/{session_id}/cache", response_model=SessionCache)
async def session_cache(session_id: str, request: Request, user: str | None = None):
    """What the session's cache holds, per layer and KV head (server/api/cache_view.py)."""
    check_session_id(session_id)
    worker = _worker(request)
    owner = owner_of(request, user)

    def read():
        for engine in worker.engines():
            contents = read_contents(engine.store, session_id, owner)
            if contents is not None:
                return contents, engine
        return None, None

    contents, engine = await asyncio.wrap_future(worker.call(read))
    if contents is None:
        raise APIError(404, f"no session {session_id!r}", "session_not_found")

    def build() -> str:  # in the thread pool: a long conversation's report is large
        report = cache_report(contents, engine.tokenizer)
        report.model = engine.model_id
        return report.model_dump_json()

    report = await run_in_threadpool(build)
    return Response(report, media_type="application/json")


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request, user: str | None = None):
    check_session_id(session_id)
    worker = _worker(request)
    owner = owner_of(request, user)

    def delete() -> bool:
        return any(engine.store.delete(session_id, owner) for engine in worker.engines())

    try:
        found = await asyncio.wrap_future(worker.call(delete))
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
    engine = await engine_for(worker, worker.models.default)
    return page_options(engine, worker.settings, worker.models.names())


# ---------------------------------------------------------------------- helpers
