"""Answering a request's jobs: one JSON body or an SSE stream, and cancellation when the
client leaves.

A request is one job or several (a batch of completion prompts); each API's reply
builder (`Reply`) turns their events into its own bodies and stream events, so every
API streams, cancels and fails the same way. `job_events` is the reusable wrapper: it
yields the jobs' events (with the job's position) until all have ended, and cancels
them the moment the client's connection closes (a task listens on the ASGI receive
channel for `http.disconnect`, streaming or not) or the response is closed.

Every body and event is strict JSON (`strict_json`): a NaN or infinity anywhere is a
server bug, logged and answered as an error, never sent as `-Infinity`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from server.engine.jobs import Delta, Failed, Finished, Job, Started

log = logging.getLogger("h2o_server.streaming")
CLIENT_GONE = 499  # nginx's "client closed request": logged, never read by anyone
# sse-starlette ends open streams on shutdown by itself; the worker's drain ends ours
# first (with an error event), so the library only steps in if that ever hangs.
SHUTDOWN_GRACE_MARGIN = 10.0
KEEPALIVE = 15.0  # seconds without an event before the reply's keepalive events


class Reply(Protocol):
    """What one API makes of a request's events. Stream events are sse-starlette's
    dicts ({"data": ...}, with "event" where the API names its events)."""

    def opening(self, started: Started) -> list[dict]: ...
    def on_delta(self, job: int, delta: Delta) -> list[dict]: ...
    def on_finished(self, job: int, finished: Finished) -> list[dict]: ...
    def closing(self) -> list[dict]: ...
    def body(self) -> dict: ...
    def error_event(self, failed: Failed) -> list[dict]: ...
    def error_response(self, failed: Failed) -> Response: ...

    # Optional: keepalive() -> list[dict], events sent when nothing else was for
    # KEEPALIVE seconds (a long prefill): a client whose idle timer only data events
    # reset (Codex) keeps waiting. SSE comment pings go out every 15 s regardless.


def strict_json(payload) -> str:
    """JSON text with no NaN or infinity (raises ValueError: JSON cannot carry them)."""
    return json.dumps(payload, allow_nan=False, ensure_ascii=False)


class JSONBody(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return strict_json(content).encode()


async def _watch_disconnect(jobs: Sequence[Job], request: Request) -> None:
    """Cancel the jobs as soon as the client goes away, and wake the handler."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for job in jobs:
                job.cancel("client disconnected")
            jobs[0].events.put_nowait(Failed(CLIENT_GONE, "client disconnected"))
            return


async def _forward(i: int, job: Job, merged: asyncio.Queue) -> None:
    while True:
        event = await job.events.get()
        await merged.put((i, event))
        if isinstance(event, Finished | Failed):
            return


async def job_events(jobs: Sequence[Job], request: Request) -> AsyncIterator[tuple[int, object]]:
    """(job position, event) until every job has finished or one failed; a client that
    goes away cancels them all (reusable wrapper)."""
    watcher = asyncio.create_task(_watch_disconnect(jobs, request))
    merged: asyncio.Queue = asyncio.Queue()
    forwards = [asyncio.create_task(_forward(i, job, merged)) for i, job in enumerate(jobs)]
    left = len(jobs)
    try:
        while left:
            i, event = await merged.get()
            yield i, event
            if isinstance(event, Failed):
                return
            left -= isinstance(event, Finished)
    finally:
        watcher.cancel()
        for task in forwards:
            task.cancel()
        for job in jobs:
            job.cancel("response closed")  # no-op once the job has finished


async def respond(
    jobs: Sequence[Job], request: Request, stream: bool, reply: Reply, grace: float = 0.0
) -> Response:
    """The jobs' answer; `grace`: how long a drain after SIGTERM may let them run."""
    events = job_events(jobs, request)
    _, started = await anext(events)  # a job's first event: Started, or why it cannot
    if not isinstance(started, Started):
        await events.aclose()
        return _failure(reply, started)
    headers = {"X-Session-ID": started.session_id}
    if stream:
        return EventSourceResponse(
            _sse(events, reply, started),
            headers=headers,
            ping=15,
            shutdown_grace_period=grace + SHUTDOWN_GRACE_MARGIN,
        )
    try:
        async for i, event in events:
            if isinstance(event, Delta):
                reply.on_delta(i, event)
            elif isinstance(event, Finished):
                reply.on_finished(i, event)
            elif isinstance(event, Failed):
                return _failure(reply, event)
        return JSONBody(reply.body(), headers=headers)
    except ValueError:  # a body JSON cannot carry
        log.exception("a reply could not be encoded")
        return reply.error_response(Failed(500, "the reply could not be encoded as JSON"))
    finally:
        await events.aclose()  # stops the disconnect watcher now, not when collected


def _failure(reply: Reply, event: Failed) -> Response:
    if event.status == CLIENT_GONE:  # nobody is listening any more
        return Response(status_code=CLIENT_GONE)
    return reply.error_response(event)


def _encoded(events: list[dict]) -> list[dict]:
    return [{**e, "data": _text(e["data"])} for e in events]


def _text(data) -> str:
    return data if isinstance(data, str) else strict_json(data)


async def _sse(events: AsyncIterator, reply: Reply, started: Started) -> AsyncIterator[dict]:
    """Stream events; a job that fails midway (e.g. cut by a shutdown) ends the stream
    with the API's error event."""
    pending: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:  # waiting on a queue can time out; an async generator cannot
        async for item in events:
            await pending.put(item)
        await pending.put(None)

    pumping = asyncio.create_task(pump())
    try:
        for e in _encoded(reply.opening(started)):
            yield e
        while True:
            try:
                item = await asyncio.wait_for(pending.get(), KEEPALIVE)
            except TimeoutError:
                for e in _encoded(getattr(reply, "keepalive", list)()):
                    yield e
                continue
            if item is None:
                break
            i, event = item
            if isinstance(event, Delta):
                out = reply.on_delta(i, event)
            elif isinstance(event, Finished):
                out = reply.on_finished(i, event)
            elif isinstance(event, Failed):
                out = [] if event.status == CLIENT_GONE else reply.error_event(event)
            else:
                out = []
            for e in _encoded(out):
                yield e
        for e in _encoded(reply.closing()):
            yield e
    except ValueError:  # an event JSON cannot carry: a bug, said as the API's error
        log.exception("a stream event could not be encoded")
        failed = Failed(500, "the reply could not be encoded as JSON")
        for e in _encoded(reply.error_event(failed)):
            yield e
    finally:
        pumping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pumping  # its cancellation closes the events' generator first
        await events.aclose()
