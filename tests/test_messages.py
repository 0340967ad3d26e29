"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the anthropic
SDK as its docs use it, Claude Code's request shape replayed with stand-in texts, bad input
as Anthropic's errors that leave the conversation as it was.

The anthropic package's own types are the oracle: every body and event is validated
against them. Without a server: a request's blocks as chat-template messages, and the
reply builder's events. The model is 135M parameters: what is asserted is the shape,
not the quality of the answers.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from jinja2 import TemplateError
from pydantic import TypeAdapter
from server_harness import MODEL
from tool_plans import PROMPTED, prompted_plan

from server.api.errors import APIError
from server.api.messages.protocol import CountTokensRequest, MessagesRequest
from server.api.messages.replies import MessagesReply
from server.api.messages.routes import prepared
from server.api.messages.turn import folded, messages_turn
from server.api.reasoning import ThinkingSplit
from server.engine.jobs import Delta, Failed, Finished, Started

pytestmark = pytest.mark.slow(seconds=60)

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "the city's name"}},
        "required": ["city"],
    },
}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK no longer types sampling fields: extra_body


def _client(api) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.base_url, api_key="unused", max_retries=0)


def _unique(text: str) -> str:
    """A system prompt no other conversation has (nothing of it cached yet)."""
    return f"{text} (conversation {uuid.uuid4().hex[:8]})"


# ---------------------------------------------------------------------- without a server


def _turn(body: dict):
    return messages_turn(MessagesRequest.model_validate({"model": "m", **body}), "m")


def test_blocks_become_chat_template_messages():
    made = _turn(
        {
            "max_tokens": 5,
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [
                {"role": "system", "content": "Leading entries join the system prompt."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "system", "content": "A later one stays in place."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "plan", "signature": ""},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Looking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "Sunny",
                            "is_error": True,
                        },
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "notes"},
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [
                WEATHER,
                {"type": "web_search_20250305", "name": "web_search"},
                {"type": "bash_20250124", "name": "bash"},
            ],
        }
    )
    assert made.turn.messages == [
        {"role": "system", "content": "Be brief.\n\nLeading entries join the system prompt."},
        {"role": "user", "content": "a\n\nb"},
        {"role": "system", "content": "A later one stays in place."},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
            "reasoning_content": "plan",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: Sunny"},
        {"role": "user", "content": "notes\n\nThanks"},
    ]
    assert [f.name for f in made.turn.functions] == ["get_weather"]
    assert made.not_offered == ["web_search_20250305:web_search", "bash_20250124:bash"]
    assert made.turn.clamp_max_tokens and made.turn.tool_choice == "auto"


