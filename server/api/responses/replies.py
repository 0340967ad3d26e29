"""A job's events as a Response object and as the Responses API's typed stream events.

One `ResponseReply` per request (server/api/streaming.py's `Reply`). The reply's text is
split into its reasoning (a `reasoning` item, first) and its content: a `message` item,
or `function_call` items when it calls tools. As OpenAI streams them: per item
`response.output_item.added`, for a message or reasoning `response.content_part.added`,
its deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`), their `.done`, `response.content_part.done`,
`response.output_item.done`; around them `response.created`, `response.in_progress`
and `response.completed` (`response.incomplete` when max_output_tokens cut it,
`response.failed` when it failed), every event with its `event:` line and
`sequence_number`. The content goes through a ToolCallReader (server/api/tool_calls.py):
a forced call streams as it is generated, an "auto" one goes out once whole.

A streamed Response is finished (and handed to `on_done` with its session, which stores
it) before the event that says so is sent: a client that continues the chain at once
finds it.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import Response

from server.api.common import now
from server.api.errors import error_response
from server.api.reasoning import REASONING, ThinkingSplit
from server.api.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    FunctionCallOut,
    IncompleteDetails,
    ItemEvent,
    MessageOut,
    OutputTextOut,
    PartEvent,
    ReasoningOut,
    ReasoningTextOut,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from server.api.responses.turn import item_id
from server.api.structured import ToolPlan
from server.api.tool_calls import ToolCallReader
from server.engine.jobs import Delta, Failed, Finished, Started

Event = dict  # sse-starlette's: {"event": type, "data": payload}


class ResponseReply:
    """`shell`: the Response as it starts (its echo of the request, status in_progress);
    `names`: each offered function's (namespace, name) by the name the model calls."""

    def __init__(
        self,
        shell: ResponseObject,
        tools: ToolPlan | None,
        split: ThinkingSplit | None,
        names: dict[str, tuple[str | None, str]],
        on_done: Callable[[ResponseObject, str], None] | None = None,
        kept: bool = True,
    ):
        self.response, self.tools, self.split = shell, tools, split
        self.names, self.on_done, self.kept = names, on_done, kept
        self.sequence = 0
        self.message: MessageOut | None = None  # the item open now, if any
        self.reasoning: ReasoningOut | None = None
        self.call: FunctionCallOut | None = None
        self.reader = ToolCallReader(tools) if tools is not None else None
        self.cut = False  # max_output_tokens ended it
        self.session_id = ""  # the session serving it (a stream's start tells)

    # ------------------------------------------------------------------ streaming.Reply

    def opening(self, started: Started) -> list[Event]:
        self.session_id = started.session_id
        return [self._state("response.created"), self._state("response.in_progress")]

    def keepalive(self) -> list[Event]:
        """During a long prefill: a data event resets clients' idle timers (Codex's)."""
        return [self._state("response.in_progress")]

    def on_delta(self, job: int, delta: Delta) -> list[Event]:
        final = delta.finish_reason is not None
        self.cut = self.cut or delta.finish_reason == "length"
        pieces = self.split.feed(delta.text, final) if self.split else [("content", delta.text)]
        out: list[Event] = []
        content = ""
        for kind, piece in pieces:
            if kind == REASONING:
                out += self._reason(piece)
            else:
                out += self._close_reasoning()
                content += piece
        if self.reader is None:
            events = [("text", content)] if content else []
        else:
            events = self.reader.feed(content, final, self.cut)
        for event in events:
            out += self._on_event(event)
        if final:
            out += self._close_reasoning() + self._close_message() + self._close_call()
        return out

    def on_finished(self, job: int, finished: Finished) -> list[Event]:
        r = self.response
        r.status = "incomplete" if self.cut else "completed"
        if self.cut:
            r.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        r.completed_at = now()
        reasoning = self.split.reasoning_deltas if self.split else 0
        r.usage = ResponseUsage.of(
            finished.prompt_tokens,
            finished.completion_tokens,
            finished.cached_tokens,
            reasoning,
            self.kept,
        )
        if self.on_done is not None:
            self.on_done(r, self.session_id)
        return [self._state(f"response.{r.status}")]

    def closing(self) -> list[Event]:
        return []  # the Responses API sends no [DONE]

    def body(self) -> dict:
        return self.response.model_dump()

    def error_event(self, failed: Failed) -> list[Event]:
        r = self.response
        r.status = "failed"
        r.error = ResponseError(code=failed.code or "server_error", message=failed.message)
        return [self._state("response.failed")]

    def error_response(self, failed: Failed) -> Response:
        return error_response(failed.status, failed.message, failed.code, failed.param)

    # ------------------------------------------------------------------ reasoning

    def _reason(self, piece: str) -> list[Event]:
        out = []
        if self.reasoning is None:
            self.reasoning = ReasoningOut(
                id=item_id("reasoning"), content=[ReasoningTextOut(text="")], status="in_progress"
            )
            out += self._open(self.reasoning)
            out.append(
                self._part_event(
                    PartEvent,
                    "response.content_part.added",
                    self.reasoning,
                    part=ReasoningTextOut(text=""),
                )
            )
        self.reasoning.content[0].text += piece
        out.append(
            self._part_event(
                TextDeltaEvent, "response.reasoning_text.delta", self.reasoning, delta=piece
            )
        )
        return out

    def _close_reasoning(self) -> list[Event]:
        item, self.reasoning = self.reasoning, None
        if item is None:
            return []
        part = item.content[0]
        return [
            self._part_event(TextDoneEvent, "response.reasoning_text.done", item, text=part.text),
            self._part_event(PartEvent, "response.content_part.done", item, part=part),
            *self._close(item),
        ]

    # ------------------------------------------------------------------ content

    def _on_event(self, event: tuple) -> list[Event]:
        """One of the reader's events as items: message text, or a call's item."""
        if event[0] == "text":
            return self._message_text(event[1])
        if event[0] == "call":
            _, _, call_id, name = event
            self.call = self._function_call(call_id, name)
            return self._close_message() + self._open(self.call)
        if event[0] == "arguments":
            self.call.arguments += event[2]
            return [self._arguments_delta(self.call, event[2])] if event[2] else []
        return self._close_call()

    def _message_text(self, piece: str) -> list[Event]:
        if not piece:
            return []
        out = []
        if self.message is None:
            self.message = MessageOut(
                id=item_id("message"), content=[OutputTextOut(text="")], status="in_progress"
            )
            out += self._open(self.message)
            out.append(
                self._part_event(
                    PartEvent,
                    "response.content_part.added",
                    self.message,
                    part=OutputTextOut(text=""),
                )
            )
        self.message.content[0].text += piece
        out.append(
            self._part_event(
                TextDeltaEvent, "response.output_text.delta", self.message, delta=piece, logprobs=[]
            )
        )
        return out

    def _close_message(self) -> list[Event]:
        item, self.message = self.message, None
        if item is None:
            return []
        part = item.content[0]
        return [
            self._part_event(
                TextDoneEvent, "response.output_text.done", item, text=part.text, logprobs=[]
            ),
            self._part_event(PartEvent, "response.content_part.done", item, part=part),
            *self._close(item),
        ]

    # ------------------------------------------------------------------ calls

    def _function_call(self, call_id: str, offered: str) -> FunctionCallOut:
        """An item for one call of the function offered as `offered`."""
        namespace, name = self.names.get(offered, (None, offered))
        return FunctionCallOut(
            id=item_id("function_call"),
            call_id=call_id,
            name=name,
            namespace=namespace,
            arguments="",
            status="in_progress",
        )

    def _close_call(self) -> list[Event]:
        item, self.call = self.call, None
        if item is None:
            return []
        done = ArgumentsDoneEvent(
            type="response.function_call_arguments.done",
            sequence_number=self._next(),
            item_id=item.id,
            output_index=self._index(item),
            name=item.name,
            arguments=item.arguments,
        )
        return [_sse(done), *self._close(item)]

    def _arguments_delta(self, item: FunctionCallOut, piece: str) -> Event:
        return _sse(
            ArgumentsDeltaEvent(
                type="response.function_call_arguments.delta",
                sequence_number=self._next(),
                item_id=item.id,
                output_index=self._index(item),
                delta=piece,
            )
        )

    # ------------------------------------------------------------------ events

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def _index(self, item) -> int:
        return next(i for i, it in enumerate(self.response.output) if it is item)

    def _state(self, kind: str) -> Event:
        return _sse(ResponseEvent(type=kind, sequence_number=self._next(), response=self.response))

    def _open(self, item) -> list[Event]:
        self.response.output.append(item)
        event = ItemEvent(
            type="response.output_item.added",
            sequence_number=self._next(),
            output_index=self._index(item),
            item=item,
        )
        return [_sse(event)]

    def _close(self, item) -> list[Event]:
        item.status = "incomplete" if self.cut else "completed"
        event = ItemEvent(
            type="response.output_item.done",
            sequence_number=self._next(),
            output_index=self._index(item),
            item=item,
        )
        return [_sse(event)]

    def _part_event(self, event: type[Event], kind: str, item, **fields) -> Event:
        """An event about the item's one content part (content_part.*, *_text.*)."""
        return _sse(
            event(
                type=kind,
                sequence_number=self._next(),
                item_id=item.id,
                output_index=self._index(item),
                content_index=0,
                **fields,
            )
        )


def _sse(event) -> Event:
    """One SSE event, its `event:` line naming its type (the payload is dumped now: the
    objects it holds go on changing)."""
    return {"event": event.type, "data": event.model_dump()}
