"""One engine behind every API: a request, whichever door it came through, as a `Turn`.

Each API module (server/api/chat, server/api/responses, server/api/messages) turns its
request into a Turn: chat-template messages, the functions it may call and how, the
reply's schema, sampling, the session it continues. Here a Turn becomes a prompt (the
chat template, with tools, the answer's format and the thinking switch), a grammar,
and a Job for the worker; the same limits, errors, sessions, prefix store, batching,
cancellation and 429/503 for all of them. Plain Python: the API floor imports no MLX.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from server.api.auth import session_owner
from server.api.common import SESSION_ID_PATTERN, CacheOptions
from server.api.errors import APIError
from server.api.reasoning import ThinkingSplit, opened_in_prompt
from server.api.shared_prefix import system_prefix_len
from server.api.structured import (
    Function,
    ToolPlan,
    answer_hint,
    render_tools,
    shape_grammar,
)
from server.api.tool_formats import ToolFormat
from server.api.tool_formats.harmony import Harmony, HarmonySplit
from server.engine.jobs import Job, QueueFull, SamplingParams, ShuttingDown
from server.engine.registry import ModelTooLarge

if TYPE_CHECKING:  # both import MLX
    from server.engine.engine import Engine
    from server.engine.worker import Worker

EFFORTS = ("low", "medium", "high")
DEFAULT_REPLY_TOKENS = 4096  # max_tokens when a request leaves it out (bounded caches)

log = logging.getLogger("h2o_server.turns")


@dataclass
class Turn:
    """A request as the engine takes it, from any API."""

    model: str
    messages: list[dict]  # chat-template messages: role, content, tool_calls, tool_call_id
    sampling: SamplingParams  # its max_tokens is settled by `job` (`max_tokens` below)
    max_tokens: int | None = None  # None: what the context leaves, or DEFAULT_REPLY_TOKENS
    functions: list[Function] = field(default_factory=list)
    tool_choice: str = "auto"  # none | auto | required | a function's name
    parallel_tool_calls: bool = True
    answer: dict | None = None  # the JSON schema the reply's text follows (None: free)
    thinking: bool | None = None  # the template's thinking switch; None: its default
    effort: str | None = None  # the API's reasoning effort (Harmony's template takes it)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    session_key: str | None = None
    owner: str = ""
    kv_cache: CacheOptions | None = None
    keep_alive: float | None = None  # seconds its model stays loaded once idle (< 0: ever)
    n: int = 1
    # Over the context: a 400 (OpenAI's APIs), or the reply ends where the context does
    # (Anthropic's: max_tokens is required, and clients ask for more than a small model has).
    clamp_max_tokens: bool = False
    prompt_field: str = "messages"  # the request field that holds the prompt (for errors)
    params: dict[str, str] = field(default_factory=dict)  # field names for errors, by role


@dataclass
class Prompt:
    tokens: list[int]
    prefix_len: int  # tokens other conversations may share (its system prompt)
    grammar: str | None  # the llguidance grammar the reply follows
    tools: ToolPlan | None  # how the reply calls tools
    thinking: Thinking | None = None  # a thinking model's tags: its reply is split

    def split(self) -> ThinkingSplit | None:
        """A fresh splitter of one reply into reasoning and content (None: no tags)."""
        t = self.thinking
        if t is None:
            return None
        return HarmonySplit() if t.harmony else ThinkingSplit(t.start, t.end, t.opened)


@dataclass
class Thinking:
    start: str
    end: str
    opened: bool  # the prompt ends inside a thinking block
    harmony: bool = False  # gpt-oss: channels, not tags


# ---------------------------------------------------------------------- callers


def worker_of(request: Request) -> Worker:
    return request.app.state.worker


def owner_of(request: Request, user: str | None) -> str:
    """Who the caller is, as the session store files sessions (server/api/auth.py)."""
    scoped = worker_of(request).settings.session_scope == "caller"
    return session_owner(scoped, getattr(request.state, "api_key", None), user)


def model_entry(worker: Worker, name: str):
    """The served model a request's `model` names (server/engine/catalog.py), else a 404
    that lists them."""
    entry = worker.models.find(name)
    if entry is None:
        served = ", ".join(repr(n) for n in worker.models.names())
        raise APIError(
            404,
            f"model {name!r} is not served here; models: {served} (see /v1/models)",
            "model_not_found",
            "model",
        )
    return entry


async def engine_for(worker: Worker, name: str, keep_alive: float | None = None) -> Engine:
    """The named model's Engine, loaded first if it is not (on the worker thread, between
    rounds); a 404 for a name not served here."""
    entry = model_entry(worker, name)
    engine = worker.models.engine(entry.name)
    if engine is None:
        try:
            loaded = await asyncio.wrap_future(
                worker.call(lambda: worker.models.load(entry.name, worker.busy_models()))
            )
        except ModelTooLarge as e:
            raise APIError(400, str(e), "model_too_large", "model") from None
        except Exception as e:
            log.exception("model %s could not be loaded", entry.name)
            raise APIError(500, f"model {entry.name!r} could not be loaded: {e}") from None
        engine = loaded.engine
    worker.models.touch(entry.name, keep_alive)
    return engine


def check_session_id(session_id: str) -> None:
    if not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise APIError(
            400,
            "a session id is 1-128 characters of letters, digits and . _ : -",
            "invalid_session_id",
        )


# ---------------------------------------------------------------------- turn -> prompt


def turn_grammar(turn: Turn, fmt: ToolFormat) -> tuple[str | None, ToolPlan | None]:
    """The grammar the turn's reply follows (None: free text) and how it calls tools."""
    return shape_grammar(
        turn.functions,
        turn.tool_choice,
        turn.parallel_tool_calls,
        turn.answer,
        fmt,
        turn.params.get("parameters", "tools[{i}].parameters"),
        turn.params.get("answer", "response_format"),
    )


