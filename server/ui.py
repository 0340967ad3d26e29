"""The chat page at `/`: static files from server/static, no build step, nothing external.

The page is a client of the public API like any other (`/v1/chat/completions`
with SSE, `/v1/sessions`, `/v1/sessions/{id}/cache`), so it needs the API key
like any other; only the files themselves and `/ui/options` (what the cache
settings may be) are served without it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from config.cache_spec import POLICIES, PRESETS, SCORE_RULES
from config.settings import ServerSettings

STATIC = Path(__file__).parent / "static"
# The page loads only its own files and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def ui_enabled(settings: ServerSettings) -> bool:
    """--ui wins; by default the page is served only when the server binds a loopback host."""
    if settings.ui is not None:
        return settings.ui
    if settings.host == "localhost":
        return True
    try:
        return ipaddress.ip_address(settings.host.strip("[]")).is_loopback
    except ValueError:
        return False


router = APIRouter(include_in_schema=False)


@router.get("/")
async def index():
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


@router.get("/ui/options")
async def options(request: Request):
    """What the page offers: the model, whether a key is needed, the cache choices."""
    worker = request.app.state.worker
    spec = worker.engine.spec
    return {
        "model": worker.engine.model_id,
        "api_key_required": bool(worker.settings.api_key),
        "policies": list(POLICIES),
        "presets": list(PRESETS),
        "scores": list(SCORE_RULES),
        "default": {
            "policy": spec.policy,
            "max_kv": spec.max_kv,
            "preset": spec.preset,
            "score": spec.score,
        },
    }


def install_ui(app: FastAPI) -> None:
    """Serve the page at `/`, its files under `/static`, and the cache choices it offers."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(router)
