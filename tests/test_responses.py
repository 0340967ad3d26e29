"""/v1/responses, black-box on the default model: the OpenAI SDK as its docs use it (create,
stream, parse, a function tool round trip, a previous_response_id chain reusing its
cache, retrieve, input_items, delete), Codex's request shape replayed with stand-in
texts, and bad input (OpenAI's error shape, a 4xx, the conversation untouched).

The `openai` package's own types are the oracle: every body and stream event here is
validated by them. The model is 135M parameters: what is asserted is the shape, the
statefulness and the cache, not the quality of the answers.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from server_harness import MODEL
from test_server_contract import strict

pytestmark = pytest.mark.slow(seconds=45)

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
SHORT = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}


def sse(api, body: dict, headers: dict | None = None) -> tuple[int, dict, list[dict]]:
    """(status, headers, events) of a streamed POST /v1/responses; each event's `event:`
    line must name its type."""
    conn = api.connection()
    try:
        sent = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        conn.request("POST", "/v1/responses", json.dumps(body), {**sent, **(headers or {})})
        r = conn.getresponse()
        head = {k.lower(): v for k, v in r.getheaders()}
        if r.status != 200:
            return r.status, head, [strict(r.read())]
        events, name = [], None
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = strict(line[5:].strip())
                assert data["type"] == name, (name, data)
                events.append(data)
        return r.status, head, events
    finally:
        conn.close()


def checked(events: list[dict]) -> Response:
    """Events as OpenAI's types read them, numbered in order; the final Response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    typed = [EVENTS.validate_python(e) for e in events]
    kinds = [e.type for e in typed]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = typed[-1].response
    assert all(e.response.id == final.id for e in typed if hasattr(e, "response"))
    return final


# ------------------------------------------------------------------ the SDK


def test_create_and_retrieve_as_openai_types_read_them(api):
    r = api.post("/v1/responses", {**SHORT, "input": "Say hi", "metadata": {"k": "v"}})
    assert r.status_code == 200
    body = Response.model_validate(strict(r.text))
    assert body.object == "response" and body.status in ("completed", "incomplete")
    assert body.output_text and body.output[0].type == "message"
    assert body.metadata == {"k": "v"} and body.store and body.model == MODEL
    usage = body.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert api.client.responses.retrieve(body.id).model_dump() == body.model_dump()
    counted = api.client.responses.input_tokens.count(model=MODEL, input="Say hi")
    assert counted.input_tokens == usage.input_tokens


