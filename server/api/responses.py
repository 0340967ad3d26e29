"""Builds OpenAI response bodies and stream chunks from the worker's events.

One builder per request; `kind` is "chat" (chat.completion[.chunk]) or "text"
(text_completion, the legacy /v1/completions shape). Bodies are the pydantic
models of server/api/protocol.py, dumped to plain dicts for the wire.
"""

from __future__ import annotations

from server.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    TextChoice,
    TextLogprobs,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from server.engine.jobs import Delta, Finished, TokenLogprob


class ReplyBuilder:
    def __init__(self, kind: str, model: str, tokenizer, include_usage: bool, echo: str = ""):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.include_usage = include_usage
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = now()
        self.echo = echo  # /v1/completions with echo: the prompt leads the text
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None

    # ------------------------------------------------------------------ whole reply

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason

    def response(self, finished: Finished) -> dict:
        usage = _usage(finished)
        if self.kind == "chat":
            message = ChatMessageOut(content=self.text)
            logprobs = self._chat_logprobs(self.logprobs)
            choice = ChatChoice(
                message=message, logprobs=logprobs, finish_reason=self.finish_reason
            )
            body = ChatCompletion(**self._envelope(), choices=[choice], usage=usage)
        else:
            text = self.echo + self.text
            logprobs = self._text_logprobs(self.logprobs)
            choice = TextChoice(text=text, logprobs=logprobs, finish_reason=self.finish_reason)
            body = Completion(**self._envelope(), choices=[choice], usage=usage)
        return body.model_dump()

    # ------------------------------------------------------------------ stream

    def first_chunk(self) -> dict:
        if self.kind == "chat":
            return self._chunk(ChatDelta(role="assistant", content=""), None, [])
        return self._chunk(self.echo, None, [])

    def chunk(self, delta: Delta) -> dict:
        self.add(delta)
        content = ChatDelta(content=delta.text) if self.kind == "chat" else delta.text
        return self._chunk(content, None, delta.logprobs)

    def final_chunks(self, finished: Finished) -> list[dict]:
        last = self._chunk(ChatDelta() if self.kind == "chat" else "", self.finish_reason, [])
        if not self.include_usage:
            return [last]
        chunk_type = ChatCompletionChunk if self.kind == "chat" else Completion
        usage_chunk = chunk_type(**self._envelope(), choices=[], usage=_usage(finished))
        return [last, usage_chunk.model_dump()]

    # ------------------------------------------------------------------ parts

    def _envelope(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def _chunk(self, content, finish_reason: str | None, logprobs: list[TokenLogprob]) -> dict:
        if self.kind == "chat":
            lp = self._chat_logprobs(logprobs)
            choice = ChatChunkChoice(delta=content, logprobs=lp, finish_reason=finish_reason)
            chunk = ChatCompletionChunk(**self._envelope(), choices=[choice])
        else:
            lp = self._text_logprobs(logprobs)
            choice = TextChoice(text=content, logprobs=lp, finish_reason=finish_reason)
            chunk = Completion(**self._envelope(), choices=[choice])
        # OpenAI sends `usage: null` on every chunk but the last only with include_usage.
        return chunk.model_dump(exclude=None if self.include_usage else {"usage"})

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _entry(self, token: int, logprob: float) -> TopLogprob:
        text = self._token(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        if not logprobs:
            return None
        content = [
            TokenLogprobEntry(
                **self._entry(lp.token, lp.logprob).model_dump(),
                top_logprobs=[self._entry(*t) for t in lp.top],
            )
            for lp in logprobs
        ]
        return ChatLogprobs(content=content)

    def _text_logprobs(self, logprobs: list[TokenLogprob]) -> TextLogprobs | None:
        if not logprobs:
            return None
        tokens = [self._token(lp.token) for lp in logprobs]
        offsets, at = [], len(self.echo)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return TextLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{self._token(t): v for t, v in lp.top} for lp in logprobs],
            text_offset=offsets,
        )


def _usage(finished: Finished) -> Usage:
    return Usage.of(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