def test_switches_reach_the_turn():
    body = {"max_tokens": 0, "messages": PARIS, "tools": [WEATHER]}
    made = _turn({**body, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert (made.turn.tool_choice, made.turn.parallel_tool_calls) == ("required", False)
    assert made.prefill_only and made.turn.max_tokens == 1  # 0: prefill, cache, no reply
    assert (
        _turn({**body, "tool_choice": {"type": "tool", "name": "get_weather"}}).turn.tool_choice
        == "get_weather"
    )
    assert _turn({**body, "tool_choice": {"type": "none"}}).turn.tool_choice == "none"
    assert [
        _turn({**body, "thinking": {"type": t}}).turn.thinking for t in ("disabled", "adaptive")
    ] == [False, None]
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    answer = _turn(
        {
            **body,
            "output_config": {
                "effort": "high",
                "format": {"type": "json_schema", "schema": schema},
            },
        }
    )
    assert answer.turn.answer == schema
    sampled = _turn({**body, "top_k": 5, "top_p": 0.5, "stop_sequences": ["END"]}).turn.sampling
    assert (sampled.top_k, sampled.top_p, sampled.stop, sampled.temperature) == (
        5,
        0.5,
        ["END"],
        1.0,
    )
    with pytest.raises(APIError, match="Anthropic's own tools"):
        _turn(
            {
                **body,
                "tools": [{"type": "bash_20250124", "name": "bash"}],
                "tool_choice": {"type": "tool", "name": "bash"},
            }
        )
    typed_only = {**body, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    assert _turn({**typed_only, "tool_choice": {"type": "auto"}}).turn.functions == []
    with pytest.raises(APIError, match="not offered: web_search_20250305:web_search"):
        _turn({**typed_only, "tool_choice": {"type": "any"}})
    counted = messages_turn(
        CountTokensRequest.model_validate({"model": "m", "messages": PARIS}), "m"
    )
    assert counted.turn.messages == [{"role": "user", "content": PARIS[0]["content"]}]


def test_mid_conversation_system_folds_into_the_user_turn_beside_it():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "after u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "before u2"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "system", "content": "last"},
    ]
    assert folded(messages) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1\n\nafter u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "before u2\n\nu2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "last"},
    ]


class _FirstSystemOnly:
    """A tokenizer whose template refuses a system message after the first (Gemma's and
    others' rule); a token per message."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None, **_):
        if any(m["role"] == "system" for m in messages[1:]):
            raise TemplateError("System message must be at the beginning.")
        return list(range(len(messages) + add_generation_prompt))


class _Engine:
    model_id, tokenizer = "m", _FirstSystemOnly()
    tool_format = PROMPTED

    class settings:  # noqa: N801 - the engine's settings object, as prepare reads it
        prefix_min_tokens = 10**6

    def model_names(self):
        return {"m"}


def test_a_template_refusing_a_mid_conversation_system_message_still_serves():
    import asyncio

    made = _turn(
        {"max_tokens": 5, "messages": [*PARIS, {"role": "system", "content": "Agents: none."}]}
    )
    turn, prompt = asyncio.run(prepared(_Engine(), made.turn))
    assert turn.messages == [{"role": "user", "content": f"{PARIS[0]['content']}\n\nAgents: none."}]
    assert len(prompt.tokens) == 2


def _events(reply: MessagesReply, deltas: list[Delta], finished: Finished) -> list[dict]:
    events = reply.opening(Started("s", 3))
    for d in deltas:
        events += reply.on_delta(0, d)
    reply.on_finished(0, finished)
    events += reply.closing()
    for e in events:  # named, and each one of the SDK's own types
        assert e["event"] == e["data"]["type"]
        if e["event"] != "ping":
            EVENT.validate_python(e["data"])
    return [e["data"] for e in events]


def _deltas(*texts: str, finish: str = "stop", stop: str | None = None) -> list[Delta]:
    out = [Delta(text=t) for t in texts]
    out[-1].finish_reason, out[-1].stop_sequence = finish, stop
    return out


def test_a_streamed_text_reply_is_anthropics_event_sequence():
    reply = MessagesReply("m", None, list(range(10)))
    events = _events(reply, _deltas("Hel", "lo"), Finished(10, 2, 3))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["id"].startswith("msg_")
    usage = {"input_tokens": 7, "cache_read_input_tokens": 3, "cache_creation_input_tokens": 0}
    assert events[0]["message"]["usage"] == {**usage, "output_tokens": 0}
    assert events[-2]["usage"] == {**usage, "output_tokens": 2}
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    body = Message.model_validate(reply.body())
    assert body.content[0].text == "Hello" and body.stop_reason == "end_turn"


def test_thinking_text_and_stops_as_blocks():
    split = lambda: ThinkingSplit("<think>", "</think>")  # noqa: E731
    reply = MessagesReply("m", None, [1, 2], thinking=split)
    events = _events(
        reply, _deltas("<think>", "plan", "</think>", "Done", stop="END"), Finished(2, 4, 0)
    )
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[-2]["usage"]["output_tokens_details"] == {"thinking_tokens": 3}
    body = Message.model_validate(reply.body())
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in body.content] == [
        ("thinking", "plan"),
        ("text", "Done"),
    ]


def test_a_forced_call_streams_its_input_and_an_auto_call_comes_whole():
    forced = MessagesReply("m", None, [1], tools=prompted_plan(True, {"f"}))
    events = _events(forced, _deltas('{"name": "f", "arguments": {"a"', ": 1}}"), Finished(1, 2, 0))
    assert events[2]["content_block"]["type"] == "tool_use" and events[2]["content_block"][
        "id"
    ].startswith("toolu_")
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(parts) == 2 and json.loads("".join(parts)) == {"a": 1}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    auto = MessagesReply("m", None, [1], tools=prompted_plan(False, {"f"}))
    events = _events(
        auto,
        _deltas("<tool_call>", '{"name": "f", "arguments": {"a": 1}}</tool_call>'),
        Finished(1, 2, 0),
    )
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert parts == ['{"a": 1}']
    body = Message.model_validate(auto.body())
    assert body.content[0].input == {"a": 1} and body.stop_reason == "tool_use"
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2
    plan = prompted_plan(False, {"f"}, parallel=False)
    one = MessagesReply("m", None, [1], tools=plan, parallel=False)
    _events(one, _deltas(two), Finished(1, 2, 0))  # disable_parallel_tool_use: the first call
    assert [b.type for b in Message.model_validate(one.body()).content] == ["tool_use"]


def test_a_failure_midway_ends_the_stream_with_an_error_event():
    reply = MessagesReply("m", None, [1])
    reply.opening(Started("s", 0))
    reply.on_delta(0, Delta(text="a"))
    assert reply.error_event(Failed(503, "the server is shutting down")) == [
        {
            "event": "error",
            "data": {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "the server is shutting down"},
            },
        }
    ]
    assert reply.closing() == []  # no message_stop after the error


# ---------------------------------------------------------------------- the SDK


def test_messages_create_and_count_tokens(api):
    client = _client(api)
    system = _unique("You are terse.")
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=PARIS)
    assert isinstance(counted, MessageTokensCount)
    r = client.messages.create(
        model=MODEL, system=system, messages=PARIS, max_tokens=8, extra_body=GREEDY
    )
    assert isinstance(r, Message) and r.id.startswith("msg_") and r.role == "assistant"
    assert r.content[0].type == "text" and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens == counted.input_tokens > 0  # nothing of it was cached
    assert r.usage.cache_read_input_tokens == 0 and r.usage.cache_creation_input_tokens == 0
    assert 0 < r.usage.output_tokens <= 8


def test_messages_stream_text(api):
    system = _unique("You are terse.")
    with _client(api).messages.stream(
        model=MODEL, system=system, messages=PARIS, max_tokens=8, extra_body=GREEDY
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def _weather_request() -> dict:
    """A new conversation's fields (its own system prompt) with the weather tool."""
    system = _unique("You check the weather.")
    return {
        "model": MODEL,
        "system": system,
        "max_tokens": 24,
        "tools": [WEATHER],
        "extra_body": GREEDY,
    }


def test_tool_use_streamed_as_input_json_delta_then_a_tool_result_reuses_the_cache(api):
    client = _client(api)
    kwargs = _weather_request()
    with client.messages.stream(
        messages=PARIS, tool_choice={"type": "tool", "name": "get_weather"}, **kwargs
    ) as s:
        deltas = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        call = s.get_final_message()
    assert len(deltas) > 1 and call.stop_reason == "tool_use"  # the input as it was generated
    use = call.content[0]
    assert (
        use.type == "tool_use"
        and use.id.startswith("toolu_")
        and json.loads("".join(deltas)) == use.input
    )
    assert isinstance(use.input.get("city"), str)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}
    history = [
        *PARIS,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [result]},
    ]
    answer = client.messages.create(messages=history, **{**kwargs, "max_tokens": 6})
    # the first turn's prompt came from the cache: only the call and its result prefilled
    assert answer.usage.cache_read_input_tokens >= call.usage.input_tokens
    forced = client.messages.create(messages=PARIS, tool_choice={"type": "any"}, **kwargs)
    assert forced.content[0].type == "tool_use" and forced.content[0].name == "get_weather"
    assert forced.stop_reason == "tool_use"


