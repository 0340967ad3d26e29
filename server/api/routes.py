"""The OpenAI-compatible routes: validate, tokenize, submit a Job, answer from its events.

Handlers never touch MLX: the worker thread does (`worker.call` for anything
that reads caches). The app factory (server/api/app.py) mounts `router`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from functools import partial
from typing import TYPE_CHECKING

from fastapi import APIRouter, Header, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from server.api.auth import session_owner
from server.api.cache_view import cache_report, read_contents
from server.api.errors import APIError
from server.api.protocol import (
    SESSION_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from server.api.responses import ReplyBuilder
from server.api.session_protocol import PageOptions, SessionCache
from server.api.shared_prefix import system_prefix_len
from server.api.streaming import respond
from server.api.structured import ToolPlan, reply_grammar, template_messages
from server.api.ui import PAGE_HEADERS, STATIC, page_options
from server.engine.jobs import Job, QueueFull, SessionBusy, ShuttingDown

if TYPE_CHECKING:  # both import MLX
    from server.engine.engine import Engine
    from server.engine.worker import Worker

DEFAULT_REPLY_TOKENS = 4096  # max_tokens when a request leaves it out (bounded caches)

log = logging.getLogger("h2o_server.routes")

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
    return {"status": "ok", "model": worker.engine.model_id, "notices": worker.engine.notices}


@router.get("/v1/models")
async def models(request: Request):
    card = {"id": _worker(request).engine.model_id, "object": "model", "created": 0}
    return {"object": "list", "data": [{**card, "owned_by": "h2o-server"}]}


# /metrics and /v1/sessions read what the session store last published: they answer
# at once, even while the worker is inside a long forward pass.


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    worker = _worker(request)
    store = worker.engine.store
    sessions = [stats for _, stats in store.published]
    return worker.metrics.render(
        store.published_counts,
        sessions,
        worker.queue_depth,
        worker.active,
        worker.engine.kv_budget,
        store.published_prefixes,
    )


@router.get("/v1/sessions")
async def list_sessions(request: Request, user: str | None = None):
    """The caller's sessions (everyone's unless --session-scope caller)."""
    worker = _worker(request)
    owner = _owner(request, user)
    mine = [stats for who, stats in worker.engine.store.published if who == owner]
    return {"object": "list", "data": mine}


@router.get("/v1/sessions/{session_id}/cache", response_model=SessionCache)
async def session_cache(session_id: str, request: Request, user: str | None = None):
    """What the session's cache holds, per layer and KV head (server/api/cache_view.py)."""
    _check_session_id(session_id)
    worker = _worker(request)
    store, owner = worker.engine.store, _owner(request, user)
    contents = await asyncio.wrap_future(
        worker.call(lambda: read_contents(store, session_id, owner))
    )
    if contents is None:
        raise APIError(404, f"no session {session_id!r}", "session_not_found")
    # Built and serialized in the thread pool: a long conversation's report is large.
    report = await run_in_threadpool(
        lambda: cache_report(contents, worker.engine.tokenizer).model_dump_json()
    )
    return Response(report, media_type="application/json")


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request, user: str | None = None):
    _check_session_id(session_id)
    worker = _worker(request)
    owner = _owner(request, user)
    try:
        found = await asyncio.wrap_future(
            worker.call(lambda: worker.engine.store.delete(session_id, owner))
        )
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
    return page_options(worker.engine, worker.settings)


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, x_session_id: str | None = Header(None)
):
    worker = _worker(request)
    grammar, tools = reply_grammar(body)  # a 400 for a schema the engine cannot use
    prompt, prefix_len = await _chat_prompt(worker.engine, body)
    shape = {"prefix_len": prefix_len, "grammar": grammar, "tools": tools}
    return await _generate(worker, body, prompt, request, x_session_id, "chat", **shape)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, x_session_id: str | None = Header(None)
):
    worker = _worker(request)
    prompt = await _text_prompt(worker.engine, body)
    echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    return await _generate(worker, body, prompt, request, x_session_id, "text", echo)


# ---------------------------------------------------------------------- helpers


def _check_model(engine: Engine, name: str) -> None:
    if name not in engine.model_names():
        raise APIError(
            404,
            f"model {name!r} is not served here; use {engine.model_id!r} (see /v1/models)",
            "model_not_found",
            "model",
        )


def _owner(request: Request, user: str | None) -> str:
    """Who the caller is, as the session store files sessions (server/api/auth.py)."""
    scoped = _worker(request).settings.session_scope == "caller"
    return session_owner(scoped, getattr(request.state, "api_key", None), user)


def _check_session_id(session_id: str) -> None:
    if not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise APIError(
            400,
            "a session id is 1-128 characters of letters, digits and . _ : -",
            "invalid_session_id",
        )


async def _chat_prompt(engine: Engine, body: ChatCompletionRequest) -> tuple[list[int], int]:
    """The prompt's tokens, and how many of them its system prompt makes up when other
    conversations may share them (server/api/shared_prefix.py)."""
    _check_model(engine, body.model)
    tokenizer = engine.tokenizer
    messages, tools = template_messages(body, "tools" in (tokenizer.chat_template or ""))
    template = partial(tokenizer.apply_chat_template, tools=tools)
    try:
        prompt = await run_in_threadpool(template, messages, add_generation_prompt=True)
        prefix_len = await run_in_threadpool(
            system_prefix_len,
            lambda lead: template(lead, add_generation_prompt=False),
            messages,
            prompt,
            engine.settings.prefix_min_tokens,
        )
        return prompt, prefix_len
    except TemplateError as e:  # the template rejects the conversation (roles, order)
        raise APIError(400, f"the chat template rejected the messages: {e}") from None
    except Exception as e:  # the tokenizer itself failed: the server's fault, not the client's
        log.exception("the chat template could not be applied")
        raise APIError(500, f"the chat template failed: {type(e).__name__}: {e}") from None


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
    prefix_len: int = 0,
    grammar: str | None = None,
    tools: ToolPlan | None = None,
):
    owner = _owner(request, body.user)
    key = body.prompt_cache_key or session_header
    job = _make_job(worker, body, prompt, key, owner, prefix_len, grammar)
    engine = worker.engine
    builder = ReplyBuilder(
        kind, engine.model_id, engine.tokenizer, body.include_usage(), echo, tools
    )
    return await respond(job, request, body.stream, builder, worker.settings.shutdown_timeout)


def _make_job(
    worker: Worker,
    body: SamplingRequest,
    prompt: list[int],
    key: str | None,
    owner: str,
    prefix_len: int = 0,
    grammar: str | None = None,
) -> Job:
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
    accepted = engine.prompt_limit(spec)
    field = "prompt" if isinstance(body, CompletionRequest) else "messages"
    if accepted is not None and len(prompt) > accepted:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens, more than the {accepted} this server "
            f"accepts (the model's context is {context}; --max-prompt-tokens raises the "
            "limit for policies that evict)",
            "context_length_exceeded",
            field,
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
    params = body.sampling_params(max_tokens or DEFAULT_REPLY_TOKENS)
    loop = asyncio.get_running_loop()
    job = Job(prompt, params, spec, key, loop, owner, field, prefix_len, grammar)
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(429, "the server is busy: too many queued requests", "queue_full") from None
    except ShuttingDown:
        raise APIError(503, "the server is shutting down", "server_shutting_down") from None
    return job