def test_stream_events_in_order_and_the_sdk_stream_helper(api):
    status, _, events = sse(api, {**SHORT, "input": "Say hi", "stream": True})
    assert status == 200
    final = checked(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final.output_text == text
    # what was streamed is what was stored
    assert api.client.responses.retrieve(final.id).output_text == text
    # the SDK's helper wants response.completed: a reply that ends before max_output_tokens
    ends = {**SHORT, "max_output_tokens": 30}
    with api.client.responses.stream(input="Name a fruit.", **ends) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
        assert final.status == "completed" and final.output_text == "".join(deltas)


class City(BaseModel):
    name: str
    country: str


def test_parse_with_a_text_format(api):
    parsed = api.client.responses.parse(
        model=MODEL,
        input="Paris is a city in which country? Name and country.",
        text_format=City,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_a_five_turn_chain_reuses_its_cache(api):
    previous, last_input, ids = None, 0, []
    for turn in range(5):
        r = api.client.responses.create(
            input=f"Tell me fact number {turn}.", previous_response_id=previous, **SHORT
        )
        assert r.previous_response_id == previous
        assert r.usage.input_tokens_details.cached_tokens >= last_input  # only the new input
        previous, last_input = r.id, r.usage.input_tokens
        ids.append(r.id)
    # the last turn read the whole chain: 5 user messages and 4 replies before its own
    items = api.client.responses.input_items.list(previous, order="asc", limit=100).data
    assert [i.type for i in items] == ["message"] * 9
    assert [i.role for i in items][:3] == ["user", "assistant", "user"]
    assert items[-1].content[0].text == "Tell me fact number 4."
    newest = api.client.responses.input_items.list(previous, limit=2)
    assert [i.id for i in newest.data] == [items[-1].id, items[-2].id] and newest.has_more
    after = api.client.responses.input_items.list(previous, limit=2, after=newest.last_id)
    assert after.data[0].id == items[-3].id
    # a turn off an older response branches: the chain's newest stays as it was
    branch = api.client.responses.create(input="Again?", previous_response_id=ids[1], **SHORT)
    assert branch.usage.input_tokens < last_input
    api.client.responses.delete(ids[2])  # in the middle: the later ones keep their history
    with pytest.raises(openai.NotFoundError):
        api.client.responses.retrieve(ids[2])
    later = api.client.responses.input_items.list(previous, order="asc", limit=100).data
    assert [i.id for i in later] == [i.id for i in items]


def test_a_function_tool_round_trip(api):
    first = api.client.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        model=MODEL,
        temperature=0,
        max_output_tokens=40,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] and call.call_id.startswith("call_")
    second = api.client.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
        tools=[WEATHER],
        model=MODEL,
        temperature=0,
        max_output_tokens=24,
    )
    assert second.output and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the history as the SDK's own item types read it back
    items = api.client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_a_client_resending_its_history_reuses_the_cache(api):
    """As the Agents SDK and chat-style clients do: no previous_response_id, the whole
    history each time (stored, unkeyed): the session is found by its prompt."""
    first = api.client.responses.create(input="Name a fruit.", **SHORT)
    history = [{"role": "user", "content": "Name a fruit."}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    again = [*history, {"role": "user", "content": "Another?"}]
    second = api.client.responses.create(input=again, **SHORT)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # and continuing the second by id keeps to the session that served it
    third = api.client.responses.create(input="More?", previous_response_id=second.id, **SHORT)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens


def test_store_false_keeps_nothing_but_a_keyed_cache(api):
    body = {**SHORT, "input": "Say hi", "store": False, "prompt_cache_key": "resp-test-key"}
    first = api.post("/v1/responses", body).json()
    assert api.get(f"/v1/responses/{first['id']}").status_code == 404
    history = [{"role": "user", "content": "Say hi"}, *first["output"]]
    again = {**body, "input": [*history, {"role": "user", "content": "Again"}]}
    second = api.post("/v1/responses", again).json()
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"]
    assert "resp-test-key" in api.sessions()


# ------------------------------------------------------------------ Codex's shape

# Codex CLI's first request, field by field as captured (docs/agents.md), with
# short texts of our own in place of its prompts and tool descriptions.
CODEX_HEADERS = {
    "originator": "codex_exec",
    "session-id": "0193-test-session",
    "x-client-request-id": "0193-test-session",
    "x-codex-window-id": "0193-test-session:0",
    "x-codex-beta-features": "remote_compaction_v2",
    "x-codex-turn-metadata": json.dumps({"turn_id": "t1", "sandbox": "seccomp"}),
    "user-agent": "codex_exec/0.171.0",
}


def _fn(name: str, **properties: str) -> dict:
    return {
        "type": "function",
        "name": name,
        "description": f"Stand-in for {name}.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": t, "description": k} for k, t in properties.items()},
            "required": list(properties)[:1],
            "additionalProperties": False,
        },
    }


CODEX_TOOLS = [
    _fn("exec_command", cmd="string", workdir="string", tty="boolean", yield_time_ms="number"),
    _fn("write_stdin", session_id="number", chars="string"),
    _fn("view_image", path="string"),
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Stand-in agent tools.",
        "tools": [_fn("close_agent", target="string"), _fn("wait_agent", timeout_ms="number")],
    },
    _fn("get_goal"),
    {"type": "web_search", "external_web_access": False},
]


def _message(role: str, *texts: str, kind: str = "input_text") -> dict:
    content = [{"type": kind, "text": t} for t in texts]
    return {"type": "message", "id": f"msg_{role}_{len(texts)}", "role": role, "content": content}


def codex_request(session: str, *extra: dict) -> dict:
    return {
        "model": MODEL,
        "stream": True,
        "store": False,
        "instructions": None,
        "input": [
            _message("developer", "You are a coding agent (a stand-in prompt)."),
            _message("developer", "Stand-in permissions.", "Stand-in skills."),
            _message("user", "<environment_context>cwd: /tmp</environment_context>"),
            _message("user", "run echo hi"),
            *extra,
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": session,
        "client_metadata": {"session_id": session, "turn_id": "t1"},
        "max_output_tokens": 8,  # Codex sends none; here the reply is short
        "temperature": 0,
    }


def test_codex_request_shape(api):
    status, head, events = sse(api, codex_request("codex-shape-1"), CODEX_HEADERS)
    assert status == 200, events
    assert head["x-tools-not-offered"] == "web_search"
    final = checked(events)
    assert final.id.startswith("resp_") and final.store is False
    offered = [t.type for t in final.tools]
    assert "web_search" not in offered and "namespace" in offered
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done  # what Codex builds its answer from
    # After a call, Codex resends the whole history with the call and its output; the
    # key's session holds the first request's prompt.
    call = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "exec_command",
        "arguments": json.dumps({"cmd": "echo hi"}),
        "status": "completed",
    }
    output = {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "hi\n"}
    body = codex_request("codex-shape-1", call, output)
    status, _, again = sse(api, body, CODEX_HEADERS)
    assert status == 200
    usage = checked(again).usage
    assert usage.input_tokens_details.cached_tokens >= final.usage.input_tokens - 1


