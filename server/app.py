"""FastAPI app: OpenAI-compatible routes in front of the MLX worker.

Handlers validate, tokenize (the tokenizer is not MLX) and submit a Job; the
worker thread does everything that touches MLX. Every error leaves here in
OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from config.settings import ServerSettings

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine import Engine
from server.generation import Delta, SamplingParams
from server.protocol import (
    SESSION_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    error_body,
)
from server.responses import ReplyBuilder
from server.sessions import SessionBusy
from server.worker import Failed, Finished, Job, QueueFull, Started, Worker

log = logging.getLogger("h2o_server")
DEFAULT_REPLY_TOKENS = 4096  # max_tokens when a request leaves it out (bounded caches)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_response(status: int, message: str, code: str | None = None, param: str | None = None):
    kind = {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)


def create_app(settings: ServerSettings, load_engine=Engine.load) -> FastAPI:
    worker = Worker(settings, load_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(worker.start)
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="h2o-server", lifespan=lifespan)
    app.state.worker = worker
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    _install_error_handlers(app)

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                return error_response(401, "invalid or missing API key", "invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": worker.engine.model_id}

    @app.get("/v1/models")
    async def models():
        card = {"id": worker.engine.model_id, "object": "model", "created": 0}
        return {"object": "list", "data": [{**card, "owned_by": "h2o-server"}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        sessions = await asyncio.wrap_future(worker.call(worker.engine.store.snapshot))
        resident = [s for s in sessions if not s["spilled"]]
        gauges = {
            "queue_depth": (worker.queue_depth, "requests waiting to start"),
            "active_generations": (worker.active, "requests being generated"),
            "sessions": (len(resident), "sessions in memory"),
            "sessions_spilled": (len(sessions) - len(resident), "sessions on disk"),
            "cache_bytes": (sum(s["bytes"] for s in resident), "bytes held by KV caches"),
            "cache_budget_bytes": (worker.engine.budget, "KV memory budget"),
            "evicted_tokens": (
                sum(s["evictions"] for s in sessions),
                "tokens evicted, live sessions",
            ),
        }
        tokens, seconds = (
            worker.metrics.get("completion_tokens_total"),
            worker.metrics.get("decode_seconds_total"),
        )
        gauges["decode_tokens_per_second"] = (
            tokens / seconds if seconds else 0.0,
            "completion tokens per second of decode time, since start",
        )
        return worker.metrics.render(gauges)

    @app.get("/v1/sessions")
    async def list_sessions():
        sessions = await asyncio.wrap_future(worker.call(worker.engine.store.snapshot))
        return {"object": "list", "data": sessions}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str):
        _check_session_id(session_id)
        try:
            found = await asyncio.wrap_future(
                worker.call(lambda: worker.engine.store.delete(session_id))
            )
        except SessionBusy:
            raise APIError(409, f"session {session_id} is answering a request") from None
        if not found:
            raise APIError(404, f"no session {session_id!r}", "session_not_found")
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, x_session_id: str | None = Header(None)
    ):
        prompt = await _chat_prompt(worker.engine, body)
        return await _generate(worker, body, prompt, request, x_session_id, "chat")

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, request: Request, x_session_id: str | None = Header(None)
    ):
        prompt = await _text_prompt(worker.engine, body)
        echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
        return await _generate(worker, body, prompt, request, x_session_id, "text", echo)

    return app


# ---------------------------------------------------------------------- helpers


def _check_model(engine: Engine, name: str) -> None:
    if name not in engine.model_names():
        raise APIError(
            404,
            f"model {name!r} is not served here; use {engine.model_id!r} (see /v1/models)",
            "model_not_found",
            "model",
        )


def _check_session_id(session_id: str) -> None:
    if not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise APIError(
            400,
            "a session id is 1-128 characters of letters, digits and . _ : -",
            "invalid_session_id",
        )


async def _chat_prompt(engine: Engine, body: ChatCompletionRequest) -> list[int]:
    _check_model(engine, body.model)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        return await run_in_threadpool(
            engine.tokenizer.apply_chat_template, messages, add_generation_prompt=True
        )
    except Exception as e:  # the template rejects the conversation (roles, order)
        raise APIError(400, f"the chat template rejected the messages: {e}") from None


async def _text_prompt(engine: Engine, body: CompletionRequest) -> list[int]:
    _check_model(engine, body.model)
    if isinstance(body.prompt, str):
        prompt = await run_in_threadpool(engine.tokenizer.encode, body.prompt)
    else:
        vocab = engine.vocab_size
        if any(not 0 <= t < vocab for t in body.prompt):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
        prompt = body.prompt
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return prompt


async def _generate(
    worker: Worker,
    body: SamplingRequest,
    prompt: list[int],
    request: Request,
    session_header: str | None,
    kind: str,
    echo: str = "",
):
    job = _make_job(worker, body, prompt, body.prompt_cache_key or session_header)
    engine = worker.engine
    builder = ReplyBuilder(kind, engine.model_id, engine.tokenizer, body.include_usage(), echo)
    return await _respond(job, request, body.stream, builder)


def _make_job(worker: Worker, body: SamplingRequest, prompt: list[int], key: str | None) -> Job:
    engine = worker.engine
    if key is not None:
        _check_session_id(key)
    try:
        spec = engine.spec_for(body.kv_cache)
    except ValueError as e:
        raise APIError(400, str(e), param="kv_cache") from None
    vocab = engine.vocab_size
    if body.logit_bias and any(not 0 <= t < vocab for t in body.logit_bias):
        raise APIError(400, f"logit_bias token ids must lie in [0, {vocab})", param="logit_bias")
    max_tokens = body.token_limit()
    context = engine.shape.context
    if max_tokens is not None and max_tokens > context:
        raise APIError(
            400,
            f"max_tokens {max_tokens} exceeds the model's context ({context})",
            param="max_tokens",
        )
    limit = engine.context_limit(spec)
    if limit is not None:  # policy full: prompt and reply must fit in the cache
        room = limit - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"this server's context of {limit} tokens under policy full",
                "context_length_exceeded",
                "messages",
            )
        max_tokens = max_tokens or room
    params = SamplingParams(
        max_tokens=max_tokens or DEFAULT_REPLY_TOKENS,
        temperature=body.temperature,
        top_p=body.top_p,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.logit_bias,
        logprobs=body.n_logprobs(),
    )
    job = Job(prompt, params, spec, key, asyncio.get_running_loop())
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(429, "the server is busy: too many queued requests", "queue_full") from None
    return job


async def _events(job: Job, request: Request) -> AsyncIterator:
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


async def _respond(job: Job, request: Request, stream: bool, reply: ReplyBuilder):
    events = _events(job, request)
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


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        problems = []
        for err in e.errors():
            if err.get("type") == "json_invalid":
                reason = err.get("ctx", {}).get("error", "")
                return error_response(400, f"the request body is not valid JSON: {reason}")
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err['msg']}" if where else err["msg"])
        first = e.errors()[0].get("loc", ()) if e.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return error_response(400, "; ".join(problems) or "invalid request", None, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(HTTPException)
    async def fastapi_http_error(request: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(e).__name__}")
