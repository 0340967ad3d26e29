"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

Thin handlers: the request becomes a Turn (server/api/messages/turn.py), the Turn a job
(server/api/turns.py), and the job's events a Message or Anthropic's stream
(server/api/messages/replies.py, server/api/streaming.py). Errors leave in Anthropic's
shape (server/api/errors.py, by path). `anthropic-version`, `anthropic-beta` and Claude
Code's `?beta=true` are accepted and need nothing: a request is served the same under
any of them.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from server.api import turns
from server.api.common import TOOLS_NOT_OFFERED
from server.api.errors import APIError
from server.api.messages.protocol import CountTokensRequest, MessagesRequest, TokenCount
from server.api.messages.replies import TOO_LONG, MessagesReply, too_long
from server.api.messages.turn import MessagesTurn, folded, messages_turn
from server.api.streaming import respond
from server.api.turns import Prompt, Turn, owner_of, worker_of

router = APIRouter()


@router.post("/v1/messages")
async def messages(
    body: MessagesRequest, request: Request, x_session_id: str | None = Header(None)
) -> Response:
    worker = worker_of(request)
    engine = worker.engine
    user = body.metadata.user_id if body.metadata else None
    made = messages_turn(
        body, engine.model_id, x_session_id, owner_of(request, user),
        worker.settings.default_temperature,
    )  # fmt: skip
    turn, prompt = await prepared(engine, made.turn)
    try:
        job = turns.job(worker, turn, prompt.tokens, prompt.prefix_len, prompt.grammar)
    except APIError as e:
        if e.code != TOO_LONG:
            raise
        spec = engine.spec_for(turn.kv_cache)
        limit = engine.prompt_limit(spec) or engine.context_limit(spec) or engine.shape.context
        raise APIError(400, too_long(e.message, len(prompt.tokens), limit), e.code) from None
    reply = MessagesReply(
        body.model,
        engine.tokenizer,
        prompt.tokens,
        prompt.tools,
        prompt.split,
        made.prefill_only,
        engine.new_token_limit(),
        turn.parallel_tool_calls,
    )
    response = await respond([job], request, body.stream, reply, worker.settings.shutdown_timeout)
    return _said(response, made)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it: that request's input_tokens
    when nothing of it is cached yet."""
    engine = worker_of(request).engine
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