async def prepare(engine: Engine, turn: Turn) -> Prompt:
    """The turn's prompt tokens, shareable prefix, grammar and tool plan (400s for what the
    template or the grammar engine refuses)."""
    fmt = engine.tool_format
    grammar, tools = turn_grammar(turn, fmt)
    tokenizer = engine.tokenizer
    offered = turn.functions if turn.tool_choice != "none" else []
    messages, tools_arg = render_tools(turn.messages, offered, fmt)
    kwargs = dict(turn.template_kwargs)
    if turn.thinking is not None:
        kwargs["enable_thinking"] = turn.thinking
    if turn.effort in EFFORTS:  # Harmony's template reads it (gpt-oss: low, medium, high)
        kwargs.setdefault("reasoning_effort", turn.effort)
    thinks = bool(getattr(tokenizer, "has_thinking", False))
    if grammar is not None and thinks:  # a grammar shapes the reply from its first token
        kwargs["enable_thinking"] = False
    template = partial(tokenizer.apply_chat_template, tools=tools_arg, **kwargs)
    hint = answer_hint(offered, turn.tool_choice, turn.answer)
    try:
        tokens = None
        if hint is not None:
            try:  # a template that takes system messages only first does without it
                tokens = await run_in_threadpool(
                    template, [*messages, hint], add_generation_prompt=True
                )
            except TemplateError:
                tokens = None
        if tokens is None:
            tokens = await run_in_threadpool(template, messages, add_generation_prompt=True)
        prefix_len = await run_in_threadpool(
            system_prefix_len,
            lambda lead: template(lead, add_generation_prompt=False),
            messages,
            tokens,
            engine.settings.prefix_min_tokens,
        )
    except TemplateError as e:  # the template rejects the conversation (roles, order)
        raise APIError(400, f"the chat template rejected the messages: {e}") from None
    except Exception as e:  # the tokenizer itself failed: the server's fault, not the client's
        log.exception("the chat template could not be applied")
        raise APIError(500, f"the chat template failed: {type(e).__name__}: {e}") from None
    thinking = None
    if isinstance(fmt, Harmony):
        thinking = Thinking("", "", False, harmony=True)
    elif thinks:
        start, end = tokenizer.think_start, tokenizer.think_end
        tail = tokenizer.decode(tokens[-8:])
        thinking = Thinking(start, end, opened_in_prompt(tail, start, end))
    return Prompt(tokens, prefix_len, grammar, tools, thinking)