def test_stop_sequences_and_max_tokens_zero(api):
    client = _client(api)
    r = client.messages.create(
        model=MODEL, messages=PARIS, max_tokens=30, stop_sequences=["e"], extra_body=GREEDY
    )
    assert (
        r.stop_reason == "stop_sequence" and r.stop_sequence == "e" and "e" not in r.content[0].text
    )
    system = _unique("You are a weather bot.")
    warm = client.messages.create(model=MODEL, system=system, messages=PARIS, max_tokens=0)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0
    again = client.messages.create(
        model=MODEL, system=system, messages=PARIS, max_tokens=2, extra_body=GREEDY
    )
    assert again.usage.cache_read_input_tokens == warm.usage.input_tokens - 1  # all but the last


def test_models_in_anthropics_shape(api):
    page = _client(api).models.list()
    assert [m.id for m in page.data] == [MODEL] and page.data[0].type == "model"
    assert _client(api).models.retrieve(MODEL).id == MODEL


# ---------------------------------------------------------------------- Claude Code's shape

# Claude Code 2.1's requests, field by field, with short stand-in texts of our own.
CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
    "context-management-2025-06-27,mid-conversation-system-2026-04-07,effort-2025-11-24",
    "x-api-key": "anything",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1 (external, sdk-cli)",
    "X-Claude-Code-Session-Id": "0b0e5f3c-0000-4000-8000-000000000001",
    "anthropic-dangerous-direct-browser-access": "true",
    "Accept": "application/json",
}
SCHEMA_2020 = "https://json-schema.org/draft/2020-12/schema"
CLAUDE_TOOLS = [
    {
        "name": "Bash",
        "description": "Runs a shell command.",
        "input_schema": {
            "$schema": SCHEMA_2020,
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command"},
                "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 9007199254740991},
                "run_in_background": {"type": "boolean", "default": False},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "name": "TaskUpdate",
        "description": "Updates a task.",
        "input_schema": {
            "$schema": SCHEMA_2020,
            "type": "object",
            "properties": {
                "id": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 64,
                    "pattern": "^[a-z0-9-]+$",
                },
                "status": {"anyOf": [{"const": "pending"}, {"const": "done"}]},
                "metadata": {
                    "type": "object",
                    "propertyNames": {"type": "string"},
                    "additionalProperties": {},
                },
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
    },
    {
        "name": "WebFetch",
        "description": "Fetches a page.",
        "input_schema": {
            "$schema": SCHEMA_2020,
            "type": "object",
            "properties": {
                "url": {"type": "string", "format": "uri"},
                "limit": {"type": "integer", "minimum": 1},
            },
            "required": ["url"],
            "additionalProperties": False,
        },
    },
]
CACHED = {"type": "ephemeral"}


def _claude_request(messages: list[dict], stream: bool = True) -> dict:
    body = {
        "model": MODEL,
        "messages": messages,
        "system": [
            {"type": "text", "text": "x-billing-line: version=0;"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": CACHED},
            {
                "type": "text",
                "text": "Use the tools to do the task. Be brief.",
                "cache_control": CACHED,
            },
        ],
        "tools": CLAUDE_TOOLS,
        "metadata": {
            "user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "s"})
        },
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        # Claude Code sends no temperature; greedy here keeps the stand-in's reply short.
        "temperature": 0,
    }
    return {**body, "stream": True} if stream else body


def _claude_first_turn(marker: bool = True) -> list[dict]:
    """The first user turn and the system entry Claude Code puts after it; the
    cache_control marker sits on the newest block only."""
    task = {"type": "text", "text": "run echo hi"}
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<reminder>today</reminder>"},
                {**task, "cache_control": CACHED} if marker else task,
            ],
        },
        {"role": "system", "content": "Agent types: none."},
    ]


