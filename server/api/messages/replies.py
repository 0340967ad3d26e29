"""Anthropic Message bodies and stream events from a job's events (streaming.Reply).

The reply's text is taken in as chat completions take it (server/api/chat/replies.py's
ReplyBuilder, one choice: the reasoning split off, stop strings already cut, tool calls
read in the model's format as they stream); this module makes Anthropic's blocks of it:
a `thinking` block, `text` blocks, `tool_use` blocks. A stream sends each block as
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`),
`content_block_stop`; the message opens with `message_start` and a `ping` (before the
prefill, so a long prompt's wait is pings) and ends with `message_delta` (stop reason,
usage) and `message_stop`. Under "auto" tools a call goes out whole once it is; a forced
call (`any`, `tool`) streams its input as it is generated.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

from fastapi.responses import Response

from server.api.chat.replies import Choice, ReplyBuilder
from server.api.errors import anthropic_body, error_response
from server.api.messages.protocol import (
    BlockOut,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    ModelInfo,
    ModelList,
    OutputTokensDetails,
    PingEvent,
    StopReason,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
    Usage,
    sse,
)
from server.api.reasoning import ThinkingSplit
from server.api.structured import ToolPlan
from server.engine.jobs import Delta, Failed, Finished, Started

TOO_LONG = "context_length_exceeded"  # the engine's code for a prompt over the limit


def too_long(message: str, tokens: int, limit: int) -> str:
    """A prompt over the limit, said as Anthropic says it: Claude Code reads "prompt is too
    long: N tokens > M" (and then tells the user to /compact)."""
    return f"prompt is too long: {tokens} tokens > {limit} maximum ({message})"


