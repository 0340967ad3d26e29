"""Types of the session endpoints and the chat page: figures, cache contents, page options.

Apart from the APIs' protocol modules (server/api/chat/protocol.py, ...) so each stays small.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from config.policies import VIEW_KINDS
from server.api.chat.protocol import Usage
from server.api.common import KeepAlive


class ModelAction(BaseModel):
    """POST /v1/models/load and /v1/models/unload."""

    model: str
    keep_alive: KeepAlive = None  # load: seconds it stays once idle (< 0: for ever)


class SessionFigures(BaseModel):
    """One conversation as `GET /v1/sessions` lists it (Session.refresh_stats)."""

    id: str
    policy: str
    max_kv: int
    # each layer's own max_kv when a layer profile splits layers x max_kv (None: all max_kv)
    layer_max_kv: list[int] | None = None
    preset: str
    score: str
    kvarn: str | None = None  # kvarn / h2o-kvarn: the key and value bits (k4v2, k4v4, k2v2)
    # kvarn under `auto`: tokens held in plain dense caches before they are packed
    dense_until: int | None = None
    logical_tokens: int  # tokens the conversation has seen
    stored_tokens: int  # tokens its largest layer cache holds (fewer after eviction)
    bytes: int
    evictions: int
    spilled: bool
    busy: bool
    last_used: int
    # tokens its cache started from, a stored system prompt's (server/sessions/prefixes.py)
    prefix_tokens: int = 0
    model: str | None = None  # the model whose cache it is (several: docs/models.md)


class CacheSegments(BaseModel):
    kind: Literal[VIEW_KINDS]  # type: ignore[valid-type]
    sink: int  # positions < sink are sink tokens
    recent: int  # positions >= logical_tokens - recent: every layer's recent window holds them


class CachedTokens(BaseModel):
    ids: list[int]  # the conversation, one entry per position
    text: list[str]  # each token's text; joined, the decoded conversation
    held: list[int] | None  # (layer, KV head) pairs holding the token; None while spilled
    score: list[float | None] | None  # mean H2O score over its holders; None: unscored policy


class HeadContents(BaseModel):
    layer: int
    head: int
    kind: str
    held: int
    bitmap: str  # base64; position p is bit p % 8 of byte p // 8


class TurnFigures(BaseModel):
    usage: Usage
    logical_tokens: int
    stored_tokens: int
    bytes: int
    evictions: int


class PrefixStoreFigures(BaseModel):
    """The server's store of shared system prompts (server/sessions/prefixes.py)."""

    entries: int
    bytes: int
    capacity: int  # --prefix-share of --kv-budget (0: no store)
    hits: int  # conversations started from a stored prefix
    tokens: int  # prompt tokens served from it instead of prefilled


class SessionCache(SessionFigures):
    """`GET /v1/sessions/{id}/cache` (server/api/cache_view.py documents every field)."""

    object: Literal["session.cache"] = "session.cache"
    layers: int
    kv_heads: int
    segments: CacheSegments
    tokens: CachedTokens
    heads: list[HeadContents]
    turns: list[TurnFigures]
    prefix_store: PrefixStoreFigures | None = None  # the endpoint always fills it


class PageOptions(BaseModel):
    """`GET /ui/options`: what the chat page offers (served without the key, like the page)."""

    model: str  # the default model
    models: list[str] = []  # every model served here, loaded or not
    api_key_required: bool
    policies: list[str]
    presets: list[str]
    scores: list[str]
    default: dict[str, str | int]  # policy, max_kv, preset, score of the server's spec
