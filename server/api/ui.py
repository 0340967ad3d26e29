"""The chat page at `/`: static files from server/api/static, no build step, nothing external.

The page is a client of the public API like any other (`/v1/chat/completions`
with SSE, `/v1/sessions`, `/v1/sessions/{id}/cache`), so it needs the API key
like any other; only the files themselves and `/ui/options` (what the cache
settings may be) are served without it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from config.cache_spec import PRESETS, SCORE_RULES
from config.policies import POLICIES
from config.settings import ServerSettings
from server.api.session_protocol import PageOptions

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


def page_options(engine, settings: ServerSettings, models: list[str]) -> PageOptions:
    """What the page offers: the models, whether a key is needed, the cache choices."""
    spec = engine.spec
    return PageOptions(
        model=engine.model_id,
        models=models,
        api_key_required=bool(settings.api_key),
        policies=list(POLICIES),
        presets=list(PRESETS),
        scores=list(SCORE_RULES),
        default={
            "policy": spec.policy,
            "max_kv": spec.max_kv,
            "preset": spec.preset,
            "score": spec.score,
        },
    )
