"""Answering a job: one JSON body or an SSE stream, and cancellation when the client leaves.

`job_events` is the reusable wrapper: it yields a job's events until the job
ends, and cancels the job the moment the client's connection closes (a task
listens on the ASGI receive channel for `http.disconnect`, streaming or not)
or the response is closed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from server.api.errors import error_response
from server.api.protocol import error_body
from server.api.responses import ReplyBuilder
from server.engine.jobs import Delta, Failed, Finished, Job, Started

CLIENT_GONE = 499  # nginx's "client closed request": logged, never read by anyone
# sse-starlette ends open streams on shutdown by itself; the worker's drain ends ours
# first (with an error event), so the library only steps in if that ever hangs.
SHUTDOWN_GRACE_MARGIN = 10.0


async def _watch_disconnect(job: Job, request: Request) -> None:
    """Cancel the job as soon as the client goes away, and wake the handler."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel("client disconnected")
            job.events.put_nowait(Failed(CLIENT_GONE, "client disconnected"))
            return


async def job_events(job: Job, request: Request) -> AsyncIterator:
    """The job's events until it ends; a client that goes away cancels it (reusable wrapper)."""
    watcher = asyncio.create_task(_watch_disconnect(job, request))
    try:
        while True:
            event = await job.events.get()
            yield event
            if isinstance(event, Finished | Failed):
                return
    finally:
        watcher.cancel()
        job.cancel("response closed")  # no-op once the job has finished


def _failure(event: Failed) -> Response:
    if event.status == CLIENT_GONE:  # nobody is listening any more
        return Response(status_code=CLIENT_GONE)
    return error_response(event.status, event.message, event.code, event.param)


async def respond(
    job: Job, request: Request, stream: bool, reply: ReplyBuilder, grace: float = 0.0
) -> Response:
    """The job's answer; `grace`: how long a drain after SIGTERM may let it run."""
    events = job_events(job, request)
    first = await anext(events)
    if not isinstance(first, Started):
        await events.aclose()
        return _failure(first)
    headers = {"X-Session-ID": first.session_id}
    if stream:
        return EventSourceResponse(
            _sse(events, reply),
            headers=headers,
            ping=15,
            shutdown_grace_period=grace + SHUTDOWN_GRACE_MARGIN,
        )
    try:
        async for event in events:
            if isinstance(event, Delta):
                reply.add(event)
            elif isinstance(event, Finished):
                return JSONResponse(reply.response(event), headers=headers)
            else:
                return _failure(event)
    finally:
        await events.aclose()  # stops the disconnect watcher now, not when collected


async def _sse(events: AsyncIterator, reply: ReplyBuilder) -> AsyncIterator[dict]:
    """Stream chunks; a job that fails midway (e.g. cut by a shutdown) ends with an error event."""
    try:
        yield {"data": json.dumps(reply.first_chunk())}
        async for event in events:
            if isinstance(event, Delta):
                if event.text or event.logprobs:
                    if (chunk := reply.chunk(event)) is not None:  # None: held back
                        yield {"data": json.dumps(chunk)}
                else:
                    reply.add(event)  # e.g. the end-of-sequence token: nothing to show
            elif isinstance(event, Finished):
                for chunk in reply.final_chunks(event):
                    yield {"data": json.dumps(chunk)}
            elif event.status != CLIENT_GONE:
                body = error_body(event.message, "server_error", event.code)
                yield {"data": json.dumps(body)}
        yield {"data": "[DONE]"}
    finally:
        await events.aclose()