def _stream(api, body: dict) -> tuple[list[tuple[str, dict]], dict]:
    """(event name, data) of each event of a stream, strictly parsed; and the headers."""
    conn = api.connection()
    try:
        conn.request(
            "POST",
            "/v1/messages?beta=true",
            json.dumps(body),
            {"Content-Type": "application/json", **CLAUDE_HEADERS},
        )
        r = conn.getresponse()
        assert r.status == 200, r.read()
        events, name = [], None
        for raw in r:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line[5:], parse_constant=_refuse)))
        return events, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def _refuse(constant: str):
    raise ValueError(f"not JSON: {constant}")


def test_claude_codes_requests_replayed(api):
    events, headers = _stream(api, _claude_request(_claude_first_turn()))
    assert all(name == data["type"] for name, data in events)  # every event named
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    for name, data in events:
        if name != "ping":
            EVENT.validate_python(data)
    assert names.count("content_block_start") == names.count("content_block_stop") >= 1
    assert "x-tools-not-offered" not in headers  # plain custom tools, all offered
    first = events[0][1]["message"]["usage"]
    # The non-streaming fallback Claude Code retries with: the same request, a Message.
    first_again = _claude_request(_claude_first_turn(), stream=False)
    r = api.post("/v1/messages?beta=true", first_again, CLAUDE_HEADERS)
    assert r.status_code == 200, r.text
    message = Message.model_validate(r.json())
    assert message.usage.cache_read_input_tokens == first["input_tokens"] - 1
    # The follow-up: the same history (the cache_control marker moved to the newest block),
    # a call of Bash with its thinking block resent with the empty signature it was given
    # (Claude Code's shape, whatever this small model said), and the call's result.
    call = {
        "type": "tool_use",
        "id": "toolu_replay1",
        "name": "Bash",
        "input": {"command": "echo hi"},
    }
    resent = [{"type": "thinking", "thinking": "run it", "signature": ""}, call]
    result = {
        "tool_use_id": "toolu_replay1",
        "type": "tool_result",
        "content": "hi",
        "is_error": False,
        "cache_control": CACHED,
    }
    follow = [
        *_claude_first_turn(marker=False),
        {"role": "assistant", "content": resent},
        {"role": "user", "content": [result]},
    ]
    events, _ = _stream(api, {**_claude_request(follow), "max_tokens": 8})
    usage = events[0][1]["message"]["usage"]
    assert usage["cache_read_input_tokens"] >= first["input_tokens"] - 1  # all the first turn
    assert events[-1][0] == "message_stop"
    # A sub-agent (or a new conversation): the same system prompt and tools, another task.
    # It forks the stored system prompt (system blocks and tools) instead of prefilling it.
    task = [{"role": "user", "content": [{"type": "text", "text": "list the files"}]}]
    r = api.post("/v1/messages?beta=true", {**_claude_request(task, stream=False), "max_tokens": 2})
    assert r.status_code == 200, r.text
    forked = r.json()["usage"]["cache_read_input_tokens"]
    assert 256 <= forked < first["input_tokens"]  # --prefix-min-tokens 256 .. the first turn


