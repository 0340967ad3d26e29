"""Builds OpenAI response bodies and stream chunks from the worker's events.

One builder per request; `kind` is "chat" (chat.completion[.chunk]) or "text"
(text_completion, the legacy /v1/completions shape). A request has one or more
choices: n of them per job (`Delta.choice`), and one job per prompt of a batched
completion (`job`), numbered as OpenAI does, job by job. Bodies are the pydantic
models of server/api/chat/protocol.py, dumped to plain dicts for the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastapi.responses import Response

from server.api.chat.protocol import (
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
)
from server.api.common import error_body, new_id, now
from server.api.errors import error_response
from server.api.reasoning import CONTENT, REASONING, ThinkingSplit
from server.api.structured import ToolPlan
from server.api.tool_calls import ToolCallReader
from server.engine.detokenize import decoder, piece
from server.engine.jobs import Delta, Failed, Finished, Started, TokenLogprob


@dataclass
class Token:
    """A reply token's logprobs, with its text as it reads after the token before it."""

    text: str
    offset: int  # where the text starts in the choice's text (an echo's included)
    before: int | None  # the token before it (its alternatives read after that one too)
    logprob: TokenLogprob | None  # None: an echoed prompt's first token


@dataclass
class Choice:
    """One choice as it grows: its text, tokens, what a stream has sent of it."""

    index: int
    last: int | None  # the newest token (at first its prompt's last)
    echo: str = ""  # /v1/completions with echo: the prompt leads the text
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    echoed: list[Token] = field(default_factory=list)  # the echoed prompt's, with logprobs
    finish_reason: str | None = None
    sent: int = 0  # characters of text streamed so far
    held: list[Token] = field(default_factory=list)  # tokens of text held back
    reader: ToolCallReader | None = None  # its tool calls, in the model's format
    events: list[tuple] = field(default_factory=list)  # what the latest delta added
    split: ThinkingSplit | None = None  # a thinking model's: reasoning apart from the text
    reasoning: str = ""
    new_reasoning: str = ""  # what the latest delta added to it


