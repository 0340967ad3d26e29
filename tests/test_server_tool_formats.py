"""Models with each family's tool-call format through the real server, in all three APIs.

The stand-in is a tiny random qwen3 with a byte-level vocabulary and a template that
renders tools and earlier calls as that family's does (tests/tool_templates.py: Qwen3-
Coder's, GLM's, Mistral's, Kimi K2's, Hermes'; and gpt-oss's Harmony on a gpt-oss): what
it writes on its own is noise, so the checks are the ones that hold for any weights: a
forced call comes back parsed, in the format the model was taught and with arguments
valid against the schema; and a 3-turn tool loop (call, result, answer) re-renders the
history exactly as the cache holds it, so each turn reads the one before from cache.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from families import write_folder
from openai import OpenAI
from server_harness import running_server
from tool_templates import SPECIAL, template

pytestmark = pytest.mark.slow(seconds=90)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
QUESTION = "What is the weather in Rome for the next days?"


@pytest.fixture(scope="module", params=["qwen3_coder", "glm47", "mistral", "kimi_k2",
                                        "json_tools", "llama3_json"])  # fmt: skip
def server(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(request.param)
    # Llama's vocabulary has no other family's markers (mlx-lm reads some from it).
    special = SPECIAL[:3] if request.param == "llama3_json" else SPECIAL
    folder = write_folder("qwen3", root / "model", template(request.param), special)
    with running_server(root, "--model", str(folder), "--max-sessions", "4") as running:
        running.format = request.param
        # Free text only where a reply is not a call: no special token to render back.
        running.no_specials = {str(i): -100 for i in range(len(special))}
        yield running


def _openai(server) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                               max_retries=0)  # fmt: skip


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": False}


def _forced_responses_call(client: OpenAI):
    """A Responses create forced to call: (the response, its schema-valid call item)."""
    response = client.responses.create(
        model="default", input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="required",
        temperature=0, max_output_tokens=200,
    )  # fmt: skip
    [item] = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), SCHEMA)
    return response, item


def test_the_start_up_names_the_format(server):
    assert f"tool calls: {server.format} format" in server.log_text()


def test_chat_three_turn_tool_loop_reads_each_turn_from_cache(server):
    client, key = _openai(server), {"prompt_cache_key": "chat-loop"}
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model="default", messages=messages, tools=[CHAT_TOOL], tool_choice="required",
        temperature=0, max_tokens=200, extra_body=key,
    )  # fmt: skip
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and first.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    cached = [first.usage.prompt_tokens_details.cached_tokens]
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    for follow_up in ("", "And tomorrow?"):
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=[CHAT_TOOL], temperature=0, max_tokens=5,
            logit_bias=server.no_specials, extra_body=key,
        )  # fmt: skip
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        # Everything the session held (prompt and reply) came from cache: the call was
        # rendered back exactly as the model wrote it.
        assert cached[-1] >= seen - 1, (cached, seen)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        seen = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert cached[0] < cached[1] < cached[2]


def test_a_forced_call_streams_in_chat_and_responses(server):
    client = _openai(server)
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=200, stream=True,
    )  # fmt: skip
    name, arguments, finish = None, "", None
    for chunk in stream:
        for entry in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = entry.function.name or name
            arguments += entry.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert (name, finish) == ("get_weather", "tool_calls")
    jsonschema.validate(json.loads(arguments), SCHEMA)

    response, item = _forced_responses_call(client)
    follow = client.responses.create(
        model="default", previous_response_id=response.id, temperature=0, max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}],
        tools=[RESPONSES_TOOL],
    )  # fmt: skip
    assert follow.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens


def test_messages_tool_loop_with_a_forced_call(server):
    client = _anthropic(server)
    tool = {"name": "get_weather", "input_schema": SCHEMA}
    headers = {"X-Session-ID": "messages-loop"}
    messages = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(
        model="default", max_tokens=200, messages=messages, tools=[tool],
        tool_choice={"type": "any"}, extra_headers=headers,
    )  # fmt: skip
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and first.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny"}]},
    ]  # fmt: skip
    second = client.messages.create(
        model="default", max_tokens=5, messages=messages, tools=[tool],
        extra_headers=headers,
    )  # fmt: skip
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """A tiny random gpt-oss with a Harmony template and vocabulary."""
    from tool_templates import HARMONY_SPECIAL

    root = tmp_path_factory.mktemp("harmony")
    special = ["<|im_start|>", "<|im_end|>", *HARMONY_SPECIAL[:-1], "[UNK]"]
    folder = write_folder("gpt_oss", root / "model", template("harmony"), special)
    with running_server(root, "--model", str(folder), "--policy", "h2o") as running:
        yield running


def test_harmony_forced_calls_come_back_parsed_in_every_api(harmony):
    assert "tool calls: harmony format; reasoning: Harmony channels" in harmony.log_text()
    client = _openai(harmony)
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL],
        tool_choice="required", temperature=0, max_tokens=200, reasoning_effort="low",
    )  # fmt: skip
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert not reply.choices[0].message.content  # the channel markers are not content
    _forced_responses_call(client)
    message = _anthropic(harmony).messages.create(
        model="default", max_tokens=200, messages=[{"role": "user", "content": QUESTION}],
        tools=[{"name": "get_weather", "input_schema": SCHEMA}], tool_choice={"type": "any"},
    )  # fmt: skip
    [use] = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMA)
