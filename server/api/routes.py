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
    NamedToolChoice,
    SamplingRequest,
)
from server.api.responses import ReplyBuilder
from server.api.session_protocol import PageOptions, SessionCache
from server.api.shared_prefix import system_prefix_len
from server.api.streaming import respond
from server.api.structured import answer_hint, answer_schema, reply_grammar, template_messages
from server.api.ui import PAGE_HEADERS, STATIC, page_options
from server.engine.detokenize import decoder
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
    return {"object": "list", "data": [_model_card(_worker(request).engine)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    """One model (`client.models.retrieve`): any name requests may use for it."""
    engine = _worker(request).engine
    _check_model(engine, model)
    return {**_model_card(engine), "id": model}


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "h2o-server"}


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
    key = body.prompt_cache_key or x_session_id
    owner = _owner(request, body.user)
    job = _make_job(worker, body, prompt, key, owner, prefix_len, grammar)
    engine = worker.engine
    builder = ReplyBuilder(
        "chat",
        engine.model_id,
        engine.tokenizer,
        body.include_usage(),
        [(prompt, "")],
        body.n,
        tools,
    )
    return await respond([job], request, body.stream, builder, worker.settings.shutdown_timeout)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, x_session_id: str | None = Header(None)
):
    worker = _worker(request)
    engine = worker.engine
    prompts = await _text_prompts(engine, body)
    key = body.prompt_cache_key or x_session_id
    if key is not None and len(prompts) > 1:
        raise APIError(
            400,
            "a session key names one conversation; this request has several prompts",
            param="prompt",
        )
    owner = _owner(request, body.user)
    jobs = []
    try:
        for tokens, _ in prompts:  # a batch's prompts: each its own throwaway session
            jobs.append(_make_job(worker, body, tokens, key, owner, keep=len(prompts) == 1))
    except APIError:
        for job in jobs:
            job.cancel("another prompt of its request was refused")
        raise
    echoes = [(tokens, text if body.echo else "") for tokens, text in prompts]
    builder = ReplyBuilder(
        "text", engine.model_id, engine.tokenizer, body.include_usage(), echoes, body.n
    )
    return await respond(jobs, request, body.stream, builder, worker.settings.shutdown_timeout)


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
    choice = body.tool_choice
    hint = answer_hint(
        body.tools or [],
        choice.function.name if isinstance(choice, NamedToolChoice) else choice or "auto",
        answer_schema(body.response_format),
    )
    try:
        prompt = None
        if hint is not None:
            try:  # a template that takes system messages only first does without it
                prompt = await run_in_threadpool(
                    template, [*messages, hint], add_generation_prompt=True
                )
            except TemplateError:
                prompt = None
        if prompt is None:
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


async def _text_prompts(engine: Engine, body: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt's tokens and text (an echo's: token ids decoded)."""
    _check_model(engine, body.model)
    vocab, out = engine.vocab_size, []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            tokens = await run_in_threadpool(engine.tokenizer.encode, prompt)
            text = prompt
        else:
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
            tokens = prompt
            text = await run_in_threadpool(decoder(engine.tokenizer), tokens) if body.echo else ""
        if not tokens:
            raise APIError(400, "the prompt is empty", param="prompt")
        out.append((tokens, text))
    return out


def _make_job(
    worker: Worker,
    body: SamplingRequest,
    prompt: list[int],
    key: str | None,
    owner: str,
    prefix_len: int = 0,
    grammar: str | None = None,
    keep: bool = True,
) -> Job:
    engine = worker.engine
    if key is not None:
        _check_session_id(key)
    if body.n > worker.settings.max_sessions:
        raise APIError(
            400,
            f"n {body.n} is more than the {worker.settings.max_sessions} replies this server "
            "decodes at once (--max-sessions)",
            param="n",
        )
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
    job = Job(
        prompt,
        params,
        spec,
        key,
        loop,
        owner,
        field,
        prefix_len,
        grammar,
        n=body.n,
        reuse=not params.prompt_logprobs,  # the prompt's logprobs: all of it prefilled
        keep=keep,
    )
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(429, "the server is busy: too many queued requests", "queue_full") from None
    except ShuttingDown:
        raise APIError(503, "the server is shutting down", "server_shutting_down") from None
    return job