def test_claude_codes_title_request_answers_in_its_schema(api):
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}},
        "required": ["title"],
        "additionalProperties": False,
    }
    body = {
        **_claude_request(
            [{"role": "user", "content": [{"type": "text", "text": "Title this: run echo hi"}]}],
            stream=False,
        ),
        "tools": None,
        "thinking": {"type": "disabled"},
        "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}},
    }
    headers = {
        **CLAUDE_HEADERS,
        "anthropic-beta": CLAUDE_HEADERS["anthropic-beta"] + ",structured-outputs-2025-12-15",
    }
    r = api.post(
        "/v1/messages?beta=true", {k: v for k, v in body.items() if v is not None}, headers
    )
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["content"][0]["text"])["title"], str)


def test_anthropics_own_tools_are_left_out_and_named(api):
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "messages": PARIS,
        "tools": [
            WEATHER,
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        ],
    }
    r = api.post("/v1/messages", body)
    assert r.status_code == 200, r.text
    assert r.headers["x-tools-not-offered"] == (
        "web_search_20250305:web_search, text_editor_20250728:str_replace_based_edit_tool"
    )
    Message.model_validate(r.json())


# ---------------------------------------------------------------------- bad input

USE = {"type": "tool_use", "id": "toolu_known", "name": "get_weather", "input": {"city": "Paris"}}


def _result(tool_use_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "Sunny"}


