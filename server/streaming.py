"""Answering a job: one JSON body or an SSE stream, and cancellation when the client leaves.

`job_events` is the reusable wrapper: it yields a job's events until the job
ends and cancels the job when the client goes away or the response is closed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from server.errors import error_response
from server.jobs import Delta, Failed, Finished, Job, Started
from server.protocol import error_body
from server.responses import ReplyBuilder


async def job_events(job: Job, request: Request) -> AsyncIterator:
    """The job's events until it ends; a client that goes away cancels it (reusable wrapper)."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield event
            if isinstance(event, Finished | Failed):
                return
    finally:
        job.cancelled.set()  # no-op once the job has finished


async def respond(job: Job, request: Request, stream: bool, reply: ReplyBuilder):
    events = job_events(job, request)
    first = await anext(events, None)
    if first is None:  # the client left while queued
        return JSONResponse({}, status_code=499)
    if isinstance(first, Failed):
        return error_response(first.status, first.message)
    assert isinstance(first, Started)
    headers = {"X-Session-ID": first.session_id}
    if stream:

        async def chunks():
            yield {"data": json.dumps(reply.first_chunk())}
            async for event in events:
                if isinstance(event, Delta):
                    if event.text or event.logprobs:
                        yield {"data": json.dumps(reply.chunk(event))}
                    else:
                        reply.add(event)  # e.g. the end-of-sequence token: nothing to show
                elif isinstance(event, Finished):
                    for chunk in reply.final_chunks(event):
                        yield {"data": json.dumps(chunk)}
                else:
                    yield {"data": json.dumps(error_body(event.message, "server_error"))}
            yield {"data": "[DONE]"}

        return EventSourceResponse(chunks(), headers=headers, ping=15)

    async for event in events:
        if isinstance(event, Delta):
            reply.add(event)
        elif isinstance(event, Finished):
            return JSONResponse(reply.response(event), headers=headers)
        else:
            return error_response(event.status, event.message)
    return JSONResponse({}, status_code=499)  # the client went away