# ---------------------------------------------------------------------- prompt -> job


def job(
    worker: Worker,
    engine: Engine,
    turn: Turn,
    prompt: list[int],
    prefix_len: int = 0,
    grammar: str | None = None,
    keep: bool = True,
) -> Job:
    """The turn's Job, submitted to the worker: the server's limits checked first (a 400
    naming the field), then 429 when the queue is full, 503 while shutting down."""
    if turn.session_key is not None:
        check_session_id(turn.session_key)
    if turn.n > worker.settings.max_sessions:
        raise APIError(
            400,
            f"n {turn.n} is more than the {worker.settings.max_sessions} replies this server "
            "decodes at once (--max-sessions)",
            param="n",
        )
    try:
        spec = engine.spec_for(turn.kv_cache)
    except ValueError as e:
        raise APIError(400, str(e), param="kv_cache") from None
    vocab = engine.vocab_size
    bias = turn.sampling.logit_bias
    if bias and any(not 0 <= t < vocab for t in bias):
        raise APIError(400, f"logit_bias token ids must lie in [0, {vocab})", param="logit_bias")
    max_tokens, context = turn.max_tokens, engine.shape.context
    max_param = turn.params.get("max_tokens", "max_tokens")
    if max_tokens is not None and max_tokens > context:
        if not turn.clamp_max_tokens:
            raise APIError(
                400,
                f"{max_param} {max_tokens} exceeds the model's context ({context})",
                param=max_param,
            )
        max_tokens = context if spec.info.bounded else None  # the wall, below
    accepted = engine.prompt_limit(spec)
    if accepted is not None and len(prompt) > accepted:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens, more than the {accepted} this server "
            f"accepts (the model's context is {context}; --max-prompt-tokens raises the "
            "limit for policies that evict)",
            "context_length_exceeded",
            turn.prompt_field,
        )
    limit = engine.context_limit(spec)
    if limit is not None:  # policy full: prompt and reply must fit in the cache
        room = limit - len(prompt)
        if turn.clamp_max_tokens and room >= 1:
            max_tokens = min(max_tokens or room, room)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"the prompt ({len(prompt)} tokens) plus {max_param} ({max_tokens}) exceeds "
                f"this server's context of {limit} tokens under policy full",
                "context_length_exceeded",
                turn.prompt_field,
            )
        max_tokens = max_tokens or room
    params = replace(turn.sampling, max_tokens=max_tokens or DEFAULT_REPLY_TOKENS)
    new = Job(
        prompt,
        params,
        spec,
        turn.session_key,
        asyncio.get_running_loop(),
        turn.owner,
        turn.prompt_field,
        prefix_len,
        grammar,
        n=turn.n,
        reuse=not params.prompt_logprobs,  # the prompt's logprobs: all of it prefilled
        keep=keep,
        model=engine.name,
        keep_alive=turn.keep_alive,
    )
    try:
        worker.submit(new)
    except QueueFull:
        raise APIError(429, "the server is busy: too many queued requests", "queue_full") from None
    except ShuttingDown:
        raise APIError(503, "the server is shutting down", "server_shutting_down") from None
    return new


async def submit(worker: Worker, turn: Turn) -> tuple[Job, Prompt, Engine]:
    """The turn prepared and submitted: its job, its prompt and its model's engine."""
    engine = await engine_for(worker, turn.model, turn.keep_alive)
    prompt = await prepare(engine, turn)
    submitted = job(worker, engine, turn, prompt.tokens, prompt.prefix_len, prompt.grammar)
    return submitted, prompt, engine
