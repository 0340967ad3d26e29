"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

Thin handlers: the request becomes a Turn (server/api/messages/turn.py), the Turn a job
(server/api/turns.py), and the job's events a Message or Anthropic's stream
(server/api/messages/replies.py, server/api/streaming.py). Errors leave in Anthropic's
shape (server/api/errors.py, by path). `anthropic-version`, `anthropic-beta` and Claude
Code's `?beta=true` are accepted and need nothing: a request is served the same under
any of them. A request in a message thread (`thread`) has its conversation rebuilt from
the thread first (server/api/messages/threads.py).
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from server.api import turns
from server.api.common import TOOLS_NOT_OFFERED
from server.api.errors import APIError
from server.api.loading import anthropic_stream_error, served
from server.api.messages.protocol import (
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    TokenCount,
)
from server.api.messages.replies import TOO_LONG, MessagesReply, too_long
from server.api.messages.threads import ThreadStore, ThreadTurn, new_session
from server.api.messages.turn import MessagesTurn, folded, messages_turn
from server.api.streaming import respond
from server.api.turns import Prompt, Turn, owner_of, worker_of

router = APIRouter()


@router.post("/v1/messages")
async def messages(
    body: MessagesRequest, request: Request, x_session_id: str | None = Header(None)
) -> Response:
    worker = worker_of(request)
    user = body.metadata.user_id if body.metadata else None
    owner = owner_of(request, user)
    body, thread_turn, session = _threaded(body, request, owner, x_session_id)
    previous = body.thread.previous_message_id if body.thread else None

    async def serve() -> Response:
        try:
            return await _serve(body, request, worker, owner, session, thread_turn, previous)
        except BaseException:  # the thread's reply may be continued again
            threads_of(request).release(previous)
            raise

    try:
        return await served(
            request, body.model, body.keep_alive, body.stream, serve, anthropic_stream_error
        )
    except BaseException:
        threads_of(request).release(previous)
        raise


async def _serve(body, request, worker, owner, session, thread_turn, previous) -> Response:
    engine = await turns.engine_for(worker, body.model, body.keep_alive)
    made = messages_turn(body, engine.model_id, session, owner, worker.settings.default_temperature)
    turn, prompt = await prepared(engine, made.turn)
    try:
        job = turns.job(worker, engine, turn, prompt.tokens, prompt.prefix_len, prompt.grammar)
    except APIError as e:
        if e.code != TOO_LONG:
            raise
        spec = engine.spec_for(turn.kv_cache)
        limit = engine.prompt_limit(spec) or engine.context_limit(spec) or engine.shape.context
        raise APIError(400, too_long(e.message, len(prompt.tokens), limit), e.code) from None
    on_done = None
    if thread_turn is not None:
        store = threads_of(request)

        def on_done(reply_id: str, content: list) -> None:
            said = InputMessage(role="assistant", content=[b.model_dump() for b in content])
            kept = replace(thread_turn, messages=[*body.messages, said])
            store.keep(reply_id, kept, previous)

    reply = MessagesReply(
        body.model,
        engine.tokenizer,
        prompt.tokens,
        prompt.tools,
        prompt.split,
        made.prefill_only,
        engine.new_token_limit(),
        turn.parallel_tool_calls,
        on_done,
    )
    response = await respond([job], request, body.stream, reply, worker.settings.shutdown_timeout)
    return _said(response, made)


def threads_of(request: Request) -> ThreadStore:
    state = request.app.state
    if getattr(state, "threads", None) is None:
        state.threads = ThreadStore()
    return state.threads


def _threaded(
    body: MessagesRequest, request: Request, owner: str, session: str | None
) -> tuple[MessagesRequest, ThreadTurn | None, str | None]:
    """The request with its thread's conversation rebuilt (a continue), what to keep of it
    once answered, and the session the thread's turns share."""
    if body.thread is None:
        return body, None, session
    if body.thread.type == "create":
        session = session or new_session()
        return body, ThreadTurn(body.system, body.tools, [], owner, session, 0.0), session
    for field in ("system", "tools"):
        if getattr(body, field) is not None:
            raise APIError(
                400,
                f"a thread's continue request leaves out {field}: the thread keeps its create "
                "request's",
                param=field,
            )
    held = threads_of(request).resume(body.thread.previous_message_id, owner)
    rebuilt = body.model_copy(
        update={"messages": [*held.messages, *body.messages], "system": held.system,
                "tools": held.tools}
    )  # fmt: skip
    return rebuilt, replace(held, messages=[], state="open"), session or held.session


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it: that request's input_tokens
    when nothing of it is cached yet."""
    engine = await turns.engine_for(worker_of(request), body.model)
    made = messages_turn(body, engine.model_id)
    _, prompt = await prepared(engine, made.turn)
    return _said(JSONResponse(TokenCount(input_tokens=len(prompt.tokens)).model_dump()), made)


async def prepared(engine, turn: Turn) -> tuple[Turn, Prompt]:
    """The turn's prompt; where the template refuses a system message after the first turn
    (Claude Code sends one), the turn again with those folded into the user turns."""
    try:
        return turn, await turns.prepare(engine, turn)
    except APIError as e:
        other = folded(turn.messages)
        if e.status != 400 or other == turn.messages:
            raise
    turn = replace(turn, messages=other)
    return turn, await turns.prepare(engine, turn)


def _said(response: Response, made: MessagesTurn) -> Response:
    """The reply, naming the tools it was sent that the model was not offered (Anthropic's
    own typed tools), as the Responses door does."""
    if made.not_offered:
        response.headers[TOOLS_NOT_OFFERED] = ", ".join(made.not_offered)
    return response
