"""POST /v1/responses, GET /v1/responses/{id}, GET /v1/responses/{id}/input_items,
DELETE /v1/responses/{id}, POST /v1/responses/input_tokens: OpenAI's Responses API,
stateful.

Thin handlers: the request, with the history of the chain it continues
(server/api/responses/store.py), becomes a Turn (server/api/responses/turn.py), the
Turn a job (server/api/turns.py), the job's events a Response or its stream
(server/api/responses/replies.py, server/api/streaming.py).

Which session's cache a turn reuses: its `prompt_cache_key` if given (Codex's: it sends
`store: false` and resends the whole history under one key), else the session of the
response it continues (`previous_response_id`), else one the session store finds by the
prompt (a client that resends its whole history, as the Agents SDK does) or a new one;
a response neither stored nor keyed keeps nothing past its reply, not even its cache.

Under --session-scope caller a stored response and its chain's session belong to the
API key that made it (GET and DELETE carry no body, so `user` takes no part).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from server.api import turns
from server.api.common import TOOLS_NOT_OFFERED, now
from server.api.errors import APIError
from server.api.loading import responses_stream_error, served
from server.api.responses.protocol import (
    DeletedResponse,
    InputItemsQuery,
    InputTokens,
    InputTokensCount,
    ReasoningConfig,
    ResponseCreate,
    ResponseObject,
)
from server.api.responses.replies import ResponseReply
from server.api.responses.store import (
    HistoryGone,
    ResponseStore,
    StoredResponse,
    new_response_id,
)
from server.api.responses.turn import ResponsesTurn, dumped, responses_turn
from server.api.streaming import respond
from server.api.turns import Prompt, owner_of, worker_of

if TYPE_CHECKING:  # imports MLX
    from server.engine.engine import Engine

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    """The app's stored responses, made on first use from the serve settings."""
    state = request.app.state
    if getattr(state, "responses", None) is None:
        # Imported here: the package runs cache/__init__, which imports MLX; by the first
        # request the worker has loaded it (the API floor imports none at start-up).
        from cache.budget import parse_bytes

        s = worker_of(request).settings
        folder = f"{s.spill_dir}/responses" if s.spill_dir else None
        state.responses = ResponseStore(
            s.responses_max_stored,
            parse_bytes(s.responses_max_bytes),
            s.responses_max_age_seconds,
            folder,
        )
    return state.responses


def caller(request: Request) -> str:
    return owner_of(request, None)


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", "response_not_found")


def stored(request: Request, response_id: str) -> StoredResponse:
    record = store_of(request).get(response_id, caller(request))
    if record is None:
        raise not_found(response_id)
    return record


def previous_of(request: Request, body: ResponseCreate) -> tuple[StoredResponse | None, list]:
    """The stored response a request continues and its chain's items; a 400 in OpenAI's
    words for an id that is unknown, expired, deleted or another caller's."""
    if body.previous_response_id is None:
        return None, []
    store = store_of(request)
    previous = store.get(body.previous_response_id, caller(request))
    try:
        if previous is not None:
            return previous, store.history(previous)
    except HistoryGone:
        pass
    raise APIError(
        400,
        f"Previous response with id {body.previous_response_id!r} not found.",
        "previous_response_not_found",
        "previous_response_id",
    )


async def prepared(
    request: Request, body: ResponseCreate, history: list, key: str | None
) -> tuple[ResponsesTurn, Prompt, Engine]:
    worker = worker_of(request)
    engine = await turns.engine_for(worker, body.model, body.keep_alive)
    built = responses_turn(body, history, key, caller(request), worker.settings.default_temperature)
    try:
        return built, await turns.prepare(engine, built.turn), engine
    except APIError as e:
        raise built.located(e) from None


@router.post("/v1/responses")
async def create_response(body: ResponseCreate, request: Request) -> Response:
    serve = partial(_create_response, body, request)
    return await served(
        request, body.model, body.keep_alive, body.stream, serve, responses_stream_error
    )


async def _create_response(body: ResponseCreate, request: Request) -> Response:
    worker, store, owner = worker_of(request), store_of(request), caller(request)
    previous, history = previous_of(request, body)
    key = body.prompt_cache_key or store.session_key(previous)
    built, prompt, engine = await prepared(request, body, history, key)
    # Neither stored nor keyed: nothing outlives the reply, its cache included.
    kept = body.store or key is not None
    job = turns.job(
        worker, engine, built.turn, prompt.tokens, prompt.prefix_len, prompt.grammar, keep=kept
    )
    shell = ResponseObject(
        id=new_response_id(),
        created_at=now(),
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=engine.model_id,
        parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        prompt_cache_key=body.prompt_cache_key,
        reasoning=body.reasoning or ReasoningConfig(),
        safety_identifier=body.safety_identifier,
        store=body.store,
        temperature=built.turn.sampling.temperature,
        text=body.text,
        tool_choice=body.tool_choice,
        tools=built.offered.tools,
        top_p=body.top_p,
        user=body.user,
        metadata=body.metadata or {},
    )

    def keep(response: ResponseObject, session_id: str) -> None:
        record = StoredResponse(
            id=response.id,
            owner=owner,
            created_at=response.created_at,
            session_key=session_id,
            parent=previous.id if previous is not None else None,
            input=[dumped(item) for item in built.items],
            response=response.model_dump(),
        )
        store.put(record)

    # Streamed, the response is stored before the event that ends it goes out (the reply
    # knows its session from the stream's start); whole, before its body goes out.
    reply = ResponseReply(
        shell,
        prompt.tools,
        prompt.split(),
        built.offered.names,
        keep if body.store and body.stream else None,
        kept,
    )
    answer = await respond([job], request, body.stream, reply, worker.settings.shutdown_timeout)
    if body.store and not body.stream and reply.response.status in ("completed", "incomplete"):
        keep(reply.response, answer.headers["x-session-id"])
    if built.offered.left_out:
        answer.headers[TOOLS_NOT_OFFERED] = ", ".join(built.offered.left_out)
    return answer


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: InputTokensCount, request: Request) -> dict:
    """The tokens a create of this body would bring: its prompt as the template renders it."""
    body.model = body.model or worker_of(request).models.default
    _, history = previous_of(request, body)
    _, prompt, _ = await prepared(request, body, history, None)
    return InputTokens(input_tokens=len(prompt.tokens)).model_dump()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict:
    return stored(request, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    if not store_of(request).delete(response_id, caller(request)):
        raise not_found(response_id)
    return DeletedResponse(id=response_id).model_dump()


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, request: Request, query: Annotated[InputItemsQuery, Query()]
) -> dict:
    """The items the response read: its chain's before it, then its own input."""
    record = stored(request, response_id)
    try:
        items = [*store_of(request).before(record), *record.input]
    except HistoryGone:
        items = list(record.input)
    if query.order == "desc":
        items.reverse()
    if query.after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == query.after), None)
        if at is None:
            raise APIError(400, f"after: no item {query.after!r} in this list", param="after")
        items = items[at + 1 :]
    page = items[: query.limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > len(page),
    }
