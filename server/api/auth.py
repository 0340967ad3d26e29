"""API keys and session owners.

`APIKeyMiddleware` is plain ASGI (not Starlette's BaseHTTPMiddleware, which wraps
the receive channel the disconnect watcher listens on). It sits inside the CORS
middleware, so a browser's preflight (which never carries credentials) is
answered by CORS and a 401 still carries the CORS headers the browser needs to
show it. Every path but /health and the chat page's own files needs the key when
one is set (the API, the metrics, /docs and /openapi.json alike): the page holds
no data, it asks the user for the key and sends it with every API call.

The key comes as `Authorization: Bearer <key>` or, as Anthropic's clients send it,
`x-api-key: <key>`.

`session_owner` names who a session belongs to when `--session-scope caller`:
a digest of the caller's API key and the request's `user`, so one caller can
neither list, reuse nor delete another's cache.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.common import error_body
from server.api.errors import anthropic_body, anthropic_path

OPEN_PATHS = frozenset({"/health", "/", "/ui/options"})  # probes; the page and its choices
OPEN_PREFIXES = ("/static/",)  # the page's scripts and styles


def parse_keys(setting: str | None) -> list[str]:
    """`--api-key k1,k2`: several keys, as llama.cpp's server takes them."""
    return [k.strip() for k in (setting or "").split(",") if k.strip()]


def bearer_token(authorization: str | None) -> str | None:
    """The token of `Authorization: Bearer <token>` (scheme case-insensitive); else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def matching_key(token: str | None, keys: list[str]) -> str | None:
    """The configured key equal to `token` (constant-time per key), or None."""
    if token is None:
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[str]):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.keys or is_open(path):
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        key = matching_key(bearer_token(authorization), self.keys)
        if key is None and b"x-api-key" in headers:  # Anthropic's clients send the key so
            key = matching_key(headers[b"x-api-key"].decode("latin-1").strip(), self.keys)
        if key is None:
            return await _unauthorized(send, anthropic_path(path))
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, anthropic: bool) -> None:
    message = "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key')"
    shaped = (
        anthropic_body(401, message)
        if anthropic
        else error_body(message, "authentication_error", "invalid_api_key")
    )
    body = json.dumps(shaped).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def session_owner(scoped: bool, api_key: str | None, user: str | None) -> str:
    """Who a session belongs to: '' (everyone's) unless sessions are scoped to the caller."""
    if not scoped or not (api_key or user):
        return ""
    return hashlib.sha256(f"{api_key or ''}\n{user or ''}".encode()).hexdigest()[:16]
