"""The Responses reply builder (server/api/responses/replies.py) fed a job's events by hand:
every event as OpenAI's types read it, calls held or streamed, a cut reply, a failure,
the keepalive, without a server."""

from __future__ import annotations

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from tool_plans import prompted_plan

from server.api.reasoning import ThinkingSplit
from server.api.responses.protocol import ReasoningConfig, ResponseObject, TextConfig
from server.api.responses.replies import ResponseReply
from server.engine.jobs import Delta, Failed, Finished, Started

EVENTS = TypeAdapter(ResponseStreamEvent)
NAMES = {"get": (None, "get"), "agents.close": ("agents", "close")}


def _reply(tools=None, split: bool = False, parallel: bool = True):
    shell = ResponseObject(
        id="resp_" + "0" * 32,
        created_at=0,
        status="in_progress",
        model="m",
        parallel_tool_calls=parallel,
        reasoning=ReasoningConfig(),
        store=True,
        temperature=0.0,
        text=TextConfig(),
        tool_choice="auto",
        tools=[],
        top_p=1.0,
    )
    stored = []
    thinking = ThinkingSplit("<think>", "</think>") if split else None
    keep = lambda response, session: stored.append((response, session))  # noqa: E731
    return ResponseReply(shell, tools, thinking, NAMES, keep), stored


def _run(reply: ResponseReply, pieces: list[str], finish: str = "stop") -> list[dict]:
    events = reply.opening(Started("s", 0))
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events += reply.on_delta(0, Delta(piece, finish_reason=finish if last else None))
    events += reply.on_finished(0, Finished(10, len(pieces), 4))
    for e in events:
        assert e["event"] == e["data"]["type"]
        EVENTS.validate_python(e["data"])
    assert [e["data"]["sequence_number"] for e in events] == list(range(len(events)))
    return [e["data"] for e in events]


def _kinds(events: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_reasoning_then_text():
    reply, stored = _reply(split=True)
    events = _run(reply, ["<think>", "plan", "</think>", "Hel", "lo"])
    assert _kinds(events) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    final = Response.model_validate(events[-1]["response"])
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == "Hello" and final.usage.output_tokens_details.reasoning_tokens
    assert final.usage.input_tokens_details.cached_tokens == 4
    assert stored == [(reply.response, "s")]


def test_an_auto_call_is_held_then_sent_whole_with_its_namespace():
    reply, _ = _reply(prompted_plan(False, NAMES, parallel=False), parallel=False)
    call = '<tool_call>{"name": "agents.close", "arguments": {"id": 1}}</tool_call>'
    events = _run(reply, [call[:9], call[9:30], call[30:], call])
    kinds = _kinds(events)
    assert kinds[2:] == [
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]  # a second call: parallel_tool_calls false keeps the first only
    item = events[-2]["item"]
    assert (item["namespace"], item["name"], item["arguments"]) == ("agents", "close", '{"id": 1}')


def test_a_forced_call_streams_as_generated():
    reply, _ = _reply(prompted_plan(True, NAMES))
    text = '{"name": "get", "arguments": {"city": "Oslo"}}'
    events = _run(reply, [text[:20], text[20:36], text[36:]])
    kinds = _kinds(events)
    assert kinds.count("function_call_arguments.delta") >= 2
    assert "namespace" not in events[-2]["item"] and events[-2]["item"]["name"] == "get"


def test_text_that_is_not_a_call_goes_out_as_it_comes():
    reply, _ = _reply(prompted_plan(False, NAMES))
    events = reply.opening(Started("s", 0)) + reply.on_delta(0, Delta("<to"))
    assert _kinds([e["data"] for e in events])[-1] == "in_progress"  # held: may be a call
    more = reply.on_delta(0, Delta("day it rains"))
    assert [e["data"].get("delta") for e in more if "delta" in e["data"]] == ["<today it rains"]


def test_a_cut_reply_is_incomplete_and_a_failure_failed():
    reply, _ = _reply()
    events = _run(reply, ["a", "b"], finish="length")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    failing, stored = _reply()
    failing.opening(Started("s", 0))
    [event] = failing.error_event(Failed(503, "the server is shutting down"))
    failed = EVENTS.validate_python(event["data"])
    assert failed.type == "response.failed" and failed.response.error.code == "server_error"
    assert not stored
    [alive] = failing.keepalive()
    assert EVENTS.validate_python(alive["data"]).type == "response.in_progress"