def anthropic_id(prefix: str) -> str:
    """Ids as Anthropic spells them: msg_..., toolu_..."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class MessagesReply:
    """One request's reply. `prefill_only` (max_tokens 0): the prompt was cached and the
    one token the engine draws is not the reply (no content, `max_tokens`)."""

    def __init__(
        self,
        model: str,
        tokenizer,
        prompt_tokens: list[int],
        tools: ToolPlan | None = None,
        thinking: Callable[[], ThinkingSplit | None] | None = None,
        prefill_only: bool = False,
        new_token_limit: int | None = None,
        parallel: bool = True,
        on_done: Callable[[str, list[BlockOut]], None] | None = None,
    ):
        self.chat = ReplyBuilder(  # the reply taken in as chat completions take it
            "chat", model, tokenizer, False, [(prompt_tokens, "")], 1, tools, thinking
        )
        self.model, self.id = model, anthropic_id("msg")
        self.prompt_len, self.cached = len(prompt_tokens), 0
        self.prefill_only, self.parallel = prefill_only, parallel
        self.new_token_limit = new_token_limit  # prompt tokens the worker prefills at most
        self.stop_sequence: str | None = None
        self.finished: Finished | None = None
        self.failed = False
        self.on_done = on_done  # given the id and content once the reply is whole (threads)
        self.index = -1  # the stream's open block (-1: none yet)
        self.open: str | None = None  # its type; None once closed

    @property
    def choice(self) -> Choice:
        return self.chat.choices[0]

    # ------------------------------------------------------------------ streaming.Reply

    def opening(self, started: Started) -> list[dict]:
        self.cached = started.cached_tokens
        message = Message(id=self.id, content=[], model=self.model, usage=self.usage())
        return [sse(MessageStartEvent(message=message)), sse(PingEvent())]

    def keepalive(self) -> list[dict]:
        return [sse(PingEvent())]

    def on_delta(self, job: int, delta: Delta) -> list[dict]:
        if self.prefill_only:
            return []
        self.stop_sequence = delta.stop_sequence or self.stop_sequence
        c, _ = self.chat.add(delta)
        events = []
        if c.new_reasoning:
            events += self._extend("thinking", ThinkingDelta(thinking=c.new_reasoning))
        if c.reader is not None:
            for event in c.events:
                if event[0] == "text":
                    events += self._extend("text", TextDelta(text=event[1]))
                elif event[0] == "call":
                    events += self._start(self._tool_use(event[2], event[3]))
                elif event[0] == "arguments" and event[2]:
                    events += self._delta(InputJSONDelta(partial_json=event[2]))
            c.events, c.sent = [], len(c.text)
        elif c.sent < len(c.text):
            events += self._extend("text", TextDelta(text=c.text[c.sent :]))
            c.sent = len(c.text)
        if c.finish_reason:
            events += self._stop()
        return events

    def on_finished(self, job: int, finished: Finished) -> list[dict]:
        self.finished = finished
        if self.on_done is not None:  # before the stream's end: a client continues at once
            self.on_done(self.id, self.content())
        return []

    def closing(self) -> list[dict]:
        if self.failed:  # the error event ended the stream
            return []
        end = MessageDelta(stop_reason=self.stop_reason(), stop_sequence=self._matched())
        return [
            *self._stop(),
            sse(MessageDeltaEvent(delta=end, usage=self.usage())),
            sse(MessageStopEvent()),
        ]

    def body(self) -> dict:
        return Message(
            id=self.id,
            content=self.content(),
            model=self.model,
            stop_reason=self.stop_reason(),
            stop_sequence=self._matched(),
            usage=self.usage(),
        ).model_dump()

    def error_event(self, failed: Failed) -> list[dict]:
        self.failed = True
        return [{"event": "error", "data": anthropic_body(failed.status, self._said(failed))}]

    def error_response(self, failed: Failed) -> Response:
        return error_response(failed.status, self._said(failed), anthropic=True)

    def _said(self, failed: Failed) -> str:
        if failed.code == TOO_LONG and self.new_token_limit is not None:
            return too_long(failed.message, self.prompt_len, self.new_token_limit)
        return failed.message

    # ------------------------------------------------------------------ the message

    def content(self) -> list[BlockOut]:
        if self.prefill_only:
            return []
        c = self.choice
        blocks: list[BlockOut] = [ThinkingOut(thinking=c.reasoning)] if c.reasoning else []
        if calls := self.calls():
            if calls[1]:
                blocks.append(TextOut(text=calls[1]))
            for call in calls[0]:
                function = call["function"]
                block = self._tool_use(call["id"], function["name"])
                block.input = _input(function["arguments"])
                blocks.append(block)
        elif c.text and not (self.chat.tools and self.chat.tools.forced):
            blocks.append(TextOut(text=c.text))  # (a forced call cut before its name: none)
        return blocks

    def calls(self) -> tuple[list[dict], str | None] | None:
        """The reply's calls (OpenAI's shape) and its other text (with
        `disable_parallel_tool_use` the reader keeps an auto reply's first call only)."""
        return self.chat.calls(self.choice)

    def stop_reason(self) -> StopReason:
        c = self.choice
        if self.prefill_only or c.finish_reason == "length":
            return "max_tokens"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if self.calls() else "end_turn"

    def usage(self) -> Usage:
        """The prompt split as Anthropic splits it: prefilled now (`input_tokens`) and read
        from the cache (`cache_read_input_tokens`); protocol.Usage says why no writes."""
        f = self.finished
        prompt, cached = (f.prompt_tokens, f.cached_tokens) if f else (self.prompt_len, self.cached)
        output = f.completion_tokens if f and not self.prefill_only else 0
        split = self.choice.split
        details = None
        if split is not None and not self.prefill_only:
            details = OutputTokensDetails(thinking_tokens=split.reasoning_deltas)
        return Usage(
            input_tokens=prompt - cached,
            output_tokens=output,
            cache_read_input_tokens=cached,
            output_tokens_details=details,
        )

    def _matched(self) -> str | None:
        return self.stop_sequence if self.stop_reason() == "stop_sequence" else None

    def _tool_use(self, call_id: str, name: str) -> ToolUseOut:
        """A call's block; its id follows the call's, so the stream and the body agree (a
        model's own id, Kimi's `functions.NAME:0`, in the letters Anthropic's ids use)."""
        tail = re.sub(r"[^A-Za-z0-9_-]", "_", call_id.removeprefix("call_"))
        return ToolUseOut(id=f"toolu_{tail}", name=name, input={})

    # ------------------------------------------------------------------ stream blocks

    def _extend(self, kind: str, delta: TextDelta | ThinkingDelta) -> list[dict]:
        """`delta` into the open block of its kind, opening one first if another is open."""
        opened = []
        if self.open != kind:
            block = TextOut(text="") if kind == "text" else ThinkingOut(thinking="")
            opened = self._start(block)
        return [*opened, *self._delta(delta)]

    def _start(self, block: BlockOut) -> list[dict]:
        events = self._stop()
        self.index += 1
        self.open = block.type
        return [*events, sse(ContentBlockStartEvent(index=self.index, content_block=block))]

    def _delta(self, delta: TextDelta | ThinkingDelta | InputJSONDelta) -> list[dict]:
        return [sse(ContentBlockDeltaEvent(index=self.index, delta=delta))]

    def _stop(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [sse(ContentBlockStopEvent(index=self.index))]


def _input(arguments: str) -> dict:
    """A call's input as an object; a call cut by max_tokens has what parses: nothing."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def model_list(names: list[str]) -> dict:
    """GET /v1/models for Anthropic's clients (they send `anthropic-version`)."""
    data = [model_info(name) for name in names]
    return ModelList(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None
    ).model_dump()


def model_info(name: str) -> ModelInfo:
    return ModelInfo(id=name, display_name=name, created_at="1970-01-01T00:00:00Z")