class ReplyBuilder:
    """`tools`: how the reply may call tools (server/api/structured.py); each choice's
    content goes through a ToolCallReader (server/api/tool_calls.py), whose events a
    stream sends as content and `tool_calls` deltas.

    `prompts`: per job, its prompt's tokens (the reply's first token reads after the
    last; an echo's logprobs are theirs) and the text echoed before the reply."""

    def __init__(
        self,
        kind: str,
        model: str,
        tokenizer,
        include_usage: bool,
        prompts: Sequence[tuple[Sequence[int], str]] = (((), ""),),
        n: int = 1,
        tools: ToolPlan | None = None,
        thinking: Callable[[], ThinkingSplit | None] | None = None,
    ):
        self.kind, self.model, self.n = kind, model, n
        self.decode = decoder(tokenizer)
        self.include_usage = include_usage
        self.tools = tools
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = now()
        self.prompts = [list(tokens) for tokens, _ in prompts]
        self.choices = [
            Choice(
                j * n + i,
                tokens[-1] if tokens else None,
                echo,
                reader=ToolCallReader(tools) if tools is not None else None,
                split=thinking() if thinking else None,
            )
            for j, (tokens, echo) in enumerate(prompts)
            for i in range(n)
        ]
        self.usage: list[Finished] = []

    # ------------------------------------------------------------------ streaming.Reply

    def opening(self, started: Started) -> list[dict]:
        return [{"data": c} for c in self.first_chunks()]

    def on_delta(self, job: int, delta: Delta) -> list[dict]:
        return [{"data": c} for c in self.chunks(delta, job)]

    def on_finished(self, job: int, finished: Finished) -> list[dict]:
        self.finish(finished)
        return []

    def closing(self) -> list[dict]:
        return [*({"data": c} for c in self.usage_chunks()), {"data": "[DONE]"}]

    def body(self) -> dict:
        return self.response()

    def error_event(self, failed: Failed) -> list[dict]:
        return [{"data": error_body(failed.message, "server_error", failed.code)}]

    def error_response(self, failed: Failed) -> Response:
        return error_response(failed.status, failed.message, failed.code, failed.param)

    # ------------------------------------------------------------------ whole reply

    def add(self, delta: Delta, job: int = 0) -> tuple[Choice, list[Token]]:
        """Take a delta of job `job`: its choice, and the tokens it added."""
        c = self.choices[job * self.n + delta.choice]
        if delta.prompt_logprobs is not None and not c.echoed:  # every choice echoes them
            echoed = self._echoed(self.prompts[job], delta.prompt_logprobs)
            for other in self.choices[job * self.n : (job + 1) * self.n]:
                other.echoed = echoed
        new = []
        for lp in delta.logprobs:
            text = piece(self.decode, c.last, lp.token)
            at = c.tokens[-1].offset + len(c.tokens[-1].text) if c.tokens else len(c.echo)
            c.tokens.append(Token(text, at, c.last, lp))
            new.append(c.tokens[-1])
            c.last = lp.token
        text, final = delta.text, delta.finish_reason is not None
        if c.split is not None:
            pieces = c.split.feed(text, final=final)
            c.new_reasoning = "".join(t for kind, t in pieces if kind == REASONING)
            c.reasoning += c.new_reasoning
            text = "".join(t for kind, t in pieces if kind == CONTENT)
        if c.reader is not None:
            c.events = c.reader.feed(text, final, cut=delta.finish_reason == "length")
            text = "".join(e[1] for e in c.events if e[0] == "text")
        c.text += text
        c.finish_reason = delta.finish_reason or c.finish_reason
        return c, new

    def _echoed(self, prompt: list[int], logprobs: list[TokenLogprob | None]) -> list[Token]:
        out, at, before = [], 0, None
        for token, lp in zip(prompt, logprobs, strict=True):
            text = piece(self.decode, before, token)
            out.append(Token(text, at, before, lp))
            at, before = at + len(text), token
        return out

    def finish(self, finished: Finished) -> None:
        """A job's usage (the request's is their sum)."""
        self.usage.append(finished)

    def calls(self, c: Choice) -> tuple[list[dict], str | None] | None:
        """The finished choice's tool calls and the content beside them, if it made any. A
        forced call cut by max_tokens comes back as what it holds (arguments unfinished)."""
        return None if c.reader is None else c.reader.result()

    def response(self) -> dict:
        usage = self._usage()
        if self.kind == "chat":
            choices = [self._chat_choice(c) for c in self.choices]
            return ChatCompletion(**self._envelope(), choices=choices, usage=usage).model_dump()
        choices = [
            TextChoice(
                index=c.index,
                text=c.echo + c.text,
                logprobs=self._text_logprobs(c.echoed + c.tokens),
                finish_reason=c.finish_reason,
            )
            for c in self.choices
        ]
        return Completion(**self._envelope(), choices=choices, usage=usage).model_dump()

    def _chat_choice(self, c: Choice) -> ChatChoice:
        message, finish = ChatMessageOut(content=c.text), c.finish_reason
        reasoning = c.reasoning or None
        if calls := self.calls(c):
            message = ChatMessageOut(content=calls[1], tool_calls=calls[0])
            finish = "tool_calls" if finish != "length" else finish
        elif self.tools is not None and self.tools.forced:  # cut before a call's name was whole
            message = ChatMessageOut(content=None)
        message.reasoning_content = reasoning
        logprobs = self._chat_logprobs(c.tokens)
        return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish)

    # ------------------------------------------------------------------ stream

    def first_chunks(self) -> list[dict]:
        """Each choice's opening chunk: the assistant's role (chat) or the echoed prompt."""
        if self.kind == "chat":
            opening = ChatDelta(role="assistant", content="")
            return [self._chunk(c, opening, None, []) for c in self.choices]
        return [self._chunk(c, c.echo, None, []) for c in self.choices]

    def chunks(self, delta: Delta, job: int = 0) -> list[dict]:
        """The stream chunks of this delta (none while its text is held back), and the
        choice's last one when it finishes."""
        echoing = delta.prompt_logprobs is not None
        c, new = self.add(delta, job)
        if self.kind != "chat":
            out = [self._chunk(c, "", None, c.echoed)] if echoing else []  # the echo's tokens
            if delta.text or new:
                out.append(self._chunk(c, delta.text, None, new))
            if c.finish_reason:
                out.append(self._chunk(c, "", c.finish_reason, []))
            return out
        c.held += new
        out = []
        if c.new_reasoning:  # reasoning streams apart from the content, never held
            out.append(self._chunk(c, ChatDelta(reasoning_content=c.new_reasoning), None, []))
            c.new_reasoning = ""
        if c.reader is not None:
            out += self._reader_chunks(c)
        elif c.sent < len(c.text) or c.held:
            out.append(self._release(c))
        if c.finish_reason:
            finish = c.finish_reason
            if finish != "length" and self.calls(c) is not None:
                finish = "tool_calls"
            out.append(self._chunk(c, ChatDelta(), finish, []))
        return out

    def _reader_chunks(self, c: Choice) -> list[dict]:
        """The reader's new events as chunks: content, and per call its id and name, then
        its arguments (one entry per index in a chunk, as OpenAI streams them). Logprobs
        ride on the first chunk that goes out."""
        out = []
        for event in c.events:
            if event[0] == "text":
                delta = ChatDelta(content=event[1])
            elif event[0] == "call":
                _, index, call_id, name = event
                function = {"name": name, "arguments": ""}
                delta = ChatDelta(tool_calls=[{"index": index, "id": call_id, "type": "function",
                                               "function": function}])  # fmt: skip
            elif event[0] == "arguments":
                entry = {"index": event[1], "function": {"arguments": event[2]}}
                delta = ChatDelta(tool_calls=[entry])
            else:
                continue
            out.append(self._chunk(c, delta, None, c.held))
            c.held = []
        c.events, c.sent = [], len(c.text)
        return out

    def _release(self, c: Choice) -> dict:
        text, held = c.text[c.sent :], c.held
        c.sent, c.held = len(c.text), []
        return self._chunk(c, ChatDelta(content=text), None, held)

    def usage_chunks(self) -> list[dict]:
        """After every choice ended: the usage chunk, when the client asked for it."""
        if not self.include_usage:
            return []
        chunk_type = ChatCompletionChunk if self.kind == "chat" else Completion
        return [chunk_type(**self._envelope(), choices=[], usage=self._usage()).model_dump()]

    # ------------------------------------------------------------------ parts

    def _envelope(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def _usage(self) -> Usage:
        prompt = sum(f.prompt_tokens for f in self.usage)
        completion = sum(f.completion_tokens for f in self.usage)
        splits = [c.split for c in self.choices if c.split is not None]
        reasoning = sum(s.reasoning_deltas for s in splits) if splits else None
        drafts = (
            sum(f.accepted_draft_tokens for f in self.usage),
            sum(f.rejected_draft_tokens for f in self.usage),
        )
        cached = sum(f.cached_tokens for f in self.usage)
        return Usage.of(prompt, completion, cached, reasoning, drafts)

    def _chunk(self, c: Choice, content, finish_reason: str | None, tokens: list[Token]) -> dict:
        if self.kind == "chat":
            choice = ChatChunkChoice(
                index=c.index,
                delta=content,
                logprobs=self._chat_logprobs(tokens),
                finish_reason=finish_reason,
            )
            chunk = ChatCompletionChunk(**self._envelope(), choices=[choice])
        else:
            choice = TextChoice(
                index=c.index,
                text=content,
                logprobs=self._text_logprobs(tokens),
                finish_reason=finish_reason,
            )
            chunk = Completion(**self._envelope(), choices=[choice])
        # OpenAI sends `usage: null` on every chunk but the last only with include_usage.
        return chunk.model_dump(exclude=None if self.include_usage else {"usage"})

    def _alternative(self, before: int | None, token: int, logprob: float) -> TopLogprob:
        text = piece(self.decode, before, token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def _chat_logprobs(self, tokens: list[Token]) -> ChatLogprobs | None:
        if not tokens:
            return None
        content = [
            TokenLogprobEntry(
                token=t.text,
                logprob=t.logprob.logprob,
                bytes=list(t.text.encode()),
                top_logprobs=[self._alternative(t.before, *top) for top in t.logprob.top],
            )
            for t in tokens
        ]
        return ChatLogprobs(content=content)

    def _text_logprobs(self, tokens: list[Token]) -> TextLogprobs | None:
        """The legacy logprobs object; an echoed prompt's tokens lead (the first one's
        logprob null); every offset indexes the choice's text, echo included."""
        if not tokens:
            return None
        return TextLogprobs(
            tokens=[t.text for t in tokens],
            token_logprobs=[t.logprob.logprob if t.logprob else None for t in tokens],
            top_logprobs=[
                {piece(self.decode, t.before, k): v for k, v in t.logprob.top}
                if t.logprob
                else None
                for t in tokens
            ],
            text_offset=[t.offset for t in tokens],
        )