BAD = {
    "a tool_result for an unknown tool_use_id": (
        {
            "messages": [
                *PARIS,
                {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [_result("toolu_nobody")]},
            ]
        },
        "toolu_nobody",
    ),
    "no max_tokens": ({"max_tokens": None}, "max_tokens"),
    "an unknown block type": (
        {"messages": [{"role": "user", "content": [{"type": "hologram", "data": "?"}]}]},
        "hologram",
    ),
    "an image to a text-only model": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": "iVBORw0KGgo=",
                            },
                        }
                    ],
                }
            ]
        },
        "text-only",
    ),
    "a server tool's block": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "server_tool_use",
                            "id": "srvtoolu_1",
                            "name": "web_search",
                            "input": {},
                        }
                    ],
                }
            ]
        },
        "server tools",
    ),
    "an assistant prefill": (
        {"messages": [*PARIS, {"role": "assistant", "content": "It is"}]},
        "prefill",
    ),
    "an empty content list": ({"messages": [{"role": "user", "content": []}]}, "empty list"),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    # As Anthropic says it: Claude Code reads "prompt is too long: N tokens > M".
    "a prompt past the context": (
        {"messages": [{"role": "user", "content": "word " * 9000}]},
        "prompt is too long: ",
    ),
    "tool_choice naming no tool": ({"tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    "an input_schema that is no object": (
        {"tools": [{**WEATHER, "input_schema": {"type": "string"}}]},
        "input_schema",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_anthropics_400(api, case):
    change, named = BAD[case]
    body = {"model": MODEL, "max_tokens": 4, "messages": PARIS, "tools": [WEATHER], **change}
    r = api.post("/v1/messages", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and named in error["error"]["message"]


def test_bad_input_leaves_the_conversation_as_it_was(api):
    client = _client(api)
    kwargs = _weather_request()
    call = client.messages.create(messages=PARIS, tool_choice={"type": "any"}, **kwargs)
    history = [*PARIS, {"role": "assistant", "content": [b.model_dump() for b in call.content]}]
    kwargs["max_tokens"] = 4  # what follows needs no more
    use_id = call.content[0].id
    for bad in (
        _result("toolu_other"),
        {"type": "hologram"},
        {"type": "image", "source": {"type": "url", "url": "http://x"}},
    ):
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(
                messages=[*history, {"role": "user", "content": [bad]}], **kwargs
            )
    good = client.messages.create(
        messages=[*history, {"role": "user", "content": [_result(use_id)]}], **kwargs
    )
    assert good.usage.cache_read_input_tokens >= call.usage.input_tokens  # the cache kept
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(**{**kwargs, "model": "claude-nope"}, messages=PARIS)
    assert e.value.body["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------------- bench/claude_cli.py

FAKE_CLAUDE = """
import os, sys, urllib.request
import anthropic
assert "claude-cli-" in os.environ["HOME"]  # a scratch HOME
base = os.environ["ANTHROPIC_BASE_URL"]
try:
    urllib.request.urlopen(urllib.request.Request(base + "/", method="HEAD"))
except Exception:
    pass  # any status: a reachability probe, as Claude Code's
client = anthropic.Anthropic(base_url=base, auth_token=os.environ["ANTHROPIC_AUTH_TOKEN"])
ask = {"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 4}
with client.messages.stream(messages=[{"role": "user", "content": sys.argv[2]}], **ask) as stream:
    print("".join(stream.text_stream))
"""


def test_the_claude_cli_runner_records_each_request(api, tmp_path):
    """bench/claude_cli.py with a stand-in for `claude -p` that talks as it does."""
    import sys

    from bench.claude_cli import claude_turn

    fake = tmp_path / "claude"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CLAUDE}")
    fake.chmod(0o755)
    turn = claude_turn(api.base_url, "Say hi", model=MODEL, claude=str(fake), timeout=120)
    assert turn.exit_status == 0, turn.stderr
    assert turn.stdout.strip() and turn.all_ok()
    head, post = turn.requests
    assert (head.method, head.path) == ("HEAD", "/")
    assert (post.path, post.status, post.stream) == ("/v1/messages", 200, True)
    assert 0 < post.ttft_s <= post.seconds
