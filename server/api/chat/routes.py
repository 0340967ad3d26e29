"""POST /v1/chat/completions and /v1/completions: OpenAI's chat and legacy text APIs.

Thin handlers: the request becomes a Turn (server/api/chat/turn.py), the Turn a job
(server/api/turns.py), and the job's events an OpenAI body or stream
(server/api/chat/replies.py, server/api/streaming.py).
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from server.api import turns
from server.api.chat.protocol import ChatCompletionRequest, CompletionRequest
from server.api.chat.replies import ReplyBuilder
from server.api.chat.turn import chat_turn, completion_turn
from server.api.errors import APIError
from server.api.loading import openai_stream_error, served
from server.api.streaming import respond
from server.api.turns import owner_of, worker_of
from server.engine.detokenize import decoder

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, x_session_id: str | None = Header(None)
):
    serve = partial(_chat_completions, body, request, x_session_id)
    return await served(
        request, body.model, body.keep_alive, body.stream, serve, openai_stream_error
    )


async def _chat_completions(
    body: ChatCompletionRequest, request: Request, x_session_id: str | None
) -> Response:
    worker = worker_of(request)
    key = body.prompt_cache_key or x_session_id
    turn = chat_turn(body, key, owner_of(request, body.user), worker.settings.default_temperature)
    job, prompt, engine = await turns.submit(worker, turn)
    builder = ReplyBuilder(
        "chat",
        engine.model_id,
        engine.tokenizer,
        body.include_usage(),
        [(prompt.tokens, "")],
        body.n,
        prompt.tools,
        prompt.split,
    )
    return await respond([job], request, body.stream, builder, worker.settings.shutdown_timeout)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, x_session_id: str | None = Header(None)
):
    serve = partial(_completions, body, request, x_session_id)
    return await served(
        request, body.model, body.keep_alive, body.stream, serve, openai_stream_error
    )


async def _completions(
    body: CompletionRequest, request: Request, x_session_id: str | None
) -> Response:
    worker = worker_of(request)
    engine = await turns.engine_for(worker, body.model, body.keep_alive)
    prompts = await _prompts(engine, body)
    key = body.prompt_cache_key or x_session_id
    if key is not None and len(prompts) > 1:
        raise APIError(
            400,
            "a session key names one conversation; this request has several prompts",
            param="prompt",
        )
    turn = completion_turn(
        body, key, owner_of(request, body.user), worker.settings.default_temperature
    )
    jobs = []
    try:
        for tokens, _ in prompts:  # a batch's prompts: each its own throwaway session
            jobs.append(turns.job(worker, engine, turn, tokens, keep=len(prompts) == 1))
    except APIError:
        for job in jobs:
            job.cancel("another prompt of its request was refused")
        raise
    echoes = [(tokens, text if body.echo else "") for tokens, text in prompts]
    builder = ReplyBuilder(
        "text", engine.model_id, engine.tokenizer, body.include_usage(), echoes, body.n
    )
    return await respond(jobs, request, body.stream, builder, worker.settings.shutdown_timeout)


async def _prompts(engine, body: CompletionRequest) -> list[tuple[list[int], str]]:
    """Each prompt's tokens and text (an echo's: token ids decoded)."""
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
