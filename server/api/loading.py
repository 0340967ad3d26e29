"""A streamed request for a model that is not loaded: its stream starts at once.

Loading a model takes seconds to minutes (server/engine/registry.py), and a client that
sees no bytes for that long may give up. So a streamed request whose model must load
first gets its SSE response now: comment pings go out every few seconds while the model
loads, then the request is served as if it had been loaded all along, its events
forwarded. What would have been an error response (a 400, a 429) becomes the API's error
event, since the status line has gone out already, and the stream's headers cannot carry
the session id (`X-Session-ID`): a client that needs it names its own session.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from server.api.common import error_body
from server.api.errors import APIError, anthropic_body, openai_type
from server.api.streaming import CLIENT_GONE, SHUTDOWN_GRACE_MARGIN
from server.api.turns import engine_for, model_entry, worker_of

log = logging.getLogger("h2o_server.loading")

LOAD_PING = 5.0  # seconds between SSE comments while a model loads

# What each API streams for an error: (the error) -> sse-starlette events.
StreamError = Callable[[APIError], list[dict]]


async def served(
    request: Request,
    model: str,
    keep_alive: float | None,
    stream: bool,
    serve: Callable[[], Awaitable[Response]],
    stream_error: StreamError,
) -> Response:
    """`serve()`'s response: at once where the model is loaded or the reply is one body;
    else a stream that pings while the model loads, then carries `serve()`'s events."""
    worker = worker_of(request)
    entry = model_entry(worker, model)  # an unknown name: a plain 404 before any stream
    if not stream or worker.models.engine(entry.name) is not None:
        return await serve()
    grace = worker.settings.shutdown_timeout + SHUTDOWN_GRACE_MARGIN
    events = _loaded_then_served(worker, model, keep_alive, serve, stream_error)
    return EventSourceResponse(events, ping=LOAD_PING, shutdown_grace_period=grace)


async def _loaded_then_served(
    worker, model: str, keep_alive, serve, stream_error: StreamError
) -> AsyncIterator[dict]:
    try:
        await engine_for(worker, model, keep_alive)
        response = await serve()  # the model is loaded now (or loads again: swapped out)
    except APIError as e:
        for event in stream_error(e):
            yield _encoded(event)
        return
    except Exception:
        log.exception("a request could not be served after its model loaded")
        for event in stream_error(APIError(500, "the request could not be served")):
            yield _encoded(event)
        return
    if isinstance(response, EventSourceResponse):
        async for event in response.body_iterator:
            yield event
    elif response.status_code != CLIENT_GONE:  # an error body: said as the error event
        for event in stream_error(_error_of(response)):
            yield _encoded(event)


def _error_of(response: Response) -> APIError:
    """An error response's status and message (either API's shape), as an APIError."""
    try:
        error = json.loads(response.body)["error"]
        return APIError(
            response.status_code, error["message"], error.get("code"), error.get("param")
        )
    except (ValueError, KeyError, TypeError):
        return APIError(response.status_code, "the request failed")


def _encoded(event: dict) -> dict:
    data = event["data"]
    return {**event, "data": data if isinstance(data, str) else json.dumps(data)}


def openai_stream_error(e: APIError) -> list[dict]:
    """Chat and completions: a data event holding OpenAI's error body."""
    return [{"data": error_body(e.message, openai_type(e.status), e.code, e.param)}]


def responses_stream_error(e: APIError) -> list[dict]:
    """Responses: its `error` event (the stream's first)."""
    data = {"type": "error", "code": e.code or openai_type(e.status), "message": e.message}
    return [{"event": "error", "data": {**data, "param": e.param, "sequence_number": 0}}]


def anthropic_stream_error(e: APIError) -> list[dict]:
    """Messages: its `error` event."""
    return [{"event": "error", "data": anthropic_body(e.status, e.message, e.details)}]
