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
from server.api.structured import CallStream, ToolPlan, may_become_call, parse_calls
from server.engine.jobs import Delta, Finished, TokenLogprob


class ReplyBuilder:
    """`tools`: how the reply may call tools (server/api/structured.py). A stream sends a
    forced reply's calls as they are generated (CallStream); under "auto" it holds back
    text that may become a call and sends the calls once they are whole."""

    def __init__(
        self,
        kind: str,
        model: str,
        tokenizer,
        include_usage: bool,
        echo: str = "",
        tools: ToolPlan | None = None,
    ):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.include_usage = include_usage
        self.tools = tools
        self.call_stream = CallStream() if tools is not None and tools.forced else None
        self.sent = 0  # characters of text streamed so far
        self.held: list[TokenLogprob] = []  # logprobs of text held back
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

    def calls(self) -> tuple[list[dict], str | None] | None:
        """The finished reply's tool calls and remaining content, if it made any."""
        if self.tools is None or self.finish_reason == "length":
            return None
        return parse_calls(self.text, self.tools)

    def response(self, finished: Finished) -> dict:
        usage = _usage(finished)
        if self.kind == "chat":
            message = ChatMessageOut(content=self.text)
            finish = self.finish_reason
            if calls := self.calls():
                message = ChatMessageOut(content=calls[1], tool_calls=calls[0])
                finish = "tool_calls"
            logprobs = self._chat_logprobs(self.logprobs)
            choice = ChatChoice(message=message, logprobs=logprobs, finish_reason=finish)
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

    def chunk(self, delta: Delta) -> dict | None:
        """The stream chunk of this delta, or None while its text is held back."""
        self.add(delta)
        if self.kind != "chat":
            return self._chunk(delta.text, None, delta.logprobs)
        self.held += delta.logprobs
        if self.call_stream is not None:
            return self._call_deltas()
        if self.tools is not None and may_become_call(self.text):
            return None
        return self._release()

    def _call_deltas(self) -> dict | None:
        """The forced calls' new deltas as one chunk (None while a name is incomplete)."""
        deltas = self.call_stream.feed(self.text)
        if not deltas:
            return None
        self.sent, logprobs, self.held = len(self.text), self.held, []
        return self._chunk(ChatDelta(tool_calls=deltas), None, logprobs)

    def _release(self) -> dict:
        text, logprobs = self.text[self.sent :], self.held
        self.sent, self.held = len(self.text), []
        return self._chunk(ChatDelta(content=text), None, logprobs)

    def final_chunks(self, finished: Finished) -> list[dict]:
        chunks, finish = [], self.finish_reason
        if self.call_stream is not None:
            chunks = [c for c in [self._call_deltas()] if c is not None]
            finish = "tool_calls" if self.calls() else finish
        elif self.kind == "chat" and self.sent < len(self.text):  # what was held back
            if calls := self.calls():
                chunks, finish = self._call_chunks(*calls), "tool_calls"
            else:
                chunks = [self._release()]
        last = self._chunk(ChatDelta() if self.kind == "chat" else "", finish, [])
        return [*chunks, *self._usage_chunks(finished, last)]

    def _call_chunks(self, calls: list[dict], content: str | None) -> list[dict]:
        """A whole call per index: its id and name, then its arguments (as OpenAI streams)."""
        chunks = [self._chunk(ChatDelta(content=content), None, [])] if content else []
        for i, call in enumerate(calls):
            head = {**call, "index": i, "function": {**call["function"], "arguments": ""}}
            arguments = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
            chunks += [self._chunk(ChatDelta(tool_calls=[d]), None, []) for d in (head, arguments)]
        self.sent = len(self.text)
        return chunks

    def _usage_chunks(self, finished: Finished, last: dict) -> list[dict]:
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