def test_a_namespace_function_is_called_by_its_namespace(api):
    body = {
        **codex_request("codex-shape-2"),
        "stream": False,
        "tool_choice": {"type": "function", "name": "multi_agent_v1.close_agent"},
        "max_output_tokens": 30,
    }
    r = api.post("/v1/responses", body)
    assert r.status_code == 200, r.text
    [call] = Response.model_validate(strict(r.text)).output
    assert (call.namespace, call.name) == ("multi_agent_v1", "close_agent")
    # sent back as Codex sends it: the namespace apart, its output after it
    item = {k: v for k, v in call.model_dump().items() if v is not None}
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "closed"}
    again = {**body, "tool_choice": "auto", "max_output_tokens": 4}
    again = api.post("/v1/responses", {**again, "input": [*body["input"], item, output]})
    assert again.status_code == 200, again.text


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id", "not found"),
        ({"previous_response_id": "../../etc/passwd"}, "previous_response_id", "not found"),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[0].call_id",
            "no call before it",
        ),
        ({"input": [{"type": "hologram", "text": "x"}]}, "input.0.type", "unknown type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.message.content.0.type",
            "reads text only",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type", "hosted"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "does not run"),
        ({"background": True}, "background", "not supported"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": '"\\ud800"'}
                ]
            },
            "input.0.function_call.arguments",
            "surrogate",
        ),
        ({"input": []}, "input", "at least 1"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "context"),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "array"}}]},
            "tools.0.function.parameters",
            "object",
        ),
    ],
)
def test_bad_input_is_a_400_in_openais_shape(api, change, param, words):
    r = api.post("/v1/responses", {**SHORT, "input": "Say hi", **change})
    assert r.status_code == 400, r.text
    error = strict(r.text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_a_bad_turn_leaves_the_chain_as_it_was(api):
    first = api.client.responses.create(input="Say hi", **SHORT)
    with pytest.raises(openai.BadRequestError) as e:
        api.client.responses.create(
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}],
            **SHORT,
        )
    assert e.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.BadRequestError):  # an unknown item type in a continuation
        api.client.responses.create(
            previous_response_id=first.id, input=[{"type": "hologram"}], **SHORT
        )
    assert api.client.responses.retrieve(first.id).output_text == first.output_text
    second = api.client.responses.create(input="Again", previous_response_id=first.id, **SHORT)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert api.get("/v1/responses/resp_unknown").status_code == 404
    assert api.request("DELETE", "/v1/responses/" + "resp_" + "1" * 32).status_code == 404


# ---------------------------------------------------------------------- bench/codex_cli.py

FAKE_CODEX = """
import os, re, sys
from pathlib import Path
from openai import OpenAI
config = (Path(os.environ["CODEX_HOME"]) / "config.toml").read_text()
base = re.search(r'base_url = "([^"]+)"', config).group(1)
model = re.search(r'^model = "([^"]+)"', config, re.M).group(1)
client = OpenAI(base_url=base, api_key="unused", max_retries=0)
ask = [{"role": "developer", "content": "You are a stand-in agent."},
       {"role": "user", "content": sys.argv[-1]}]
with client.responses.stream(model=model, input=ask, max_output_tokens=6, temperature=0,
                             extra_body={"prompt_cache_key": "fake-codex"}) as stream:
    print("".join(e.delta for e in stream if e.type == "response.output_text.delta"))
"""


def test_the_codex_cli_runner_records_each_request(api, tmp_path):
    """bench/codex_cli.py (through bench/recording_proxy.py) with a stand-in for `codex
    exec` that reads its CODEX_HOME's provider and streams a response, twice: the
    resumed turn's request shows the tokens the server had cached."""
    import sys

    from bench.codex_cli import run_codex_session

    fake = tmp_path / "codex"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CODEX}")
    fake.chmod(0o755)
    turns = run_codex_session(
        f"{api.base_url}/v1", ["Say hi.", "Say hi."], MODEL, timeout=120, codex=str(fake)
    )
    assert [t.exit_status for t in turns] == [0, 0], turns[-1].stderr
    assert all(t.all_2xx and t.stdout.strip() for t in turns)
    first, again = (t.requests[0] for t in turns)
    assert (first.method, first.path, first.stream) == ("POST", "/v1/responses", True)
    assert 0 < first.ttft_s <= first.seconds and first.output == turns[0].stdout.strip()
    assert first.input_tokens == again.input_tokens > 0
    assert again.cached_tokens >= again.input_tokens - 1  # the key's session served it
